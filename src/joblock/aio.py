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

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar

from . import _windows, errors
from ._base import Acquired, LocksBase, Settled, backoff, milliseconds, single_reply
from ._scripts import EXTEND_SHA, RELEASE_SHA, REMAINING_SHA
from .aio_connection import AsyncPool, run
from .renew import Schedule, _Entry

__all__ = ["AsyncLocks"]

logger = logging.getLogger("joblock")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class AsyncLocks(LocksBase):
    """Redis locks for asyncio: single, batched and deduplicating.

    One AsyncLocks serves one event loop at a time (a later loop, as another
    ``asyncio.run``, starts with fresh connections); any number of tasks may use it
    at once (each round trip takes a pooled connection of its own).
    """

    asynchronous = True

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", **options: Any) -> None:
        super().__init__(url, **options)
        self._pool = AsyncPool(self.settings, self._core)
        self._cleanups: set[asyncio.Task[Any]] = set()
        self._renew: AsyncRenewer | None = None

    async def close(self) -> None:
        """Waits for pending clean-ups, then closes the idle connections."""
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        self._pool.close()

    async def __aenter__(self) -> AsyncLocks:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- cancellation ----------------------------------------------------------------

    async def _finish(self, work: Awaitable[T], undo: Callable[[T], Awaitable[Any]] | None = None) -> T:
        """Runs ``work`` to its end even if the caller is cancelled.

        On cancellation the caller gets CancelledError at once while the work goes
        on; ``undo`` then takes back what it did (the locks it was granted).
        """
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if undo is not None:
                self._later(self._undo_when_done(task, undo))
            else:
                self._later(task)
            raise

    async def _undo_when_done(self, task: asyncio.Future[T], undo: Callable[[T], Awaitable[Any]]) -> None:
        try:
            result = await task
        except Exception:
            return  # it failed: it released what it had granted itself
        await undo(result)

    def _later(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        task.add_done_callback(_log_failure)

    async def _release_leases(self, leases: list[Any]) -> None:
        granted = [lease for lease in leases if lease is not None]
        if granted:
            await self.release_many(granted)

    # -- single locks -------------------------------------------------------------------

    async def acquire(
        self, key: str | bytes, ttl: float, *, wait: float | None = None, fence: bool = False
    ) -> Any:
        """Takes the lock for ``ttl`` seconds: a Lease, or None while someone else holds it."""
        window, patience = self._attempt(key, ttl, wait, fence)
        pauses = backoff(patience)
        while True:
            leases = await self._finish(self._acquire_run(iter((window,)), single=True), self._release_leases)
            if leases[0] is not None:
                return leases[0]
            pause = next(pauses, None)
            if pause is None:
                return None
            await asyncio.sleep(pause)

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

    async def _single(self, sha: bytes, lease: Any, arg: int | None, gone_is_done: bool) -> Any:
        window = self._script_window(sha, lease, arg, gone_is_done)
        result: list[Any] = []

        def handle(window: _windows.Window, replies: list[Any]) -> bool:
            result.append(single_reply(window, replies))
            return True

        await run(self._pool, (window,), handle)
        return result[0]

    async def _release(self, lease: Any) -> bool:
        return await self._finish(self._release_now(lease))

    async def _release_now(self, lease: Any) -> bool:
        if not lease._held:
            return False
        reply = await self._single(RELEASE_SHA, lease, None, True)
        lease._held = False
        return bool(reply == 1)

    async def _extend(self, lease: Any, ttl: float) -> bool:
        return await self._finish(self._extend_now(lease, milliseconds(ttl)))

    async def _extend_now(self, lease: Any, ms: int) -> bool:
        if not lease._held:
            return False
        ok = bool(await self._single(EXTEND_SHA, lease, ms, False) == 1)
        if not ok:
            lease._held = False
        return ok

    async def _remaining(self, lease: Any) -> float | None:
        if not lease._held:
            return None
        ms = await self._single(REMAINING_SHA, lease, None, False)
        return ms / 1000 if ms >= 0 else None

    def _exit(self, lease: Any) -> None:
        raise TypeError("an asyncio lease is not a `with` block: use `async with locks.lock(...)`")

    # -- batches -----------------------------------------------------------------------

    async def _acquire_run(
        self, windows: Iterator[_windows.AcquireWindow], single: bool = False
    ) -> list[Any]:
        """Runs acquire windows; on an undecidable failure, releases what was granted."""
        acquired = Acquired(self)
        try:
            await run(self._pool, windows, acquired.handle)
        except errors.ConnectionError as e:
            if single:
                raise
            acquired.broke(e)
        except Exception:
            await self._release_quietly(acquired.granted())
            raise
        if acquired.failure is None:
            return acquired.out
        if single:
            raise acquired.failure
        raise acquired.error(await self._release_quietly(acquired.granted()))

    async def _release_quietly(self, leases: list[Any]) -> int:
        if not leases:
            return 0
        try:
            await self.release_many(leases)
        except errors.JoblockError:
            return sum(1 for lease in leases if lease._held)
        return 0

    async def acquire_many(
        self, keys: Iterable[str | bytes], ttl: float, *, fence: bool = False
    ) -> list[Any]:
        """Takes many locks, pipelined: ``[Lease | None]`` in the order of ``keys``."""
        windows = self._acquire_windows(keys, ttl, fence)
        return await self._finish(self._acquire_run(windows), self._release_leases)

    async def dedupe(
        self, job: str, arg_tuples: Iterable[tuple[Any, ...]], ttl: float, *, fence: bool = False
    ) -> list[Any]:
        """One lock per distinct argument tuple of ``job``: ``[Lease | None]`` in order."""
        windows = self._dedupe_windows(job, arg_tuples, ttl, fence)
        return await self._finish(self._acquire_run(windows), self._release_leases)

    async def _script_many(
        self, sha: bytes, leases: Iterable[Any], arg: int | None, release: bool
    ) -> list[Any]:
        settled = Settled(self._core, release)
        await run(self._pool, self._script_windows(sha, leases, arg, settled), settled.handle)
        return settled.result()

    async def release_many(self, leases: Iterable[Any]) -> list[bool]:
        """Releases many leases, pipelined: ``[bool]`` in order; None entries give False."""
        return await self._finish(self._script_many(RELEASE_SHA, leases, None, True))

    async def extend_many(self, leases: Iterable[Any], ttl: float) -> list[bool]:
        """Resets many leases' ttl, pipelined: ``[bool]``, True where the lock is still ours."""
        return await self._finish(self._script_many(EXTEND_SHA, leases, milliseconds(ttl), False))

    # -- jobs ----------------------------------------------------------------------------

    def job(self, **options: Any) -> Callable[[F], F]:
        """Decorates an ``async def`` job run under its lock; the options of ``Locks.job``."""
        from .jobs import job

        return job(self, **options)

    def _renewer(self) -> AsyncRenewer:
        if self._renew is None:
            self._renew = AsyncRenewer(self)
        return self._renew


class AsyncRenewer:
    """Extends registered leases from one task until they are unregistered (or lost)."""

    def __init__(self, locks: AsyncLocks) -> None:
        self._locks = locks
        self._schedule = Schedule()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._hooks: set[asyncio.Task[None]] = set()

    def add(self, lease: Any, ttl: float, on_lost: Callable[[Any], object] | None = None) -> None:
        self._schedule.entries[id(lease)] = _Entry(lease, ttl, on_lost)
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()  # an Event binds to the loop it first waits on
            self._task = asyncio.ensure_future(self._run())
        self._wake.set()

    def remove(self, lease: Any) -> None:
        self._schedule.entries.pop(id(lease), None)
        self._wake.set()

    async def _run(self) -> None:
        while self._schedule.entries:
            due, wait = self._schedule.due()
            if not due:
                self._wake.clear()
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue
            for ttl, entries in Schedule.by_ttl(due).items():
                try:
                    results = await self._locks.extend_many([e.lease for e in entries], ttl)
                except errors.JoblockError as e:
                    Schedule.postpone(entries, e)
                    continue
                for entry in self._schedule.settle(entries, results):
                    outcome = Schedule.report_lost(entry)
                    if inspect.isawaitable(outcome):
                        # A task of its own: a slow or failing on_lost must neither
                        # delay nor end the renewal of the other leases.
                        hook = asyncio.ensure_future(_run_hook(outcome, entry.lease.key))
                        self._hooks.add(hook)
                        hook.add_done_callback(self._hooks.discard)


async def _run_hook(outcome: Awaitable[Any], key: Any) -> None:
    try:
        await outcome
    except Exception:
        logger.exception("on_lost callback failed for %r", key)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("joblock could not clean up after a cancelled call: %s", task.exception())
