"""``Locks``: the lock API for threads, over the threaded driver."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, cast, overload

from . import errors, lost, metrics
from ._client import LocksBase, check_flags, check_replicas
from ._core import core as _active_core
from ._engine.ops import EXTEND, RELEASE, REMAINING
from ._engine.sync import Driver
from .jobs import LockedJob, job
from .renew import Renewer

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._client import ClientOptions
    from .jobs import JobOptions

__all__ = ["Lease", "Locks"]

logger = logging.getLogger("joblock")

# The compiled or the pure twin's class (type checkers see the pure twin's): the type
# of the leases of Locks and ClusterLocks. joblock.aio.AsyncLease types those of the
# asyncio clients, whose methods are coroutines.
if TYPE_CHECKING:
    from ._core_py import Lease
else:
    Lease = _active_core.Lease

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Locks(LocksBase):
    """Redis locks for jobs: single, batched and deduplicating.

    Thread-safe: every thread shares one connection to the server, and calls made at
    the same moment go out together in one write (their replies come back in order).
    A forked child opens its own. ``url`` is ``redis://``, ``rediss://`` (TLS),
    ``unix://`` or ``redis+sentinel://`` (the primary the sentinels name, found again
    after a failover); keyword options (``username``, ``password``, ``db``,
    ``connect_timeout``, ``socket_timeout``, ``retries``, ``ssl_ca_certs``, ...)
    override what the URL says.
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", **options: Unpack[ClientOptions]) -> None:
        super().__init__(url, **options)
        self._driver = self._make_driver()

    def _make_driver(self) -> Driver:
        settings_for, resolver = self._where()
        return Driver(self._core, settings_for, resolver=resolver)

    def close(self) -> None:
        """Closes the connection (once no call is using it); the Locks stays usable (it reconnects)."""
        self._driver.close()

    def __enter__(self) -> Locks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- single locks -------------------------------------------------------------------

    @metrics.measured("acquire")
    def acquire(
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
    ) -> Lease | None:
        """Takes the lock for ``ttl`` seconds: a Lease, or None while someone else holds it.

        ``wait`` (seconds) waits until then: the caller queues in Redis and the release
        (or the lock's expiry) hands it the lock, with no polling. ``fair=True`` takes
        the lock only in turn: waiters of every process are granted in the order they
        came, and a call without ``wait`` gets None while anyone waits. ``shared=True``
        takes a reader's lease of a read-write lock: readers hold it together, while a
        plain acquire of the key is the writer and excludes them (new readers queue
        behind a waiting writer). ``fence=True`` gives the lease a fencing number that
        grows with every grant of this key. ``limit=N`` makes it a counting lock: up
        to N holders at once, each with its own token and expiry (LimitMismatchError
        if the key is held with another limit, or as a plain lock).
        """
        if fence is not False or fair is not False or shared is not False:
            check_flags(fence, fair, shared)
        replicas = self.settings.min_replicas if min_replicas is None else check_replicas(min_replicas)
        if not wait and not fair and not shared:
            op = self._acquire_op(key, ttl, fence, limit)
            if not replicas:
                lease: Lease | None = self._driver.run(op)  # (no cast: a call on every acquire)
                return lease
            return cast("Lease | None", self._driver.drive(self._confirmed(op, replicas, ttl)))
        plan = self._acquiring(key, ttl, wait, fence, limit, fair, shared)
        return self._driver.drive(self._confirmed_wait(plan, replicas, ttl))

    @contextmanager
    def lock(
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
        on_lost: str | Callable[[Lease], object] = "ignore",
    ) -> Iterator[Lease]:
        """``with locks.lock(key, ttl):`` holds the lock for the block.

        Raises LockNotAcquired when another holder has it (after ``wait``). If the
        lock expired before the block ended, a warning is logged on release.
        ``on_lost`` says what stops the block once the lease is lost (its deadline
        passed unconfirmed, an extend found it gone, an operator released it):
        ``"interrupt"`` raises LockLost in the block's thread, ``"exit"`` ends the
        process (status ``joblock.lost.EXIT_STATUS``), a callable is given the lease,
        ``"ignore"`` (the default) watches nothing.
        """
        guarded = on_lost != "ignore" and lost.check_on_lost(on_lost, False)
        lease = self.acquire(
            key, ttl, wait=wait, fence=fence, limit=limit, fair=fair, shared=shared, min_replicas=min_replicas
        )
        if lease is None:
            raise errors.LockNotAcquired(key)
        with lease:
            if not guarded:
                yield lease
                return
            with lost.Guard(self, lease, guarded):
                yield lease

    # What a Lease's methods call.

    def _release(self, lease: Lease) -> bool:
        op = self._lease_op(RELEASE, lease)
        released: bool = False if op is None else self._driver.run(op)
        return released

    def _extend(self, lease: Lease, ttl: float | timedelta, min_replicas: int | None = None) -> bool:
        replicas = self._replicas(min_replicas)
        op = self._lease_op(EXTEND, lease, ttl)
        if op is None:
            return False
        if not replicas:
            return cast(bool, self._driver.run(op))
        return cast(bool, self._driver.drive(self._confirmed(op, replicas, ttl, lease)))

    def _remaining(self, lease: Lease) -> float | None:
        op = self._lease_op(REMAINING, lease)
        return None if op is None else cast("float | None", self._driver.run(op))

    def _listen_for(self, lease: Lease) -> Any:
        """The subscription that hears of an operator's release of ``lease`` (None if
        Redis cannot be reached now: the lease's deadline still holds)."""
        try:
            return self._driver.drive(self._watching(lease))
        except errors.JoblockError as e:
            logger.info("joblock cannot hear of a release of %r by an operator: %s", lease.key, e)
            return None

    def _exit(self, lease: Lease) -> None:
        if lease._held and not self._release(lease):
            logger.warning("lock %r expired or was taken before release", lease.key)

    # -- batches -----------------------------------------------------------------------

    @metrics.measured("acquire_many")
    def acquire_many(
        self,
        keys: Iterable[str | bytes],
        ttl: float | timedelta,
        *,
        fence: bool = False,
        limit: int = 1,
        min_replicas: int | None = None,
    ) -> list[Lease | None]:
        """Takes many locks, pipelined: ``[Lease | None]`` in the order of ``keys``.

        ``keys`` may be any iterable (a generator of millions too): it is consumed a
        window at a time. The same key twice: the first wins (with ``limit=N``, each
        takes a slot of its own, up to N). If a failure leaves the
        outcome undecided, the locks granted so far are released and BatchError says
        how many there were.
        """
        batch = self._acquire_batch(keys, ttl, fence, limit)
        return self._driver.drive(self._acquiring_many(batch, self._replicas(min_replicas), ttl))

    @metrics.measured("dedupe")
    def dedupe(
        self,
        job: str,
        arg_tuples: Iterable[tuple[Any, ...] | list[Any]],
        ttl: float | timedelta,
        *,
        fence: bool = False,
        limit: int = 1,
        min_replicas: int | None = None,
    ) -> list[Lease | None]:
        """One lock per distinct argument tuple of ``job``: ``[Lease | None]`` in order.

        The keys are ``locks.key(job, *args)``, built inside the core. A None means a
        duplicate: another holder (or an earlier tuple in this call) has that lock.
        """
        batch = self._dedupe_batch(job, arg_tuples, ttl, fence, limit)
        return self._driver.drive(self._acquiring_many(batch, self._replicas(min_replicas), ttl))

    @metrics.measured("release_many")
    def release_many(self, leases: Iterable[Lease | None]) -> list[bool]:
        """Releases many leases, pipelined: ``[bool]`` in order; None entries give False.

        False means that lock had expired or been taken before the release.
        """
        return self._driver.drive(self._releasing_many(leases))

    @metrics.measured("extend_many")
    def extend_many(
        self, leases: Iterable[Lease | None], ttl: float | timedelta, *, min_replicas: int | None = None
    ) -> list[bool]:
        """Resets many leases' ttl, pipelined: ``[bool]``, True where the lock is still ours."""
        return self._driver.drive(self._extending_many(leases, ttl, self._replicas(min_replicas)))

    # -- jobs ----------------------------------------------------------------------------

    # A busy run returns None (skip), raises (raise) or returns on_locked's result.
    @overload
    def job(
        self, *, ttl: float | timedelta, on_locked: Literal["raise"], **options: Unpack[JobOptions]
    ) -> Callable[[Callable[P, R]], LockedJob[P, R]]: ...
    @overload
    def job(
        self, *, ttl: float | timedelta, on_locked: Callable[..., T], **options: Unpack[JobOptions]
    ) -> Callable[[Callable[P, R]], LockedJob[P, R | T]]: ...
    @overload
    def job(
        self, *, ttl: float | timedelta, on_locked: Literal["skip"] = ..., **options: Unpack[JobOptions]
    ) -> Callable[[Callable[P, R]], LockedJob[P, R | None]]: ...
    def job(self, **options: Any) -> Callable[[Callable[..., Any]], LockedJob[..., Any]]:
        """Decorates a function (or method) as a job run under its lock.

        ``@locks.job(ttl=3600)`` gives each argument set one run at a time, as
        resque-lock-timeout does. Options: ``name`` (default: the qualified name),
        ``identifier(*args, **kwargs)`` (None: one lock for the whole job; a tuple:
        the arguments to key on), ``key(*args, **kwargs)`` (the whole key),
        ``on_locked`` ("skip", "raise" or a callable given the job's arguments, e.g.
        to re-enqueue), ``on_expired`` (called with the arguments when the lock had
        expired or been taken before release), ``auto_renew`` with ``on_lost``,
        ``wait``, ``fair`` (waiting runs take turns in the order they came), ``fence``,
        and ``limit`` (N: at most N runs at once, of the job or of each argument set,
        as the key says).
        """
        return job(self, **options)

    def _renewer(self) -> Renewer:
        renewer: Renewer | None = self.__dict__.get("_renewer_instance")
        if renewer is None:
            renewer = self.__dict__.setdefault("_renewer_instance", Renewer(self))
        return renewer
