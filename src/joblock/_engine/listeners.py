"""How each driver carries a client's wake-up subscription (``waits.Wakeups``).

The threaded driver has no thread of its own, but a subscription must be read while
every caller is parked: a daemon thread per server reads it, blocked in ``recv``
(it costs nothing while no message comes). The asyncio driver reads it with a
protocol on the loop. Either way a broken subscription wakes every parked caller to
check Redis itself, and the next one that parks connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import socket
import struct
import threading
import time
from typing import Any, NoReturn

from .. import errors
from ..settings import Settings
from .sockets import broken_error, connect_error, open_socket, timeout_error, tls_context
from .waits import Listen, Session, Slot, Wakeups

__all__ = ["AsyncListener", "ThreadListener", "open_transport"]


class _Link:
    """One connection of a ``ThreadListener``: its socket and session, what tells its
    thread to stand aside (a byte on ``nudge``, read from ``nudged``), and the reading
    caller's selector of the socket."""

    __slots__ = ("nudge", "nudged", "ready", "selector", "session", "sock")

    def __init__(self, sock: socket.socket, session: Session) -> None:
        self.sock = sock
        self.session = session
        self.ready = threading.Event()  # set once subscribed, or once it ended
        self.nudged, self.nudge = socket.socketpair()
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ)

    def take(self, listener: ThreadListener) -> None:
        """Reads what came and hands it to the session (which delivers the messages)."""
        session = self.session
        data = self.sock.recv(65536)
        if not data:
            raise broken_error(session.settings, None)
        answer = session.feed(data)
        if answer:
            listener._write(session.settings, session, answer)
        if session.subscribed and not self.ready.is_set():  # (set once: not on every message's way)
            self.ready.set()

    def close(self) -> None:
        for each in (self.sock, self.nudge, self.selector):
            with contextlib.suppress(OSError):
                each.close()


# The thread's turn to read (``ThreadListener._reader``).
_THREAD = object()


class ThreadListener:
    """A subscription read by a daemon thread; ``listen`` (re)connects and waits for SUBSCRIBE.

    A caller parked alone reads the subscription itself (``wait``): the thread stands
    aside until it is done, so that the message handing it the lock wakes the caller at
    once, not the thread, which would then wake it (a second thread switch on every
    hand-off: with 8 processes at one key on 2 cores, a release's return to the next
    grant took 0.25-0.29 ms, median, and now 0.19-0.21). Callers parked meanwhile are
    woken by its reads, as by the thread's.
    """

    def __init__(self, wakeups: Wakeups) -> None:
        self.wakeups = wakeups
        self._lock = threading.Lock()
        self._link: _Link | None = None
        self._error: errors.JoblockError | None = None
        # Whose turn it is to read (under _turns): None, _THREAD or the reading caller's
        # Slot; _asking while a caller waits for the thread to stand aside.
        self._turns = threading.Condition(threading.Lock())
        self._reader: object = None
        self._asking = False

    def ready_for(self, step: Listen) -> Wakeups | None:
        """The subscription, if it listens already for what ``step`` needs."""
        link = self._link
        ready = link is not None and link.session.ready(step.channel(self.wakeups))
        return self.wakeups if ready else None

    def listen(self, settings: Settings, step: Listen) -> Wakeups:
        with self._lock:
            if self._link is None or (step.again and self.wakeups.sessions == step.stale):
                self._connect(settings)
            link = self._link
        assert link is not None  # (_connect made one)
        session = link.session
        if not link.ready.wait(settings.socket_timeout) or not session.subscribed:
            self._give_up(session, self._error or timeout_error(settings))
        channel = step.channel(self.wakeups)
        if channel is not None:
            self._subscribe(settings, session, channel)
        return self.wakeups

    def wait(self, slot: Slot, seconds: float) -> None:
        """The threaded driver's park: until ``slot`` has a message, or ``seconds`` pass.

        The caller reads the subscription itself unless another caller does (see the
        class); then it waits for the reader to wake it (``Slot.wait``)."""
        deadline = time.monotonic() + seconds
        link = self._link
        if link is None or not self._turn(link, slot, deadline):
            slot.wait(max(0.0, deadline - time.monotonic()))
            return
        try:
            while not slot.messages:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if _pending(link.sock) or link.selector.select(left):
                    link.take(self)
        except (errors.JoblockError, OSError) as e:
            self._end(link, e)
        except BaseException:
            # Interrupted, maybe between a read and its delivery: every parked caller looks
            # again, so that none misses a lock handed over in what was read.
            self.wakeups.broken()
            raise
        finally:
            with self._turns:
                self._reader = None
                self._turns.notify_all()

    def _turn(self, link: _Link, slot: Slot, deadline: float) -> bool:
        """Whether ``slot``'s caller got the turn to read ``link`` (the thread stood aside
        before ``deadline``); False while another caller reads."""
        with self._turns:
            if self._asking or self._reader not in (None, _THREAD):
                return False
            self._asking = True
            with contextlib.suppress(OSError):  # (closed: the connection has ended)
                link.nudge.send(b"\0")
            while self._reader is not None and self._turns.wait(max(0.0, deadline - time.monotonic())):
                pass
            self._asking = False
            if self._reader is None and self._link is link:
                self._reader = slot
                return True
            self._turns.notify_all()  # the thread goes on
            return False

    def _subscribe(self, settings: Settings, session: Session, channel: bytes) -> None:
        """Waits until ``session`` listens on the sharded ``channel``."""
        done = threading.Event()
        outcome: list[errors.JoblockError | None] = []

        def then(error: errors.JoblockError | None) -> None:
            outcome.append(error)
            done.set()

        data = session.subscribe(channel, then)
        if data:
            self._write(settings, session, data)
        if not done.wait(settings.socket_timeout):
            self._give_up(session, timeout_error(settings))
        if outcome[0] is not None:
            raise outcome[0]

    def _write(self, settings: Settings, session: Session, data: bytes) -> None:
        with self._lock:
            link = self._link
            if link is None or link.session is not session:
                raise broken_error(settings, None)
            try:
                link.sock.sendall(data)
            except OSError as e:
                self._stop()
                raise broken_error(settings, e) from None

    def _give_up(self, session: Session, error: errors.JoblockError) -> NoReturn:
        with self._lock:
            if self._link is not None and self._link.session is session:  # not a newer one
                self._stop()
        raise error

    def _connect(self, settings: Settings) -> None:
        if self._stop():  # replaced: who was parked under it looks again
            self.wakeups.broken()
        sock = open_socket(settings)
        # Blocking reads with no timeout: a subscription is silent until a lock is handed over.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        sock.settimeout(None)
        session = self.wakeups.session(settings)
        self._link = link = _Link(sock, session)
        self._error = None
        try:
            sock.sendall(session.greeting())
        except OSError as e:
            self._link = None
            link.close()
            raise broken_error(settings, e) from None
        thread = threading.Thread(target=self._read, args=(link,), daemon=True)
        thread.name = f"joblock wake-ups from {settings.address}"
        thread.start()

    def _read(self, link: _Link) -> None:
        """The thread: reads ``link`` whenever no caller does, until the connection ends."""
        turns, sock, nudged = self._turns, link.sock, link.nudged
        try:
            with nudged, selectors.DefaultSelector() as selector:
                selector.register(sock, selectors.EVENT_READ)
                selector.register(nudged, selectors.EVENT_READ)
                while True:
                    with turns:
                        while self._reader is not None or self._asking:
                            turns.wait()
                        if self._link is not link:  # ended by a caller's read, or replaced
                            raise broken_error(link.session.settings, None)
                        self._reader = _THREAD
                    try:
                        while not self._asking:
                            if _pending(sock) or any(key.fileobj is sock for key, _ in selector.select()):
                                link.take(self)
                            else:  # nudged: a caller asks for its turn
                                nudged.recv(64)
                    finally:
                        with turns:
                            self._reader = None
                            turns.notify_all()
        except (errors.JoblockError, OSError) as e:
            self._end(link, e)

    def _end(self, link: _Link, failure: errors.JoblockError | OSError) -> None:
        """``link`` ended (``failure``: what its reader met): whoever waits is told."""
        session = link.session
        error = (
            failure if isinstance(failure, errors.JoblockError) else broken_error(session.settings, failure)
        )
        session.failed(error)
        with self._lock:
            current = self._link is link
            if current:
                self._link = None
                self._error = error
        link.ready.set()
        link.close()
        if current:  # not closed on purpose: parked callers check again
            self.wakeups.broken()

    def _stop(self) -> bool:
        """Ends the connection (its reader then ends it for good); whether there was one."""
        link, self._link = self._link, None
        if link is not None:
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_RDWR)
        return link is not None

    def close(self) -> None:
        with self._lock:
            self._stop()

    def forget(self) -> None:
        """In a forked child: close our copy of the parent's sockets, nothing sent."""
        if self._link is not None:
            self._link.close()


def _pending(sock: socket.socket) -> bool:
    """Whether a TLS socket holds bytes it decrypted already (which select does not see)."""
    pending = getattr(sock, "pending", None)
    return pending is not None and pending() > 0


async def open_transport(settings: Settings, factory: Any) -> Any:
    """A connected transport for ``factory``'s protocol, as ``settings`` say (TLS, unix)."""
    loop = asyncio.get_running_loop()
    tls = tls_context(settings) if settings.tls else None
    if settings.path is not None:
        connecting = loop.create_unix_connection(factory, settings.path, ssl=tls)
    else:
        host = settings.host if tls else None
        connecting = loop.create_connection(
            factory, settings.host, settings.port, ssl=tls, server_hostname=host
        )
    transport, _ = await asyncio.wait_for(connecting, settings.connect_timeout)
    return transport


class AsyncListener:
    """A subscription read on the event loop; ``listen`` (re)connects and waits for SUBSCRIBE."""

    def __init__(self, wakeups: Wakeups) -> None:
        self.wakeups = wakeups
        self.current: _Subscription | None = None
        self._subscribing: asyncio.Future[None] | None = None

    def ready_for(self, step: Listen) -> Wakeups | None:
        """The subscription, if it listens already for what ``step`` needs."""
        current = self.current
        ready = current is not None and current.session.ready(step.channel(self.wakeups))
        return self.wakeups if ready else None

    async def listen(self, settings: Settings, step: Listen) -> Wakeups:
        if self._subscribing is None or (step.again and self.wakeups.sessions == step.stale):
            if self.current is not None:  # replaced: who was parked under it looks again
                self.close()
                self.wakeups.broken()
            self._subscribing = asyncio.ensure_future(self._connect(settings))
        subscribing = self._subscribing
        try:
            await asyncio.shield(subscribing)
        except errors.JoblockError:
            if self._subscribing is subscribing:
                self._subscribing = None
            raise
        channel = step.channel(self.wakeups)
        current = self.current
        if channel is not None and current is not None:
            await self._subscribe(settings, current, channel)
        return self.wakeups

    async def _subscribe(self, settings: Settings, current: _Subscription, channel: bytes) -> None:
        """Waits until ``current`` listens on the sharded ``channel``."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def then(error: errors.JoblockError | None) -> None:
            if done.done():
                return
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        data = current.session.subscribe(channel, then)
        if data:
            if current.transport is None or current.transport.is_closing():
                raise broken_error(settings, None)
            current.transport.write(data)
        try:
            await asyncio.wait_for(asyncio.shield(done), settings.socket_timeout)
        except asyncio.TimeoutError:
            if self.current is current:
                self.close()
            raise timeout_error(settings) from None

    async def _connect(self, settings: Settings) -> None:
        subscription = _Subscription(self, self.wakeups.session(settings))
        try:
            transport = await open_transport(settings, lambda: subscription)
        except (OSError, asyncio.TimeoutError) as e:
            raise connect_error(settings, e) from None
        self.current = subscription
        transport.write(subscription.session.greeting())
        try:
            await asyncio.wait_for(asyncio.shield(subscription.ready), settings.socket_timeout)
        except asyncio.TimeoutError:
            if self.current is subscription:  # its own connection, not a newer one
                self.close()
            raise timeout_error(settings) from None

    def lost(self, subscription: _Subscription) -> None:
        if self.current is subscription:  # not closed on purpose: parked callers check again
            self.current = self._subscribing = None
            self.wakeups.broken()

    def close(self) -> None:
        subscription, self.current, self._subscribing = self.current, None, None
        if subscription is not None and subscription.transport is not None:
            subscription.transport.close()


class _Subscription(asyncio.Protocol):
    """One connection of an ``AsyncListener``."""

    def __init__(self, listener: AsyncListener, session: Session) -> None:
        self.listener = listener
        self.session = session
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport

    def data_received(self, data: bytes) -> None:
        try:
            answer = self.session.feed(data)
        except errors.JoblockError as e:
            if not self.ready.done():
                self.ready.set_exception(e)
            assert self.transport is not None
            self.transport.close()
            return
        if answer and self.transport is not None:
            self.transport.write(answer)
        if self.session.subscribed and not self.ready.done():
            self.ready.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        error = broken_error(self.session.settings, exc)
        if not self.ready.done():
            self.ready.set_exception(error)
        self.session.failed(error)
        self.listener.lost(self)
