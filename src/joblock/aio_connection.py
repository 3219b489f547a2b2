"""asyncio connections to Redis, their pool, and the driver of the batch loop.

A connection is an ``asyncio.Protocol`` that feeds the core's reader as bytes arrive
and wakes the waiting task once the replies it wants are parsed: no task per read,
no stream buffering. Each task takes a connection of its own from the pool, so
concurrent tasks never interleave commands on one socket.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterable
from contextlib import suppress
from types import ModuleType
from typing import Any

from . import _windows, errors
from ._scripts import SCRIPTS
from .connection import (
    _tls_context,
    broken_error,
    check_handshake,
    check_scripts_loaded,
    connect_error,
    handshake,
    load_scripts_payload,
    raise_reply,
    timeout_error,
)
from .settings import Settings

__all__ = ["AsyncConnection", "AsyncPool", "run"]


class AsyncConnection(asyncio.Protocol):
    """One connection to Redis, authenticated and on the right database."""

    def __init__(self, settings: Settings, core: ModuleType) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self._core = core
        self._reader = core.Reader()
        self._transport: asyncio.Transport | None = None
        self._out: list[Any] = []
        self._want = 0
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._lost: errors.ConnectionError | None = None

    @classmethod
    async def open(cls, settings: Settings, core: ModuleType) -> AsyncConnection:
        loop = asyncio.get_running_loop()
        conn = cls(settings, core)
        s = settings
        tls = _tls_context(s) if s.tls else None
        try:
            if s.path is not None:
                connecting = loop.create_unix_connection(lambda: conn, s.path, ssl=tls)
            else:
                host = s.host if tls else None
                connecting = loop.create_connection(
                    lambda: conn, s.host, s.port, ssl=tls, server_hostname=host
                )
            await asyncio.wait_for(connecting, s.connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise connect_error(s, e) from None
        sock = conn._transport.get_extra_info("socket") if conn._transport else None
        if sock is not None and s.path is None and s.keepalive:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        try:
            commands = handshake(s)
            if commands:
                await conn.send(b"".join(core.encode_command(c) for c in commands))
                check_handshake(s, commands, await conn.read(len(commands)))
        except BaseException:
            conn.close()
            raise
        return conn

    # -- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            try:
                if self._core.take(self._reader, self._out, self._want) >= self._want:
                    waiter.set_result(None)
            except errors.ProtocolError as e:
                waiter.set_exception(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = broken_error(self.settings, exc)
        for waiter in (self._waiter, self._drained):
            if waiter is not None and not waiter.done():
                waiter.set_exception(self._lost)

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    # -- commands --------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._lost is None and self._transport is not None and not self._transport.is_closing()

    async def send(self, data: bytes) -> None:
        if self._lost is not None:
            raise self._lost
        assert self._transport is not None
        self._transport.write(data)
        if self._drained is not None:
            await self._wait(self._drained)

    async def read(self, n: int) -> list[Any]:
        """The next ``n`` replies; error replies come back as ReplyError objects."""
        out: list[Any] = []
        if self._core.take(self._reader, out, n) >= n:
            return out
        if self._lost is not None:
            raise self._lost
        self._out, self._want = out, n
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._wait(self._waiter)
        finally:
            self._waiter = None
        return out

    async def _wait(self, future: asyncio.Future[None]) -> None:
        # A timer rather than asyncio.wait_for, which costs a task per read.
        timer = asyncio.get_running_loop().call_later(self.settings.socket_timeout, self._expire, future)
        try:
            await future
        finally:
            timer.cancel()

    def _expire(self, future: asyncio.Future[None]) -> None:
        if not future.done():
            self.close()
            future.set_exception(timeout_error(self.settings))

    async def call(self, *args: bytes | str | int) -> Any:
        await self.send(self._core.encode_command(args))
        return raise_reply((await self.read(1))[0], args)

    async def load_scripts(self) -> None:
        await self.send(load_scripts_payload(self._core))
        check_scripts_loaded(await self.read(len(SCRIPTS)))

    def close(self) -> None:
        if self._transport is not None:
            try:
                self._transport.abort()
            except RuntimeError:  # its event loop is closed: end the connection by hand
                sock = self._transport.get_extra_info("socket")
                if sock is not None:
                    with suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)


class AsyncPool:
    """Idle connections for reuse by one event loop; at most ``max_connections`` open.

    A forked child drops its parent's connections, like the threaded pool. Used from
    another loop (a later ``asyncio.run``), it closes the previous loop's connections
    and starts afresh: they and the semaphore belong to the loop they were made on.
    """

    def __init__(self, settings: Settings, core: ModuleType, max_idle: int = 16, max_connections: int = 256):
        self.settings = settings
        self._core = core
        self._max_idle = max_idle
        self._max_connections = max_connections
        self._idle: list[AsyncConnection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def get(self) -> AsyncConnection:
        if self._pid != os.getpid():
            self._idle, self._pid = [], os.getpid()
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # A connection of a finished loop is never read again: reusing one would
            # wait for replies that loop no longer delivers.
            self.close()
            self._slots = asyncio.Semaphore(self._max_connections)
            self._loop = loop
        await self._slots.acquire()
        try:
            while self._idle:
                conn = self._idle.pop()
                if conn.alive:  # the server may have closed it while it sat idle
                    return conn
            return await self.connect()
        except BaseException:
            self._slots.release()
            raise

    async def connect(self) -> AsyncConnection:
        """A fresh connection, after up to ``settings.retries`` retries."""
        attempt = 0
        while True:
            try:
                return await AsyncConnection.open(self.settings, self._core)
            except errors.AuthenticationError:
                raise
            except errors.ConnectionError:
                if attempt >= self.settings.retries:
                    raise
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
                attempt += 1

    def put(self, conn: AsyncConnection) -> None:
        if conn.alive and conn.pid == os.getpid() and len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            conn.close()
        self._slots.release()

    def discard(self, conn: AsyncConnection) -> None:
        conn.close()
        self._slots.release()

    async def call(self, *args: bytes | str | int) -> Any:
        conn = await self.get()
        try:
            reply = await conn.call(*args)
        except errors.ReplyError:
            self.put(conn)
            raise
        except BaseException:
            self.discard(conn)
            raise
        self.put(conn)
        return reply

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


async def run(pool: AsyncPool, windows: Iterable[_windows.Window], handle: _windows.Handle) -> None:
    """Carries out ``_windows.steps`` over one pooled connection (see ``_windows.run``)."""
    loop = _windows.steps(windows, handle, pool.settings.retries)
    conn = await pool.get()
    reply: Any = None
    failure: errors.ConnectionError | None = None
    try:
        while True:
            try:
                op, arg = loop.send(reply) if failure is None else loop.throw(failure)
            except StopIteration:
                break
            reply = failure = None
            try:
                if op is _windows.SEND:
                    await conn.send(arg)
                elif op is _windows.READ:
                    reply = await conn.read(arg)
                elif op is _windows.LOAD_SCRIPTS:
                    await conn.load_scripts()
                else:
                    conn.close()
                    conn = await pool.connect()
            except errors.ConnectionError as e:
                failure = e
    except BaseException:
        # Replies may still be on the wire (or a cancelled read left them): not reusable.
        pool.discard(conn)
        raise
    pool.put(conn)
