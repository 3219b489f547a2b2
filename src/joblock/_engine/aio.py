"""The asyncio driver: operations over asyncio transports, one connection per server
and event loop, shared by every task.

A caller's task awaits a ``Waiter`` of its own (no Task and no ``shield`` per call),
a future to asyncio; the connection's protocol parses replies as they arrive and
completes the waiters of the operations they finish, and the tasks a read woke take
their next steps right after it, not a loop turn later. Requests submitted while the
connection is idle are written at once; those the woken tasks submit go out together
at the end of the read, and the others submitted while some are in flight at the end
of the loop turn.

A cancelled caller abandons its operation rather than stopping it: the operation
goes on, its replies still land (``lease.held`` stays true to Redis), and what it
was granted is given back. ``close()`` waits for those clean-ups.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import socket
from collections.abc import Callable, Generator
from contextlib import suppress

# The connections' clock: the one asyncio's loop.time() reads (uvloop's too, to the
# millisecond), read here without a call into Python on every command.
from time import monotonic
from types import ModuleType
from typing import Any, TypeVar, cast

from .. import errors
from ..settings import Settings
from . import alarms, sync
from .listeners import AsyncListener, open_transport
from .ops import Call, Engine, Loading, Operation
from .requests import Request, Resolver, Target
from .sockets import Reloads, broken_error, connect_error, reconnect_pauses, timeout_error, unfound_error
from .sync import forks
from .waits import Listen, Park, Wakeups
from .wire import Wire

__all__ = ["Driver"]

T = TypeVar("T")

# A crowd of tasks woken by one read submits its next commands one task step at a
# time. Rather than hold them all to the end of the read's wake-ups, while Redis has
# little else to do, every EARLY_WRITE of them go out at once, so Redis works on the
# first while the client makes the rest (128 tasks: about 1.3x the pairs/s of one write
# per turn). With EARLY_WRITE_WHILE or more commands in flight Redis has work enough,
# and the extra writes would only cost system calls.
EARLY_WRITE = 48
EARLY_WRITE_WHILE = 4 * EARLY_WRITE

# A Waiter's states.
PENDING = 0
FINISHED = 1
CANCELLED = 2


def _raise(error: BaseException) -> None:
    raise error


class Waiter:
    """What a caller's task awaits while its operation waits for replies.

    To asyncio's Task a future (it has ``_asyncio_future_blocking``, which Task looks
    for in what it is given to wait on), but one the connection wakes itself: the tasks
    woken by a read run right after it (``_LoopState.run_woken``), where a future's
    result reaches its task through ``loop.call_soon`` (Python code), a callback
    handle and one more turn of the loop. Only its task awaits it (it is the engine's
    own), so it has what Task asks of a future and no more, and keeps one callback; a
    cancellation wakes the task the usual way.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop  # (what Task reads where a future has no get_loop: a call less)
        self.state = PENDING
        self._asyncio_future_blocking = False
        # The task's wake-up and its context (Any: typing.cast would be a call per wake-up).
        self.callback: Any = None
        self.context: Any = None
        self.message: object = None  # a cancellation's

    def add_done_callback(
        self, callback: Callable[[Waiter], object], *, context: contextvars.Context | None = None
    ) -> None:
        if self.callback is not None:
            raise RuntimeError("a joblock Waiter wakes one task")
        if context is None:
            context = contextvars.copy_context()
        if self.state != PENDING:
            self._loop.call_soon(callback, self, context=context)
            return
        self.callback, self.context = callback, context

    def result(self) -> None:  # (what the task's wake-up asks)
        if self.state == CANCELLED:
            raise asyncio.CancelledError() if self.message is None else asyncio.CancelledError(self.message)
        if self.state == PENDING:
            raise asyncio.InvalidStateError("Result is not ready.")

    def cancel(self, msg: object = None) -> bool:
        if self.state != PENDING:
            return False
        self.state = CANCELLED
        self.message = msg
        callback, context = self.callback, self.context
        if callback is not None:  # its task hears of it the usual way
            self.callback = self.context = None
            self._loop.call_soon(callback, self, context=context)
        return True

    def finish(self) -> bool:
        """Done: whether a task waits to be woken (by ``wake_task``)."""
        if self.state != PENDING:  # cancelled
            return False
        self.state = FINISHED
        return self.callback is not None

    def wake_task(self) -> None:
        callback, context = self.callback, self.context
        self.callback = self.context = None  # the task holds its Waiter: no cycle left behind
        context.run(callback, self)

    def __await__(self) -> Generator[Waiter, None, None]:
        return self  # type: ignore[return-value]  # (await asks for an iterator, which it is)

    def __next__(self) -> Waiter:
        # Yielded once, to the task (a generator would be an object more per wait);
        # next time done, and the await ends (with the cancellation, if that is it).
        if self.state == PENDING:
            if self.callback is not None:
                raise RuntimeError("await wasn't used with future")
            self._asyncio_future_blocking = True
            return self
        if self.state == CANCELLED:
            self.result()  # raises the cancellation
        raise StopIteration

    def __repr__(self) -> str:
        return f"<joblock Waiter {('pending', 'finished', 'cancelled')[self.state]}>"


class Connection:
    """One connection to one server: the transport, its wire, and a watchdog for silence.

    An asyncio protocol by its methods (the compiled engine's extension types cannot
    derive from ``asyncio.Protocol``, whose methods are no-ops anyway).
    """

    def __init__(self, state: _LoopState, target: Target, settings: Settings, core: ModuleType) -> None:
        self.state = state
        self.target = target
        self.settings = settings
        self.wire = Wire(core, settings, state.refusing)
        self.transport: asyncio.Transport | None = None
        self.dead = False
        self.flush_scheduled = False
        self.last_progress = 0.0
        self.watchdog: alarms.Alarm | None = None  # (a thread's, not the loop's: see alarms)
        self.recheck_at = math.inf  # when to ask its Resolver again where the target is

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_connection makes a Transport

    def data_received(self, data: bytes) -> None:
        self.state.feed(self, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.kill(self, broken_error(self.settings, exc), True)

    def eof_received(self) -> None:
        """Redis closed its side: the transport closes, and connection_lost follows."""

    def pause_writing(self) -> None:
        """Flow control is left to the bound on replies outstanding (see Wire)."""

    def resume_writing(self) -> None:
        pass

    def abort(self) -> None:
        transport = self.transport
        if transport is None:
            return
        try:
            transport.abort()
        except RuntimeError:  # its event loop is closed: end the connection by hand
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class _LoopState(Engine):
    """A driver's connections on one event loop; the engine of its operations."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        core: ModuleType,
        settings_for: Callable[[Target], Settings],
        resolver: Resolver | None,
    ) -> None:
        self.loop = loop
        self.core = core
        self.settings_for = settings_for
        self.resolver = resolver
        self.generation = forks[0]
        self.conns: dict[Target, Connection] = {}
        self.refusing: set[str] = set()  # the servers that refuse SET NX GET (see Wire)
        self.reloads = Reloads()  # the servers found loading their dataset (LOADING)
        self.background: dict[Operation, asyncio.Future[None]] = {}
        self.connecting: set[asyncio.Task[None]] = set()
        self.listeners: dict[Target, AsyncListener] = {}
        self.woken: list[Waiter] = []  # the tasks a read woke, in order (see Waiter)
        self.waking = False  # whether a read is being fed, its woken tasks run at its end
        # nest_asyncio lets a task's step run the loop inside itself, which may then feed
        # a read inside a read (and the read callback inside its own context): there, each
        # woken task runs in a callback of its own, as a future's would.
        self.inline = not getattr(loop, "_nest_patched", False)

    # -- the engine -------------------------------------------------------------------

    def send(self, request: Request) -> None:
        conn = self.conns.get(request.target)
        if conn is None:
            conn = self.open(request.target)
        elif self.resolver is not None and conn.transport is not None and monotonic() >= conn.recheck_at:
            conn = self.recheck(conn)
        wire = conn.wire
        idle = not wire.busy()
        if idle:
            conn.last_progress = monotonic()
        wire.submit(request)
        if conn.transport is None:
            return
        if idle:
            self.flush(conn)  # nothing else in flight: write now, no loop turn lost
        elif wire.unsent() >= EARLY_WRITE and wire.outstanding() < EARLY_WRITE_WHILE:
            conn.transport.write(wire.output() or b"")  # the scheduled flush stays for the rest
        elif not conn.flush_scheduled:
            conn.flush_scheduled = True
            self.loop.call_soon(self.flush, conn)

    # A call's steps between its awaits (Driver.run), here rather than in the coroutine,
    # where the compiled build knows ``op`` as an Operation: C calls, not Python ones.
    def proceed(self, op: Operation, start: bool = False) -> Waiter | None:
        """Moves ``op`` on (started first, on this loop) as far as it goes without a reply:
        what to await next, or None once it is done."""
        if start:
            op.engine = self
            op.start()
        while not op.done:
            if not op.wants_input:
                waiter = op.waiter = Waiter(self.loop)
                return waiter
            op.consume(op.produce())
        return None

    def later(self, delay: float, callback: Callable[[], None]) -> None:
        self.loop.call_later(delay, callback)

    def wake(self, op: Operation) -> None:
        if self.background and op in self.background:
            if op.done:
                future = self.background.pop(op)
                if not future.done():
                    future.set_result(None)
            elif op.wants_input:  # joblock's own input (leases to release): made here
                op.consume(op.produce())
            return
        waiter = op.waiter
        if waiter is not None:
            op.waiter = None
            if waiter.finish():
                if self.waking:
                    self.woken.append(waiter)
                else:  # not woken by a read (a timeout, a lost connection), or loops nest
                    self.loop.call_soon(waiter.wake_task)

    def spawn(self, op: Operation) -> None:
        self.background[op] = self.loop.create_future()
        op.begin(self)

    def keep_going(self, op: Operation) -> None:
        """An abandoned operation runs on in the background until it is done."""
        op.waiter = None
        op.abandon()
        if not op.done and op not in self.background:
            self.background[op] = self.loop.create_future()

    def run_woken(self) -> None:
        """Runs the steps of the tasks a read woke (and of those they wake), as the loop
        would run their callbacks: what one raises reaches the loop's exception handler,
        and SystemExit or KeyboardInterrupt leave the loop from a callback of its own
        once the others went on (uvloop's transports would swallow them here)."""
        woken = self.woken
        i = 0
        while i < len(woken):
            waiter = woken[i]
            i += 1
            try:
                waiter.wake_task()
            except (SystemExit, KeyboardInterrupt) as e:
                self.loop.call_soon(_raise, e)
            except BaseException as e:
                self.loop.call_exception_handler(
                    {"message": f"waking a task for joblock failed: {e!r}", "exception": e}
                )
        woken.clear()
        self.waking = False

    # -- connections --------------------------------------------------------------------

    def open(self, target: Target) -> Connection:
        conn = self.conns[target] = Connection(self, target, self.settings_for(target), self.core)
        if self.resolver is None or not self.resolve(conn, self.resolved):
            self.start_connecting(conn)
        return conn

    def start_connecting(self, conn: Connection) -> None:
        task = self.loop.create_task(self.connect(conn))
        self.connecting.add(task)
        task.add_done_callback(self.connecting.discard)

    # -- where a Resolver's targets are -------------------------------------------------------

    def resolve(
        self, conn: Connection, then: Callable[[Connection, Settings | errors.JoblockError], None]
    ) -> bool:
        """Whether an operation finds out where ``conn`` goes (it calls ``then``)."""
        assert self.resolver is not None
        op = self.resolver.resolve(conn.target, lambda found: then(conn, found))
        if op is None:
            return False
        self.spawn(op)
        return True

    def resolved(self, conn: Connection, found: Settings | errors.JoblockError) -> None:
        if conn.dead:
            return
        if isinstance(found, errors.JoblockError):
            self.kill(conn, found, False)
            return
        assert self.resolver is not None
        conn.settings = found
        conn.wire.settle(found)
        conn.recheck_at = monotonic() + self.resolver.recheck
        self.start_connecting(conn)

    def recheck(self, conn: Connection) -> Connection:
        """The connection to send on, once due for a check of where its target is.

        One idle for a moment is replaced by one that finds out first, so no request
        goes where the target was; a busy one is checked while its requests go on.
        """
        if not conn.wire.busy() and monotonic() - conn.last_progress > sync.IDLE_CHECK:
            replaced = errors.ConnectionError(
                f"the connection to Redis at {conn.settings.address} was replaced"
            )
            self.kill(conn, replaced, True)  # idle: nothing on it to send again
            return self.open(conn.target)
        conn.recheck_at = math.inf  # one check at a time
        self.resolve(conn, self.rechecked)
        return conn

    def rechecked(self, conn: Connection, found: Settings | errors.JoblockError) -> None:
        """A check of an open connection's target: one that moved ends the connection."""
        if conn.dead:
            return
        assert self.resolver is not None
        conn.recheck_at = monotonic() + self.resolver.recheck
        if isinstance(found, Settings) and found.address != conn.settings.address:
            moved = errors.ConnectionError(f"Redis at {conn.settings.address} gave way to {found.address}")
            self.kill(conn, moved, True)

    async def connect(self, conn: Connection) -> None:
        s = conn.settings
        loop = self.loop
        pauses = iter(reconnect_pauses(s))
        loading = self.reloads.pause(conn.target)
        while True:
            try:
                if loading:  # a server still loading its dataset would answer LOADING again at once
                    await asyncio.sleep(loading)
                    loading = 0.0
                    if conn.dead:
                        return
                if not s.found:
                    self.kill(conn, unfound_error(s), False)
                    return
                await open_transport(s, lambda: conn)
                break
            except (OSError, asyncio.TimeoutError) as e:
                error = connect_error(s, e)
            except BaseException:
                self.kill(
                    conn, errors.ConnectionError(f"connecting to Redis at {s.address} was cancelled"), False
                )
                raise
            pause = next(pauses, None)
            if pause is None or conn.dead:
                self.kill(conn, error, False)
                return
            await asyncio.sleep(pause)
        if conn.dead:  # closed while connecting
            conn.abort()
            return
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None and s.path is None and s.keepalive:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        conn.last_progress = monotonic()
        conn.watchdog = alarms.call_at(conn.last_progress + s.socket_timeout, loop, self.watch, conn)
        conn.wire.connected()
        self.flush(conn)

    def flush(self, conn: Connection) -> None:
        conn.flush_scheduled = False
        if conn.dead or conn.transport is None:
            return
        data = conn.wire.output()
        if data is not None:
            conn.transport.write(data)

    def feed(self, conn: Connection, data: bytes) -> None:
        conn.last_progress = monotonic()
        # The tasks these replies wake run here, after the read, and what they send goes
        # out in one write at the end, with what the wire added by itself (a redo, the
        # scripts' load, what waited for the handshake, a WAIT).
        self.waking = self.inline
        conn.flush_scheduled = True
        try:
            conn.wire.feed(data)
        except errors.JoblockError as e:  # not RESP, the handshake refused, a primary demoted: unusable
            self.kill(conn, e, isinstance(e, errors.ConnectionError))  # the demoted: sent again
        finally:
            try:
                if self.waking:
                    self.run_woken()
            finally:
                self.flush(conn)

    def watch(self, conn: Connection) -> None:
        """Kills a connection whose replies stopped coming for ``socket_timeout`` seconds."""
        if conn.dead:
            return
        timeout = conn.settings.socket_timeout
        now = monotonic()
        if conn.wire.busy() and now - conn.last_progress >= timeout:
            self.kill(conn, timeout_error(conn.settings), True)
            return
        due = conn.last_progress + timeout if conn.wire.busy() else now + timeout
        conn.watchdog = alarms.call_at(due, self.loop, self.watch, conn)

    def kill(self, conn: Connection, error: errors.JoblockError, retryable: bool) -> None:
        if conn.dead:
            return
        conn.dead = True
        if type(error) is Loading:
            self.reloads.loading(conn.target, conn.settings, error)
        if self.conns.get(conn.target) is conn:
            del self.conns[conn.target]
        if conn.watchdog is not None:
            conn.watchdog.cancel()
        conn.abort()
        for op, requests in conn.wire.drop().items():
            op.lost(requests, error, retryable)
        for other in list(self.conns.values()):
            if other.transport is not None and not other.flush_scheduled:
                self.flush(other)

    # -- waiting for a lock (see waits.py) ------------------------------------------------

    async def listen(self, step: Listen) -> Wakeups | None:
        listener = self.listeners.get(step.target)
        if step.lazy:
            return listener.ready_for(step) if listener is not None else None
        if listener is None:
            wakeups = Wakeups(self.core, self.settings_for(step.target), step.target, step.target is not None)
            wakeups.run_later = self.spawn  # a departed waiter's leave, a stray lock's release
            listener = self.listeners[step.target] = AsyncListener(wakeups)
        return await listener.listen(self.found(step.target), step)

    def found(self, target: Target) -> Settings:
        """The settings the requests to ``target`` use (a Sentinel service's primary)."""
        conn = self.conns.get(target)
        return conn.settings if conn is not None else self.settings_for(target)

    async def park(self, step: Park) -> bytes | None:
        slot = step.slot
        if not slot.messages:
            waiter = self.loop.create_future()

            def notify() -> None:
                if not waiter.done():
                    waiter.set_result(None)

            slot.notify = notify
            # A timer rather than wait_for, which may swallow a cancellation that comes
            # as the message does (before Python 3.12).
            timer = self.loop.call_later(step.seconds, notify)
            try:
                await waiter
            except BaseException:
                # Cancelled: leave the queue, giving back a lock handed over meanwhile.
                step.leave.abandoned = True
                self.spawn(step.leave)
                raise
            finally:
                timer.cancel()
                slot.notify = None
        return slot.take()

    async def close(self) -> None:
        """Waits for the background clean-ups, then closes every connection."""
        while self.background:
            await asyncio.gather(*self.background.values(), return_exceptions=True)
        for listener in self.listeners.values():
            listener.close()
        for conn in list(self.conns.values()):
            self.kill(conn, errors.ConnectionError("closed"), False)

    def forget(self) -> None:
        """Another loop (or a forked child) takes over: drop these connections unread."""
        for conn in list(self.conns.values()):
            conn.dead = True
            conn.abort()
        self.conns.clear()
        for listener in self.listeners.values():
            listener.close()


class Driver:
    """Runs operations for one lock client on asyncio (see the module docstring).

    It serves one event loop at a time: used from another loop (a later
    ``asyncio.run``), it drops the previous loop's connections and starts afresh.
    """

    def __init__(
        self, core: ModuleType, settings_for: Callable[[Target], Settings], resolver: Resolver | None = None
    ) -> None:
        self._core = core
        self._settings_for = settings_for
        self._resolver = resolver
        self._state: _LoopState | None = None

    def _current(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._state
        if state is None or state.loop is not loop or state.generation != forks[0]:
            if state is not None:
                state.forget()
            state = self._state = _LoopState(loop, self._core, self._settings_for, self._resolver)
        return state

    async def run(self, op: Operation) -> Any:
        """Carries out ``op`` and returns its result (or raises its error)."""
        state = self._state
        loop = asyncio.get_running_loop()
        if state is None or state.loop is not loop or state.generation != forks[0]:
            state = self._current()
        waiter = state.proceed(op, True)
        while waiter is not None:
            try:
                await waiter
            except asyncio.CancelledError:
                state.keep_going(op)
                raise
            waiter = None if op.done else state.proceed(op)  # (done: the usual, a call saved)
        return op.outcome()

    async def drive(self, plan: Generator[Any, Any, T]) -> T:
        """Carries out a plan: each operation (or pause, or wait) it yields, its result
        (or error) sent back."""
        value: Any = None
        failure: Exception | None = None
        while True:
            try:
                op = plan.send(value) if failure is None else plan.throw(failure)
            except StopIteration as stop:
                return cast(T, stop.value)
            try:
                if isinstance(op, Operation):
                    value = await self.run(op)
                elif isinstance(op, Park):
                    value = await self._current().park(op)
                elif isinstance(op, Listen):
                    state = self._current()
                    if not op.lazy and not state.found(op.target).found:  # a Sentinel primary: ask first
                        retries = state.found(op.target).retries
                        await self.run(Call(op.target, self._core, [("PING",)], retries, idempotent=True))
                    value = await state.listen(op)
                else:
                    await asyncio.sleep(op.seconds)
                    value = None
                failure = None
            except Exception as e:
                value, failure = None, e

    async def close(self) -> None:
        state = self._state
        if state is None:
            return
        if state.loop is asyncio.get_running_loop():
            await state.close()
        else:
            state.forget()
        self._state = None
