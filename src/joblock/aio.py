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
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from . import errors
from ._client import LocksBase
from ._engine.aio import Driver
from ._engine.ops import EXTEND, RELEASE, REMAINING
from ._engine.topology import RefreshSlots
from .cluster import ClusterBase
from .jobs import job
from .redlock import RedlockBase, RedlockLease
from .renew import AsyncRenewer

__all__ = ["AsyncClusterLocks", "AsyncLocks", "AsyncRedlock"]

logger = logging.getLogger("joblock")

F = TypeVar("F", bound=Callable[..., Any])


class AsyncLocks(LocksBase):
    """Redis locks for asyncio: single, batched and deduplicating.

    One AsyncLocks serves one event loop at a time (a later loop, as another
    ``asyncio.run``, starts with fresh connections). Any number of tasks may use it
    at once: they share one connection, and the calls they make in the same loop
    turn go out in one write.
    """

    asynchronous = True

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", **options: Any) -> None:
        super().__init__(url, **options)
        self._driver = self._make_driver()
        self._renew: AsyncRenewer | None = None

    def _make_driver(self) -> Driver:
        settings = self.settings
        return Driver(self._core, lambda _: settings)

    async def close(self) -> None:
        """Waits for pending clean-ups, then closes the connection (it reopens when used again)."""
        await self._driver.close()

    async def __aenter__(self) -> AsyncLocks:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- single locks -------------------------------------------------------------------

    async def acquire(
        self, key: str | bytes, ttl: float, *, wait: float | None = None, fence: bool = False
    ) -> Any:
        """Takes the lock for ``ttl`` seconds: a Lease, or None while someone else holds it."""
        if wait is None:
            return await self._driver.run(self._acquire_op(key, ttl, fence))
        return await self._driver.drive(self._acquiring(key, ttl, wait, fence))

    @asynccontextmanager
    async def lock(
        self, key: str | bytes, ttl: float, *, wait: float | None = None, fence: bool = False
    ) -> AsyncIterator[Any]:
        """``async with locks.lock(key, ttl):`` holds the lock for the block.

        Raises LockNotAcquired when another holder has it (after ``wait``).
        """
        lease = await self.acquire(key, ttl, wait=wait, fence=fence)
        if lease is None:
            raise errors.LockNotAcquired(key)
        try:
            yield lease
        finally:
            if lease._held and not await self._release(lease):
                logger.warning("lock %r expired or was taken before release", lease.key)

    # What a Lease's methods call (they return these coroutines).

    async def _release(self, lease: Any) -> bool:
        op = self._lease_op(RELEASE, lease)
        return False if op is None else await self._driver.run(op)

    async def _extend(self, lease: Any, ttl: float) -> bool:
        op = self._lease_op(EXTEND, lease, ttl)
        return False if op is None else await self._driver.run(op)

    async def _remaining(self, lease: Any) -> float | None:
        op = self._lease_op(REMAINING, lease)
        return None if op is None else await self._driver.run(op)

    def _exit(self, lease: Any) -> None:
        raise TypeError("an asyncio lease is not a `with` block: use `async with locks.lock(...)`")

    # -- batches -----------------------------------------------------------------------

    async def acquire_many(
        self, keys: Iterable[str | bytes], ttl: float, *, fence: bool = False
    ) -> list[Any]:
        """Takes many locks, pipelined: ``[Lease | None]`` in the order of ``keys``."""
        return await self._driver.drive(self._acquiring_many(self._acquire_batch(keys, ttl, fence)))  # type: ignore[no-any-return]

    async def dedupe(
        self, job: str, arg_tuples: Iterable[tuple[Any, ...]], ttl: float, *, fence: bool = False
    ) -> list[Any]:
        """One lock per distinct argument tuple of ``job``: ``[Lease | None]`` in order."""
        return await self._driver.drive(self._acquiring_many(self._dedupe_batch(job, arg_tuples, ttl, fence)))  # type: ignore[no-any-return]

    async def release_many(self, leases: Iterable[Any]) -> list[bool]:
        """Releases many leases, pipelined: ``[bool]`` in order; None entries give False."""
        return await self._driver.drive(self._releasing_many(leases))  # type: ignore[no-any-return]

    async def extend_many(self, leases: Iterable[Any], ttl: float) -> list[bool]:
        """Resets many leases' ttl, pipelined: ``[bool]``, True where the lock is still ours."""
        return await self._driver.drive(self._extending_many(leases, ttl))  # type: ignore[no-any-return]

    # -- jobs ----------------------------------------------------------------------------

    def job(self, **options: Any) -> Callable[[F], F]:
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

    def __init__(self, urls: Sequence[str], **options: Any) -> None:
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

    async def acquire(
        self, key: str | bytes, ttl: float, *, wait: float | None = None
    ) -> RedlockLease | None:
        """Takes the lock on a quorum: a RedlockLease, or None while someone else holds it."""
        return await self._driver.drive(self._acquiring(key, ttl, wait))  # type: ignore[no-any-return]

    @asynccontextmanager
    async def lock(
        self, key: str | bytes, ttl: float, *, wait: float | None = None
    ) -> AsyncIterator[RedlockLease]:
        """``async with redlock.lock(key, ttl):`` holds the lock for the block (LockNotAcquired when busy)."""
        lease = await self.acquire(key, ttl, wait=wait)
        if lease is None:
            raise errors.LockNotAcquired(key)
        try:
            yield lease
        finally:
            if lease._held and not await self._release(lease):
                logger.warning("lock %r expired or was taken before release", lease.key)

    async def acquire_many(self, keys: Iterable[str | bytes], ttl: float) -> list[RedlockLease | None]:
        """Takes many locks, each on a quorum: ``[RedlockLease | None]`` in the order of ``keys``."""
        return await self._driver.drive(self._acquiring_many(keys, ttl))  # type: ignore[no-any-return]

    async def dedupe(
        self, job: str, arg_tuples: Iterable[tuple[Any, ...]], ttl: float
    ) -> list[RedlockLease | None]:
        """One lock per distinct argument tuple of ``job``, each on a quorum."""
        return await self._driver.drive(self._deduping(job, arg_tuples, ttl))  # type: ignore[no-any-return]

    async def release_many(self, leases: Iterable[Any]) -> list[bool]:
        """Releases many leases on every server: ``[bool]``, True where a quorum still held it."""
        return await self._driver.drive(self._releasing_many(leases))  # type: ignore[no-any-return]

    async def extend_many(self, leases: Iterable[Any], ttl: float) -> list[bool]:
        """Resets many leases' ttl on every server: True where a quorum did so in time."""
        return await self._driver.drive(self._extending_many(leases, ttl))  # type: ignore[no-any-return]

    async def _release(self, lease: RedlockLease) -> bool:
        return await self._driver.drive(self._releasing_one(lease))  # type: ignore[no-any-return]

    async def _extend(self, lease: RedlockLease, ttl: float) -> bool:
        return await self._driver.drive(self._extending_one(lease, ttl))  # type: ignore[no-any-return]

    def _exit(self, lease: RedlockLease) -> None:
        raise TypeError("an asyncio lease is not a `with` block: use `async with redlock.lock(...)`")
