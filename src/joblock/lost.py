"""Lost means stopped: what a lease's holder is told, and does, once its lock is lost.

A lease is sure of its lock until its deadline: its ttl counted from when its grant
(or its last confirmed extend) was sent, less an allowance for clock drift (see
``_engine.ops.sure_until``). It is lost when that deadline passes unconfirmed, when
an extend finds the lock expired or another holder's, or when an operator releases
it (``joblock release``, the locks page, ``joblock.testing``): the operator's release
is published on ``LOST_CHANNEL``, which a client listens on while it holds a guarded
lease (or waits).

``lease.lost`` is the signal, in the style of the lease's client; ``on_lost=`` on
``lock()`` and ``@locks.job`` chooses what stops the work:

- ``"interrupt"`` (threads): LockLost is raised in the thread running the block, as a
  time limit does; a thread inside a C call is interrupted when it returns to Python;
- ``"cancel"`` (asyncio): the task running the block is cancelled, and the block ends
  with LockLost (a cancellation that was not joblock's still propagates);
- ``"exit"`` (forked workers): the block's thread is parked, then the process exits with
  ``EXIT_STATUS`` after logging why; a block still working at the deadline itself (its
  process not run in time, or in a C call that holds the GIL) is ended by the kernel
  with SIGKILL then (``_kill_timer``);
- a callable, given the lease (a job's: the job's arguments);
- ``"ignore"`` (the default): nothing is watched, nothing costs.

A guarded lease is taken as lost ``EARLY`` seconds before its deadline: the thread (or
the event loop) that stops the work is one the OS has to run at that moment, and on a
loaded machine it may run some milliseconds late, while the block's thread runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import heapq
import inspect
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from . import errors, metrics
from ._core_py import lose, loss
from ._kill_timer import kill_timer

__all__ = ["EXIT_STATUS", "STRATEGIES", "AsyncGuard", "Guard", "check_on_lost", "signal"]

logger = logging.getLogger("joblock")

STRATEGIES = ("ignore", "interrupt", "cancel", "exit")
CHOICES = "'ignore', 'interrupt', 'cancel', 'exit' or a callable"

# The status a process exits with under on_lost="exit": EX_TEMPFAIL (sysexits.h), "try
# again later", which is what a job whose lock was lost should be.
EXIT_STATUS = 75

# How long before its deadline a guarded lease is taken as lost, its block stopped: the
# stop's own latency (waking the thread that stops it, which takes the GIL) is then spent
# while the lock is still sure. Measured by scripts/lost_run.py (docs/guarantees.md):
# under 1 ms as a rule, 5-50 ms at times on a loaded machine.
EARLY = 0.010


def check_on_lost(on_lost: object, asynchronous: bool, name: str = "on_lost") -> Any:
    """``on_lost`` checked for a client of the kind given: a strategy's name, or a callable."""
    if callable(on_lost):
        return on_lost
    if not isinstance(on_lost, str):
        raise TypeError(f"{name} must be {CHOICES}, not {type(on_lost).__name__}")
    if on_lost not in STRATEGIES:
        raise ValueError(f"{name} must be {CHOICES}, not {on_lost!r}")
    if on_lost == "cancel" and not asynchronous:
        raise ValueError(f"{name}='cancel' cancels an asyncio task: a thread's block takes 'interrupt'")
    if on_lost == "interrupt" and asynchronous:
        raise ValueError(f"{name}='interrupt' interrupts a thread: an asyncio block takes 'cancel'")
    return on_lost


class Watch:
    """What a lease calls once it is lost (its ``_watch``): the guards and waiters on it."""

    __slots__ = ("__weakref__", "event", "futures", "guards")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.guards: list[Any] = []
        self.futures: list[asyncio.Future[None]] = []

    def __call__(self, lease: Any) -> None:
        for guard in list(self.guards):  # first: the work stops before anything else is done
            guard.fire(lease)
        self.event.set()
        if metrics.recorder is not None:
            metrics.recorder.lost_lease(lease)
        for future in self.futures:
            loop = future.get_loop()
            if loop.is_closed():
                continue
            if _on_loop(loop):
                _resolve(future)
            else:
                loop.call_soon_threadsafe(_resolve, future)
        self.futures.clear()

    def moved(self, lease: Any) -> None:
        """The lease's deadline moved (an extend confirmed, or taken back): the kernel's
        stop of its "exit" blocks moves with it."""
        for guard in self.guards:
            if guard.on_lost == "exit":
                kill_timer.set(guard, lease._deadline)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def stopping(lease: Any) -> str | None:
    """``loss`` for a guarded lease: its deadline less ``EARLY`` found passed is marked as
    its loss (cause ``"deadline"``)."""
    if lease._lost is None and 0.0 < lease._deadline <= time.monotonic() + EARLY:
        lose(lease, "deadline")
    return loss(lease)


def watch(lease: Any) -> Watch:
    """The lease's watch, made on first use."""
    current = lease._watch
    if current is None:
        current = lease._watch = Watch()
    return current  # type: ignore[no-any-return]


# -- the signal: lease.lost ----------------------------------------------------------------


class Lost:
    """``lease.lost`` for a threaded client: set once the lease is lost (``threading.Event``'s
    ``is_set()`` and ``wait(timeout)``, which also wakes when the deadline passes)."""

    __slots__ = ("_lease",)

    def __init__(self, lease: Any) -> None:
        self._lease = lease

    def is_set(self) -> bool:
        return loss(self._lease) is not None

    __bool__ = is_set

    @property
    def cause(self) -> str | None:
        """Why it was lost (LockLost's ``cause``), None while it holds."""
        return loss(self._lease)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the lease is lost or ``timeout`` seconds passed; True once lost."""
        lease = self._lease
        event = watch(lease).event
        end = math.inf if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            now = time.monotonic()
            if now >= end:
                return False
            until = min(end, lease._deadline if lease._deadline > 0.0 else math.inf)
            event.wait(None if until == math.inf else until - now)
        return True

    def __repr__(self) -> str:
        cause = self.cause
        return f"<lost {'no' if cause is None else cause} of {self._lease.key!r}>"


class AsyncLost(Lost):
    """``lease.lost`` for an asyncio client: ``is_set()``, and ``await lease.lost`` (or
    ``await lease.lost.wait()``) returns once the lease is lost."""

    __slots__ = ()

    async def wait(self, timeout: float | None = None) -> bool:  # type: ignore[override]
        lease = self._lease
        loop = asyncio.get_running_loop()
        end = math.inf if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            now = time.monotonic()
            if now >= end:
                return False
            future: asyncio.Future[None] = loop.create_future()
            watch(lease).futures.append(future)
            until = min(end, lease._deadline if lease._deadline > 0.0 else math.inf)
            timer = None if until == math.inf else loop.call_later(until - now, _resolve, future)
            try:
                await future
            finally:
                if timer is not None:
                    timer.cancel()
        return True

    def __await__(self) -> Generator[Any, None, bool]:
        return self.wait().__await__()


def signal(lease: Any, asynchronous: bool) -> Lost:
    return AsyncLost(lease) if asynchronous else Lost(lease)


# -- deadlines of guarded leases in threads: one watchman thread per process ---------------


class Watchman:
    """Marks guarded leases lost at their deadlines, less ``EARLY`` (a thread while any is guarded).

    A renewal that is slow, or Redis that does not answer, must not delay the loss: so
    the deadline is kept here, apart from the renewer's thread and the caller's.
    """

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._heap: list[tuple[float, int, Any]] = []
        self._guarded: dict[int, Any] = {}
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, guard: Any) -> None:
        with self._wake:
            self._guarded[id(guard)] = guard
            self._push(guard)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="joblock-deadlines", daemon=True)
                self._thread.start()
            self._wake.notify()

    def remove(self, guard: Any) -> None:
        with self._wake:
            self._guarded.pop(id(guard), None)

    def _push(self, guard: Any) -> None:
        deadline = guard.lease._deadline
        if 0.0 < deadline < math.inf:
            heapq.heappush(self._heap, (deadline - EARLY, next(self._seq), guard))

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._guarded:
                    self._heap.clear()
                    self._thread = None
                    return
                now = time.monotonic()
                due: list[Any] = []
                while self._heap and self._heap[0][0] <= now:
                    _, _, guard = heapq.heappop(self._heap)
                    if self._guarded.get(id(guard)) is guard:
                        due.append(guard)
                wait = self._heap[0][0] - now if self._heap else None
                if not due:
                    self._wake.wait(wait)
                    continue
            for guard in due:
                if stopping(guard.lease) is None:  # extended meanwhile: its new deadline
                    with self._wake:
                        if self._guarded.get(id(guard)) is guard:
                            self._push(guard)

    def forked(self) -> None:
        # The parent's thread does not exist in a child, nor do the parent's guarded blocks.
        self._wake = threading.Condition()
        self._heap = []
        self._guarded = {}
        self._thread = None


_watchman = Watchman()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_watchman.forked)


# -- the strategies ------------------------------------------------------------------------


# The guard whose interrupt is pending in a thread, by thread id.
_firing: dict[int, Any] = {}


class _Interrupt(errors.LockLost):
    """Raised in a thread by on_lost="interrupt": CPython raises a class there, made
    in that thread, which names the key and why from the guard that fired."""

    def __init__(self, *args: Any) -> None:
        guard = _firing.pop(threading.get_ident(), None)
        if guard is None:  # not joblock's doing: a LockLost all the same
            super().__init__("", "deadline")
            return
        guard.raised = True
        super().__init__(guard.lease.key, loss(guard.lease) or "deadline")


# How long on_lost="exit" parks the block's thread at most (the process exits long before,
# as a rule): a log handler that takes longer must not leave the process up for ever.
PARK_LIMIT = 5.0


class _Parked(_Interrupt):
    """Raised in the block's thread by on_lost="exit" before the loss is logged: CPython
    makes it in that thread, and making it parks the thread until the process exits.
    Logging is I/O, which lets other threads take the GIL: the block's would work on
    meanwhile, and none of the block's handlers may run either (one that reports the job
    failed, in a worker whose process is about to end). A thread that holds a logging
    lock is not parked (the exit's log line would wait for it): it gets LockLost."""

    def __init__(self, *args: Any) -> None:
        if not _holds_a_logging_lock():
            guard = _firing.get(threading.get_ident())
            if guard is not None:  # stopped: the kernel's stop can wait for the exit
                kill_timer.drop(guard)
            threading.Event().wait(PARK_LIMIT)
            if guard is not None:  # not exited yet: the kernel ends it now
                kill_timer.set(guard, guard.lease._deadline)
        super().__init__(*args)


def _holds_a_logging_lock() -> bool:
    handlers = [ref() for ref in getattr(logging, "_handlerList", [])]
    locks = [getattr(logging, "_lock", None)] + [getattr(h, "lock", None) for h in handlers]
    return any(lock is not None and lock._is_owned() for lock in locks)


_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc


def _interrupt(thread: int, kind: type[BaseException] = _Interrupt) -> None:
    _async_exc(ctypes.c_ulong(thread), ctypes.py_object(kind))


def _clear_interrupt(thread: int) -> None:
    """Takes back an interrupt not raised yet (NULL clears the thread's pending one)."""
    _async_exc(ctypes.c_ulong(thread), None)


def _exit_process(lease: Any) -> None:
    logger.critical(
        "joblock lost the lock %r (%s): exiting with status %d",
        lease.key,
        errors.LOST_CAUSES.get(lease._lost, lease._lost),
        EXIT_STATUS,
    )
    for handler in logging.getLogger().handlers + logger.handlers:
        with contextlib.suppress(Exception):  # a broken handler must not keep the process alive
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(EXIT_STATUS)


def _warn(lease: Any) -> None:
    logger.warning(
        "joblock lost the lock %r: %s", lease.key, errors.LOST_CAUSES.get(lease._lost, lease._lost)
    )


# The tasks of async on_lost callbacks, kept until they end (the loop keeps only weak references).
_hooks: set[asyncio.Future[Any]] = set()


def _call(hook: Callable[[Any], object], lease: Any) -> None:
    try:
        outcome = hook(lease)
    except Exception:
        logger.exception("on_lost callback failed for %r", lease.key)
        return
    if inspect.isawaitable(outcome):
        task = asyncio.ensure_future(_awaited(outcome, lease.key))
        _hooks.add(task)
        task.add_done_callback(_hooks.discard)


async def _awaited(outcome: Awaitable[object], key: str | bytes) -> None:
    try:
        await outcome
    except Exception:
        logger.exception("on_lost callback failed for %r", key)


class _GuardBase:
    """What both guards share: the lease, the strategy, and being told of operator releases."""

    def __init__(self, owner: Any, lease: Any, on_lost: Any) -> None:
        self.owner = owner
        self.lease = lease
        self.on_lost = on_lost
        self.armed = False
        self.fired = False
        self.wakeups: Any = None
        self._lock = threading.Lock()

    def _arm(self) -> None:
        watch(self.lease).guards.append(self)
        self.armed = True
        if self.on_lost == "exit":
            kill_timer.set(self, self.lease._deadline)

    def _listening(self, wakeups: Any) -> None:
        """Told of an operator's release of the lease by the client's subscription, if it has one."""
        self.wakeups = wakeups
        if wakeups is not None:
            wakeups.watch(self.lease)

    def _disarm(self) -> bool:
        """Stops watching; True if the strategy had fired."""
        with self._lock:
            self.armed = False
            fired = self.fired
        if self.on_lost == "exit":
            kill_timer.drop(self)
        guards = watch(self.lease).guards
        if self in guards:
            guards.remove(self)
        if self.wakeups is not None:
            self.wakeups.unwatch(self.lease)
        return fired

    def _strategy(self, lease: Any) -> None:
        """The strategies both kinds of guard have: exit, or the callable."""
        if self.on_lost == "exit":
            _exit_process(lease)
        elif callable(self.on_lost):
            _call(self.on_lost, lease)


class Guard(_GuardBase):
    """A thread's block guarded by ``on_lost`` (``with Guard(...)``)."""

    def __init__(self, owner: Any, lease: Any, on_lost: Any) -> None:
        super().__init__(owner, lease, on_lost)
        self.thread = threading.get_ident()
        self.raised = False  # its interrupt was raised in the block

    def __enter__(self) -> Guard:
        self._listening(self.owner._listen_for(self.lease))
        # The deadlines' thread, if it must start, starts before this guard can fire: on
        # CPython <= 3.11 a thread's state carries its creator's id until it runs, so an
        # interrupt meant for this thread could be raised in the new one instead (which
        # would die before Thread.start returns, and that waits for it for ever).
        _watchman.add(self)
        self._arm()
        if stopping(self.lease) is not None:  # lost before the block began
            self.fire(self.lease)
        return self

    def fire(self, lease: Any) -> None:
        with self._lock:
            if not self.armed or self.fired:
                return
            self.fired = True
            if self.on_lost == "interrupt":
                _firing[self.thread] = self
                _interrupt(self.thread)
            elif self.on_lost == "exit" and self.thread != threading.get_ident():
                _firing[self.thread] = self
                _interrupt(self.thread, _Parked)
        # The work is stopped before anything is logged: a log handler's I/O lets the
        # block's thread take the GIL, and a slow one would let it work on meanwhile.
        # ("exit" logs why itself, then exits.)
        if self.on_lost != "exit":
            _warn(lease)
        self._strategy(lease)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        try:
            fired = self._disarm()
        except _Interrupt as interrupt:  # it came as the block ended
            fired = self._disarm()
            exc = interrupt
        _watchman.remove(self)
        if fired and self.on_lost == "exit":
            # The thread that fired is logging why, then ends the process with EXIT_STATUS:
            # a block's thread that was not parked (it held a logging lock) waits for that
            # here, rather than run on after its block or end the program another way.
            threading.Event().wait(PARK_LIMIT)
            return
        if not (fired and self.on_lost == "interrupt"):
            return
        # Not raised yet (the block ended first): it must never be raised after the block.
        _clear_interrupt(self.thread)
        if _firing.get(self.thread) is self:
            del _firing[self.thread]
        # The block ends with LockLost: the interrupt itself, or, when the block ended
        # before it could be raised, in its place. A block that caught it and ended
        # cleanly has handled it; another exception of the block's goes on as it is.
        if isinstance(exc, _Interrupt) or (exc is None and not self.raised):
            raise errors.LockLost(self.lease.key, loss(self.lease) or "deadline") from None


class AsyncGuard(_GuardBase):
    """A task's block guarded by ``on_lost`` (``async with AsyncGuard(...)``)."""

    def __init__(self, owner: Any, lease: Any, on_lost: Any) -> None:
        super().__init__(owner, lease, on_lost)
        self.task = asyncio.current_task()
        self.loop = asyncio.get_running_loop()
        self.timer: asyncio.TimerHandle | None = None
        self.cancels = 0

    async def __aenter__(self) -> AsyncGuard:
        self._listening(await self.owner._listen_for(self.lease))
        self._arm()
        self._schedule()
        if stopping(self.lease) is not None:
            self.fire(self.lease)
        return self

    def _schedule(self) -> None:
        deadline = self.lease._deadline
        if self.armed and 0.0 < deadline < math.inf:
            self.timer = self.loop.call_later(
                max(0.0, deadline - EARLY - time.monotonic()), self._at_deadline
            )

    def _at_deadline(self) -> None:
        self.timer = None
        if stopping(self.lease) is None:  # extended meanwhile: its new deadline
            self._schedule()

    def fire(self, lease: Any) -> None:
        if not _on_loop(self.loop):
            self.loop.call_soon_threadsafe(self.fire, lease)
            return
        if not self.armed or self.fired:
            return
        self.fired = True
        if self.on_lost == "cancel" and self.task is not None:
            self.cancels += 1
            self.task.cancel(f"joblock lost the lock {lease.key!r}")
        if self.on_lost != "exit":
            _warn(lease)
        self._strategy(lease)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self.timer is not None:
            self.timer.cancel()
        # No await here: a cancellation of ours still pending would be raised at it.
        fired = self._disarm()
        if not (fired and self.on_lost == "cancel" and self.cancels):
            return
        # Only joblock's own cancellation becomes LockLost: another one still cancels.
        task = self.task
        others = False
        if task is not None and hasattr(task, "uncancel"):
            others = task.uncancel() > 0
        if others:
            return
        raise errors.LockLost(self.lease.key, loss(self.lease) or "deadline") from None
