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
import socket
import struct
import threading
from typing import Any, NoReturn

from .. import errors
from ..settings import Settings
from .sockets import broken_error, connect_error, open_socket, timeout_error, tls_context
from .waits import Listen, Session, Wakeups

__all__ = ["AsyncListener", "ThreadListener", "open_transport"]


class ThreadListener:
    """A subscription read by a daemon thread; ``listen`` (re)connects and waits for SUBSCRIBE."""

    def __init__(self, wakeups: Wakeups) -> None:
        self.wakeups = wakeups
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._session: Session | None = None
        self._ready = threading.Event()
        self._error: errors.JoblockError | None = None

    def ready_for(self, step: Listen) -> Wakeups | None:
        """The subscription, if it listens already for what ``step`` needs."""
        session = self._session
        ready = session is not None and session.ready(step.channel(self.wakeups))
        return self.wakeups if ready else None

    def listen(self, settings: Settings, step: Listen) -> Wakeups:
        with self._lock:
            if self._sock is None or (step.again and self.wakeups.sessions == step.stale):
                self._connect(settings)
            ready, session = self._ready, self._session
        if not ready.wait(settings.socket_timeout) or session is None or not session.subscribed:
            self._give_up(session, self._error or timeout_error(settings))
        channel = step.channel(self.wakeups)
        if channel is not None:
            self._subscribe(settings, session, channel)
        return self.wakeups

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
            sock = self._sock if self._session is session else None
            if sock is None:
                raise broken_error(settings, None)
            try:
                sock.sendall(data)
            except OSError as e:
                self._stop()
                raise broken_error(settings, e) from None

    def _give_up(self, session: Session | None, error: errors.JoblockError) -> NoReturn:
        with self._lock:
            if self._session is session:  # its own connection, not a newer one
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
        self._sock, self._session, self._error = sock, session, None
        self._ready = ready = threading.Event()
        try:
            sock.sendall(session.greeting())
        except OSError as e:
            self._stop()
            raise broken_error(settings, e) from None
        thread = threading.Thread(target=self._read, args=(sock, session, ready), daemon=True)
        thread.name = f"joblock wake-ups from {settings.address}"
        thread.start()

    def _read(self, sock: socket.socket, session: Session, ready: threading.Event) -> None:
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    raise broken_error(session.settings, None)
                answer = session.feed(data)
                if answer:
                    self._write(session.settings, session, answer)
                if session.subscribed and not ready.is_set():  # (set once: not on every message's way)
                    ready.set()
        except errors.JoblockError as e:
            self._error = e
        except OSError as e:
            self._error = broken_error(session.settings, e)
        finally:
            ready.set()
            session.failed(self._error or broken_error(session.settings, None))
            with self._lock:
                current = self._sock is sock
                if current:
                    self._sock = self._session = None
            with contextlib.suppress(OSError):
                sock.close()
            if current:  # not closed on purpose: parked callers check again
                self.wakeups.broken()

    def _stop(self) -> bool:
        """Ends the connection (its thread then ends); whether there was one."""
        sock, self._sock, self._session = self._sock, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return sock is not None

    def close(self) -> None:
        with self._lock:
            self._stop()

    def forget(self) -> None:
        """In a forked child: close our copy of the parent's socket, nothing sent."""
        if self._sock is not None:
            self._sock.close()


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
