"""``AsyncLocks``: joblock's locks for asyncio programs.

The same methods as ``joblock.Locks``, as coroutines, on the same compiled or pure
core; only the I/O differs. Tokens live on the lease, never in task- or
thread-local storage, and cancellation keeps the truth:

- a cancelled ``acquire`` (or ``acquire_many``/``dedupe``) lets the round trip in
  flight finish and releases whatever it was granted, so no lock is left held that
  nobody owns;
- a cancelled ``release`` or ``extend`` lets its command finish, so the lease's
  ``held`` ends up saying what Redis did.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, Protocol, TypeVar, cast, overload

from . import errors, lost, metrics
from ._client import LocksBase, check_flags, check_replicas
from ._engine.aio import Driver
from ._engine.ops import EXTEND, RELEASE, REMAINING
from ._engine.topology import RefreshSlots
from .cluster import ClusterBase
from .jobs import LockedJob, job
from .lost import AsyncLost
from .redlock import RedlockBase, RedlockLease, RedlockOptions
from .renew import AsyncRenewer

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._client import ClientOptions
    from .jobs import JobOptions
    from .locks import Lease

__all__ = ["AsyncClusterLocks", "AsyncLease", "AsyncLocks", "AsyncRedlock", "AsyncRedlockLease"]

logger = logging.getLogger("joblock")

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class AsyncLease(Protocol):
    """A lease of an ``AsyncLocks`` or ``AsyncClusterLocks``, for annotations.

    At run time it is a ``joblock.Lease`` (the same class), whose ``release``,
    ``extend`` and ``remaining`` return coroutines when an asyncio client owns it.
    It is no ``with`` block: ``async with locks.lock(...)`` is.
    """

    @property
    def key(self) -> str | bytes: ...
    @property
    def token(self) -> bytes: ...
    @property
    def fence(self) -> int | None: ...
    @property
    def held(self) -> bool: ...
    @property
    def lost(self) -> AsyncLost: ...
    def check(self) -> None: ...
    def valid_for(self) -> float: ...
    async def release(self) -> bool: ...
    async def extend(self, ttl: float | timedelta, *, min_replicas: int | None = None) -> bool: ...
    async def remaining(self) -> float | None: ...


class AsyncRedlockLease(Protocol):
    """A lease of an ``AsyncRedlock``, for annotations.

    At run time it is a ``joblock.RedlockLease``, whose ``release`` and ``extend``
    return coroutines when an AsyncRedlock owns it; ``remaining()`` reads the local
    clock and stays a plain method.
    """

    @property
    def key(self) -> str | bytes: ...
    @property
    def token(self) -> bytes: ...
    @property
    def fence(self) -> None: ...
    @property
    def held(self) -> bool: ...
    @property
    def validity(self) -> float: ...
    async def release(self) -> bool: ...
    async def extend(self, ttl: float | timedelta) -> bool: ...
    def remaining(self) -> float | None: ...


class AsyncLocks(LocksBase):
    """Redis locks for asyncio: single, batched and deduplicating.

    One AsyncLocks serves one event loop at a time (a later loop, as another
    ``asyncio.run``, starts with fresh connections). Any number of tasks may use it
    at once: they share one connection, and the calls they make in the same loop
    turn go out in one write.
    """

    asynchronous = True

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", **options: Unpack[ClientOptions]) -> None:
        super().__init__(url, **options)
        self._driver = self._make_driver()
        self._renew: AsyncRenewer | None = None

    def _make_driver(self) -> Driver:
        settings_for, resolver = self._where()
        return Driver(self._core, settings_for, resolver=resolver)

    async def close(self) -> None:
        """Waits for pending clean-ups, then closes the connection (it reopens when used again)."""
        await self._driver.close()

    async def __aenter__(self) -> AsyncLocks:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- single locks -------------------------------------------------------------------

    @metrics.measured("acquire")
    async def acquire(
        self,
        key: str | bytes,
        ttl: float | timedelta,
        *,
        wait: float | timedelta | None = None,
        fence: bool = False,
        limit: int = 1,
        fair: bool = False,
        shared: bool = False,
        min_replicas: int | None = None,
    ) -> AsyncLease | None:
        """Takes the lock for ``ttl`` seconds: a Lease, or None while someone else holds it."""
        if fence is not False or fair is not False or shared is not False:
            check_flags(fence, fair, shared)
        replicas = self.settings.min_replicas if min_replicas is None else check_replicas(min_replicas)
        if not wait and not fair and not shared:
            op = self._acquire_op(key, ttl, fence, limit)
            if not replicas:
                lease: AsyncLease | None = await self._driver.run(op)  # (no cast: a call on every acquire)
                return lease
            return cast("AsyncLease | None", await self._driver.drive(self._confirmed(op, replicas, ttl)))
        plan = self._acquiring(key, ttl, wait, fence, limit, fair, shared)
        return cast("AsyncLease | None", await self._driver.drive(self._confirmed_wait(plan, replicas, ttl)))

    @asynccontextmanager
    async def lock(
        self,
        key: str | bytes,
        ttl: float | timedelta,
        *,
        wait: float | timedelta | None = None,
        fence: bool = False,
        limit: int = 1,
        fair: bool = False,
        shared: bool = False,
        min_replicas: int | None = None,
        on_lost: str | Callable[[AsyncLease], object] = "ignore",
    ) -> AsyncIterator[AsyncLease]:
        """``async with locks.lock(key, ttl):`` holds the lock for the block.

        Raises LockNotAcquired when another holder has it (after ``wait``).
        ``on_lost`` says what stops the block once the lease is lost (its deadline
        passed unconfirmed, an extend found it gone, an operator released it):
        ``"cancel"`` cancels the block's task, which then ends with LockLost;
        ``"exit"`` ends the process (status ``joblock.lost.EXIT_STATUS``); a callable
        (maybe async) is given the lease; ``"ignore"`` (the default) watches nothing.
        """
        guarded = on_lost != "ignore" and lost.check_on_lost(on_lost, True)
        lease = await self.acquire(
            key, ttl, wait=wait, fence=fence, limit=limit, fair=fair, shared=shared, min_replicas=min_replicas
        )
        if lease is None:
            raise errors.LockNotAcquired(key)
        try:
            if not guarded:
                yield lease
            else:
                async with lost.AsyncGuard(self, lease, guarded):
                    yield lease
        finally:
            if lease.held and not await self._release(lease):
                logger.warning("lock %r expired or was taken before release", lease.key)

    # What a Lease's methods call (they return these coroutines).

    async def _release(self, lease: Lease | AsyncLease) -> bool:
        op = self._lease_op(RELEASE, lease)
        released: bool = False if op is None else await self._driver.run(op)
        return released

    async def _extend(
        self, lease: Lease | AsyncLease, ttl: float | timedelta, min_replicas: int | None = None
    ) -> bool:
        replicas = self._replicas(min_replicas)
        op = self._lease_op(EXTEND, lease, ttl)
        if op is None:
            return False
        if not replicas:
            return cast(bool, await self._driver.run(op))
        return cast(bool, await self._driver.drive(self._confirmed(op, replicas, ttl, lease)))

    async def _remaining(self, lease: Lease | AsyncLease) -> float | None:
        op = self._lease_op(REMAINING, lease)
        return None if op is None else cast("float | None", await self._driver.run(op))

    def _exit(self, lease: Lease) -> None:
        raise TypeError("an asyncio lease is not a `with` block: use `async with locks.lock(...)`")

    async def _listen_for(self, lease: Lease | AsyncLease) -> Any:
        """The subscription that hears of an operator's release of ``lease`` (None if
        Redis cannot be reached now: the lease's deadline still holds)."""
        try:
            return await self._driver.drive(self._watching(lease))
        except errors.JoblockError as e:
            logger.info("joblock cannot hear of a release of %r by an operator: %s", lease.key, e)
            return None

    # -- batches -----------------------------------------------------------------------

    @metrics.measured("acquire_many")
    async def acquire_many(
        self,
        keys: Iterable[str | bytes],
        ttl: float | timedelta,
        *,
        fence: bool = False,
        limit: int = 1,
        min_replicas: int | None = None,
    ) -> list[AsyncLease | None]:
        """Takes many locks, pipelined: ``[Lease | None]`` in the order of ``keys``."""
        batch = self._acquire_batch(keys, ttl, fence, limit)
        plan = self._acquiring_many(batch, self._replicas(min_replicas), ttl)
        return cast("list[AsyncLease | None]", await self._driver.drive(plan))

    @metrics.measured("dedupe")
    async def dedupe(
        self,
        job: str,
        arg_tuples: Iterable[tuple[Any, ...] | list[Any]],
        ttl: float | timedelta,
        *,
        fence: bool = False,
        limit: int = 1,
        min_replicas: int | None = None,
    ) -> list[AsyncLease | None]:
        """One lock per distinct argument tuple of ``job``: ``[Lease | None]`` in order."""
        batch = self._dedupe_batch(job, arg_tuples, ttl, fence, limit)
        plan = self._acquiring_many(batch, self._replicas(min_replicas), ttl)
        return cast("list[AsyncLease | None]", await self._driver.drive(plan))

    @metrics.measured("release_many")
    async def release_many(self, leases: Iterable[AsyncLease | None]) -> list[bool]:
        """Releases many leases, pipelined: ``[bool]`` in order; None entries give False."""
        return await self._driver.drive(self._releasing_many(leases))

    @metrics.measured("extend_many")
    async def extend_many(
        self, leases: Iterable[AsyncLease | None], ttl: float | timedelta, *, min_replicas: int | None = None
    ) -> list[bool]:
        """Resets many leases' ttl, pipelined: ``[bool]``, True where the lock is still ours."""
        return await self._driver.drive(self._extending_many(leases, ttl, self._replicas(min_replicas)))

    # -- jobs ----------------------------------------------------------------------------

    # The job is a coroutine function; so may on_locked be (its result is awaited).
    @overload
    def job(
        self, *, ttl: float | timedelta, on_locked: Literal["raise"], **options: Unpack[JobOptions]
    ) -> Callable[[Callable[P, Awaitable[R]]], LockedJob[P, Coroutine[Any, Any, R]]]: ...
    @overload
    def job(
        self, *, ttl: float | timedelta, on_locked: Callable[..., Awaitable[T]], **options: Unpack[JobOptions]
    ) -> Callable[[Callable[P, Awaitable[R]]], LockedJob[P, Coroutine[Any, Any, R | T]]]: ...
    @overload
    def job(
        self, *, ttl: float | timedelta, on_locked: Callable[..., T], **options: Unpack[JobOptions]
    ) -> Callable[[Callable[P, Awaitable[R]]], LockedJob[P, Coroutine[Any, Any, R | T]]]: ...
    @overload
    def job(
        self, *, ttl: float | timedelta, on_locked: Literal["skip"] = ..., **options: Unpack[JobOptions]
    ) -> Callable[[Callable[P, Awaitable[R]]], LockedJob[P, Coroutine[Any, Any, R | None]]]: ...
    def job(self, **options: Any) -> Callable[[Callable[..., Any]], LockedJob[..., Any]]:
        """Decorates an ``async def`` job run under its lock; the options of ``Locks.job``."""
        return job(self, **options)

    def _renewer(self) -> AsyncRenewer:
        if self._renew is None:
            self._renew = AsyncRenewer(self)
        return self._renew


class AsyncClusterLocks(ClusterBase, AsyncLocks):
    """``joblock.ClusterLocks`` for asyncio: the same methods, as coroutines."""

    def _make_driver(self) -> Driver:
        return Driver(self._core, self._node_settings)

    async def refresh(self) -> None:
        """Reads the slot map again from the first node that answers."""
        await self._driver.run(RefreshSlots(self._topology))

    async def nodes(self) -> list[str]:
        """The primaries serving slots, as ``host:port`` (reads the slot map first if needed)."""
        if not self._topology.slots:
            await self.refresh()
        return self._nodes()


class AsyncRedlock(RedlockBase):
    """``joblock.Redlock`` for asyncio: the same methods, as coroutines (RedlockLease's too)."""

    asynchronous = True

    def __init__(self, urls: Sequence[str], **options: Unpack[RedlockOptions]) -> None:
        super().__init__(urls, **options)
        servers = self.servers
        self._driver = Driver(self._core, lambda i: servers[i])

    async def close(self) -> None:
        """Waits for pending clean-ups, then closes the connections."""
        await self._driver.close()

    async def __aenter__(self) -> AsyncRedlock:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @metrics.measured("acquire")
    async def acquire(
        self, key: str | bytes, ttl: float | timedelta, *, wait: float | timedelta | None = None
    ) -> AsyncRedlockLease | None:
        """Takes the lock on a quorum: a RedlockLease, or None while someone else holds it."""
        return cast("AsyncRedlockLease | None", await self._driver.drive(self._acquiring(key, ttl, wait)))

    @asynccontextmanager
    async def lock(
        self,
        key: str | bytes,
        ttl: float | timedelta,
        *,
        wait: float | timedelta | None = None,
        on_lost: str | Callable[[AsyncRedlockLease], object] = "ignore",
    ) -> AsyncIterator[AsyncRedlockLease]:
        """``async with redlock.lock(key, ttl):`` holds the lock for the block (LockNotAcquired when busy).

        ``on_lost`` as ``AsyncLocks.lock``'s: what stops the block once its validity ends unconfirmed.
        """
        guarded = on_lost != "ignore" and lost.check_on_lost(on_lost, True)
        lease = await self.acquire(key, ttl, wait=wait)
        if lease is None:
            raise errors.LockNotAcquired(key)
        try:
            if not guarded:
                yield lease
            else:
                async with lost.AsyncGuard(self, lease, guarded):
                    yield lease
        finally:
            if lease.held and not await self._release(lease):
                logger.warning("lock %r expired or was taken before release", lease.key)

    @metrics.measured("acquire_many")
    async def acquire_many(
        self, keys: Iterable[str | bytes], ttl: float | timedelta
    ) -> list[AsyncRedlockLease | None]:
        """Takes many locks, each on a quorum: ``[RedlockLease | None]`` in the order of ``keys``."""
        return cast(
            "list[AsyncRedlockLease | None]", await self._driver.drive(self._acquiring_many(keys, ttl))
        )

    @metrics.measured("dedupe")
    async def dedupe(
        self, job: str, arg_tuples: Iterable[tuple[Any, ...] | list[Any]], ttl: float | timedelta
    ) -> list[AsyncRedlockLease | None]:
        """One lock per distinct argument tuple of ``job``, each on a quorum."""
        plan = self._deduping(job, arg_tuples, ttl)
        return cast("list[AsyncRedlockLease | None]", await self._driver.drive(plan))

    @metrics.measured("release_many")
    async def release_many(self, leases: Iterable[AsyncRedlockLease | None]) -> list[bool]:
        """Releases many leases on every server: ``[bool]``, True where a quorum still held it."""
        return await self._driver.drive(self._releasing_many(leases))

    @metrics.measured("extend_many")
    async def extend_many(
        self, leases: Iterable[AsyncRedlockLease | None], ttl: float | timedelta
    ) -> list[bool]:
        """Resets many leases' ttl on every server: True where a quorum did so in time."""
        return await self._driver.drive(self._extending_many(leases, ttl))

    async def _release(self, lease: RedlockLease | AsyncRedlockLease) -> bool:
        return await self._driver.drive(self._releasing_one(cast(RedlockLease, lease)))

    async def _extend(self, lease: RedlockLease | AsyncRedlockLease, ttl: float | timedelta) -> bool:
        return await self._driver.drive(self._extending_one(cast(RedlockLease, lease), ttl))

    def _exit(self, lease: RedlockLease) -> None:
        raise TypeError("an asyncio lease is not a `with` block: use `async with redlock.lock(...)`")

    async def _listen_for(self, lease: RedlockLease) -> Any:
        return None
