"""``Locks``: the lock API for threads, on top of the core and the connection pool."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from . import _windows, errors
from ._base import Acquired, LocksBase, Settled, backoff, milliseconds, seconds, single_reply
from ._core import core as _active_core
from ._scripts import EXTEND_SHA, RELEASE_SHA, REMAINING_SHA
from .connection import Pool

__all__ = ["Lease", "Locks", "milliseconds", "seconds"]

logger = logging.getLogger("joblock")

Lease = _active_core.Lease

F = TypeVar("F", bound=Callable[..., Any])


class Locks(LocksBase):
    """Redis locks for jobs: single, batched and deduplicating.

    Thread-safe: connections are pooled, and a forked child opens its own.
    ``url`` is ``redis://``, ``rediss://`` (TLS) or ``unix://``; keyword options
    (``username``, ``password``, ``db``, ``connect_timeout``, ``socket_timeout``,
    ``retries``, ``ssl_ca_certs``, ...) override what the URL says.
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", **options: Any) -> None:
        super().__init__(url, **options)
        self._pool = Pool(self.settings, self._core)

    def close(self) -> None:
        """Closes the idle connections; the Locks stays usable (it reconnects)."""
        self._pool.close()

    def __enter__(self) -> Locks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, windows: Iterable[_windows.Window], handle: _windows.Handle) -> None:
        """Sends windows and hands each one's replies to ``handle`` (ClusterLocks routes them)."""
        _windows.run(self._pool, windows, handle)

    # -- single locks -------------------------------------------------------------------

    def acquire(self, key: str | bytes, ttl: float, *, wait: float | None = None, fence: bool = False) -> Any:
        """Takes the lock for ``ttl`` seconds: a Lease, or None while someone else holds it.

        ``wait`` (seconds) keeps trying until then; ``fence=True`` gives the lease a
        fencing number that grows with every grant of this key.
        """
        window, patience = self._attempt(key, ttl, wait, fence)
        pauses = backoff(patience)
        while True:
            lease = self._acquire_run(iter((window,)), single=True)[0]
            if lease is not None:
                return lease
            pause = next(pauses, None)
            if pause is None:
                return None
            time.sleep(pause)

    @contextmanager
    def lock(
        self, key: str | bytes, ttl: float, *, wait: float | None = None, fence: bool = False
    ) -> Iterator[Any]:
        """``with locks.lock(key, ttl):`` holds the lock for the block.

        Raises LockNotAcquired when another holder has it (after ``wait``). If the
        lock expired before the block ended, a warning is logged on release.
        """
        lease = self.acquire(key, ttl, wait=wait, fence=fence)
        if lease is None:
            raise errors.LockNotAcquired(key)
        with lease:
            yield lease

    def _single(self, sha: bytes, lease: Any, arg: int | None, gone_is_done: bool) -> Any:
        window = self._script_window(sha, lease, arg, gone_is_done)
        result: list[Any] = []

        def handle(window: _windows.Window, replies: list[Any]) -> bool:
            result.append(single_reply(window, replies))
            return True

        self._run((window,), handle)
        return result[0]

    def _release(self, lease: Any) -> bool:
        if not lease._held:
            return False
        reply = self._single(RELEASE_SHA, lease, None, True)
        lease._held = False
        return bool(reply == 1)

    def _extend(self, lease: Any, ttl: float) -> bool:
        ms = milliseconds(ttl)
        if not lease._held:
            return False
        ok = bool(self._single(EXTEND_SHA, lease, ms, False) == 1)
        if not ok:
            lease._held = False
        return ok

    def _remaining(self, lease: Any) -> float | None:
        if not lease._held:
            return None
        ms = self._single(REMAINING_SHA, lease, None, False)
        return ms / 1000 if ms >= 0 else None

    def _exit(self, lease: Any) -> None:
        if lease._held and not self._release(lease):
            logger.warning("lock %r expired or was taken before release", lease.key)

    # -- batches -----------------------------------------------------------------------

    def _acquire_run(self, windows: Iterator[_windows.AcquireWindow], single: bool = False) -> list[Any]:
        """Runs acquire windows; on an undecidable failure, releases what was granted."""
        acquired = Acquired(self)
        try:
            self._run(windows, acquired.handle)
        except errors.ConnectionError as e:
            if single:
                raise
            acquired.broke(e)
        except Exception:
            # Bad input mid-batch: the locks granted so far go back before the error.
            self._release_quietly(acquired.granted())
            raise
        if acquired.failure is None:
            return acquired.out
        if single:
            raise acquired.failure
        raise acquired.error(self._release_quietly(acquired.granted()))

    def _release_quietly(self, leases: list[Any]) -> int:
        """Releases leases after a failure; returns how many could not be released."""
        if not leases:
            return 0
        try:
            self.release_many(leases)
        except errors.JoblockError:
            return sum(1 for lease in leases if lease._held)
        return 0

    def acquire_many(self, keys: Iterable[str | bytes], ttl: float, *, fence: bool = False) -> list[Any]:
        """Takes many locks, pipelined: ``[Lease | None]`` in the order of ``keys``.

        ``keys`` may be any iterable (a generator of millions too): it is consumed a
        window at a time. The same key twice: the first wins. If a failure leaves the
        outcome undecided, the locks granted so far are released and BatchError says
        how many there were.
        """
        return self._acquire_run(self._acquire_windows(keys, ttl, fence))

    def dedupe(
        self, job: str, arg_tuples: Iterable[tuple[Any, ...]], ttl: float, *, fence: bool = False
    ) -> list[Any]:
        """One lock per distinct argument tuple of ``job``: ``[Lease | None]`` in order.

        The keys are ``locks.key(job, *args)``, built inside the core. A None means a
        duplicate: another holder (or an earlier tuple in this call) has that lock.
        """
        return self._acquire_run(self._dedupe_windows(job, arg_tuples, ttl, fence))

    def _script_many(self, sha: bytes, leases: Iterable[Any], arg: int | None, release: bool) -> list[Any]:
        settled = Settled(self._core, release)
        self._run(self._script_windows(sha, leases, arg, settled), settled.handle)
        return settled.result()

    def release_many(self, leases: Iterable[Any]) -> list[bool]:
        """Releases many leases, pipelined: ``[bool]`` in order; None entries give False.

        False means that lock had expired or been taken before the release.
        """
        return self._script_many(RELEASE_SHA, leases, None, True)

    def extend_many(self, leases: Iterable[Any], ttl: float) -> list[bool]:
        """Resets many leases' ttl, pipelined: ``[bool]``, True where the lock is still ours."""
        return self._script_many(EXTEND_SHA, leases, milliseconds(ttl), False)

    def _adopt(self, key: str | bytes, token: bytes) -> Any:
        """A lease on a lock that another process took with ``token``; nothing is sent.

        Release and extend compare the token in Redis, so the adopted lease acts on the
        lock only while it is still that grant. The job adapters use it: a worker ends
        the lock its job's enqueuer took, knowing only the key and token that travelled
        with the job.
        """
        raw = self._core.as_key(key)
        if type(token) is not bytes:
            raise TypeError(f"token must be bytes, not {type(token).__name__}")
        if not token:
            raise ValueError("token must not be empty")
        leases, _ = self._core.make_leases(self, [raw], [key], [token], [b"OK"])
        return leases[0]

    # -- jobs ----------------------------------------------------------------------------

    def job(self, **options: Any) -> Callable[[F], F]:
        """Decorates a function (or method) as a job run under its lock.

        ``@locks.job(ttl=3600)`` gives each argument set one run at a time, as
        resque-lock-timeout does. Options: ``name`` (default: the qualified name),
        ``identifier(*args, **kwargs)`` (None: one lock for the whole job; a tuple:
        the arguments to key on), ``key(*args, **kwargs)`` (the whole key),
        ``on_locked`` ("skip", "raise" or a callable given the job's arguments, e.g.
        to re-enqueue), ``on_expired`` (called with the arguments when the lock had
        expired or been taken before release), ``auto_renew`` with ``on_lost``,
        ``wait`` and ``fence``.
        """
        from .jobs import job

        return job(self, **options)

    def _renewer(self) -> Any:
        renewer = self.__dict__.get("_renewer_instance")
        if renewer is None:
            from .renew import Renewer

            renewer = self.__dict__.setdefault("_renewer_instance", Renewer(self))
        return renewer


class _Failed(Exception):
    """An error reply inside an acquire window (turned into ReplyError or BatchError)."""

    def __init__(self, reply: errors.ReplyError, key: bytes) -> None:
        super().__init__(reply.message)
        self.reply = reply
        self.key = key
