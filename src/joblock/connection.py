"""Sockets to Redis: one connection, and a thread-safe, fork-safe pool of them.

A connection speaks RESP2 through the active core's encoder and reader. The pool
hands each thread its own connection and, after a fork, never gives the child a
socket its parent opened (Celery and RQ workers fork): the child starts afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import ssl
import threading
import time
from types import ModuleType
from typing import Any

from . import errors
from ._scripts import SCRIPTS
from .settings import Settings

__all__ = ["Connection", "Pool"]

_RECV = 262144
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def _tls_context(s: Settings) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=s.ssl_ca_certs)
    ctx.check_hostname = s.ssl_check_hostname and s.ssl_cert_reqs != "none"
    ctx.verify_mode = _CERT_REQS[s.ssl_cert_reqs]
    if s.ssl_certfile:
        ctx.load_cert_chain(s.ssl_certfile, s.ssl_keyfile)
    return ctx


def connect_error(s: Settings, e: BaseException) -> errors.ConnectionError:
    """The error for a failed connect (timeout, TLS, refused), without the password."""
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return errors.TimeoutError(f"could not connect to Redis at {s.address} within {s.connect_timeout} s")
    if isinstance(e, ssl.SSLError):
        return errors.ConnectionError(f"TLS handshake with Redis at {s.address} failed: {e.reason}")
    strerror = getattr(e, "strerror", None)
    return errors.ConnectionError(f"could not connect to Redis at {s.address}: {strerror or e}")


def timeout_error(s: Settings) -> errors.TimeoutError:
    return errors.TimeoutError(f"Redis at {s.address} did not answer within {s.socket_timeout} s")


def broken_error(s: Settings, e: BaseException | None) -> errors.ConnectionError:
    if e is None:
        return errors.ConnectionError(f"Redis at {s.address} closed the connection")
    strerror = getattr(e, "strerror", None)
    return errors.ConnectionError(f"connection to Redis at {s.address} broke: {strerror or e}")


def handshake(s: Settings) -> list[tuple[Any, ...]]:
    """The commands a new connection sends first: AUTH, SELECT, CLIENT SETNAME."""
    commands: list[tuple[Any, ...]] = []
    if s.password is not None:
        commands.append(("AUTH", s.username, s.password) if s.username else ("AUTH", s.password))
    if s.db:
        commands.append(("SELECT", s.db))
    if s.client_name:
        commands.append(("CLIENT", "SETNAME", s.client_name))
    return commands


def check_handshake(s: Settings, commands: list[tuple[Any, ...]], replies: list[Any]) -> None:
    for command, reply in zip(commands, replies):
        if isinstance(reply, errors.ReplyError):
            if command[0] == "AUTH":
                user = f"user {s.username!r}" if s.username else "the default user"
                raise errors.AuthenticationError(
                    f"Redis at {s.address} refused the password for {user}: {reply.code}"
                )
            raise errors.reply_error(reply.message, command=" ".join(map(str, command[:2])))


def load_scripts_payload(core: ModuleType) -> bytes:
    return b"".join(core.encode_command((b"SCRIPT", b"LOAD", body)) for body in SCRIPTS.values())


def check_scripts_loaded(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, errors.ReplyError):
            raise errors.reply_error(reply.message, command="SCRIPT LOAD")


def raise_reply(reply: Any, args: tuple[bytes | str | int, ...]) -> Any:
    """The reply of ``call``: an error reply is raised, naming the command and key."""
    if isinstance(reply, errors.ReplyError):
        command = args[0] if isinstance(args[0], str) else args[0].decode()  # type: ignore[union-attr]
        key = args[1] if len(args) > 1 and isinstance(args[1], bytes) else None
        raise errors.reply_error(reply.message, command=command.upper(), key=key)
    return reply


class Connection:
    """One socket to Redis, authenticated and on the right database."""

    __slots__ = ("_core", "_reader", "_sock", "pid", "settings")

    def __init__(self, settings: Settings, core: ModuleType) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self._core = core
        self._reader = core.Reader()
        self._sock = self._open()
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    def _open(self) -> socket.socket:
        s = self.settings
        try:
            if s.path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(s.connect_timeout)
                try:
                    sock.connect(s.path)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((s.host, s.port), timeout=s.connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if s.keepalive:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if s.tls:
                try:
                    sock = _tls_context(s).wrap_socket(sock, server_hostname=s.host)
                except BaseException:
                    sock.close()
                    raise
        except OSError as e:  # TimeoutError and ssl.SSLError too
            raise connect_error(s, e) from None
        sock.settimeout(s.socket_timeout)
        return sock

    def _handshake(self) -> None:
        commands = handshake(self.settings)
        if commands:
            self.send(b"".join(self._core.encode_command(c) for c in commands))
            check_handshake(self.settings, commands, self.read(len(commands)))

    def send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except TimeoutError:
            raise self._timeout() from None
        except OSError as e:
            raise self._broken(e) from None

    def read(self, n: int) -> list[Any]:
        """The next ``n`` replies; error replies come back as ReplyError objects."""
        out: list[Any] = []
        take = self._core.take
        reader = self._reader
        recv = self._sock.recv
        while take(reader, out, n) < n:
            try:
                data = recv(_RECV)
            except TimeoutError:
                raise self._timeout() from None
            except OSError as e:
                raise self._broken(e) from None
            if not data:
                self.close()
                raise broken_error(self.settings, None)
            reader.feed(data)
        return out

    def call(self, *args: bytes | str | int) -> Any:
        """Sends one command and returns its reply; an error reply is raised."""
        self.send(self._core.encode_command(args))
        return raise_reply(self.read(1)[0], args)

    def closed_by_server(self) -> bool:
        """Whether the server closed this idle connection (or sent bytes nobody asked for)."""
        sock = self._sock
        try:
            # One zero-timeout poll: an idle connection has nothing to read.
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError):
            return True
        if not readable:
            return False
        if isinstance(sock, ssl.SSLSocket):
            # TLS may have sent a session ticket, which is no data: read it to see.
            try:
                sock.settimeout(0)
                try:
                    sock.recv(1)
                finally:
                    sock.settimeout(self.settings.socket_timeout)
            except (BlockingIOError, ssl.SSLWantReadError):
                return False
            except (OSError, ValueError):
                return True
        return True  # b"": closed; anything else would be read as the next reply

    def load_scripts(self) -> None:
        """Loads every joblock script (after a NOSCRIPT: a restart or SCRIPT FLUSH)."""
        self.send(load_scripts_payload(self._core))
        check_scripts_loaded(self.read(len(SCRIPTS)))

    def _timeout(self) -> errors.TimeoutError:
        self.close()
        return timeout_error(self.settings)

    def _broken(self, e: OSError) -> errors.ConnectionError:
        self.close()
        return broken_error(self.settings, e)

    @property
    def alive(self) -> bool:
        """False once closed (a broken connection closes itself)."""
        return self._sock.fileno() >= 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class Pool:
    """Idle connections kept for reuse; safe across threads and forks.

    ``get`` opens a new connection when none is idle, retrying a refused or dropped
    connect up to ``settings.retries`` times with a growing pause. At most
    ``max_idle`` connections are kept; more may be open at once under load.
    """

    def __init__(self, settings: Settings, core: ModuleType, max_idle: int = 16) -> None:
        self.settings = settings
        self._core = core
        self._max_idle = max_idle
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _after_fork(self) -> None:
        # The child drops the parent's sockets unclosed on the wire: closing its copy
        # of each descriptor leaves the parent's connection untouched.
        with self._lock:
            if self._pid != os.getpid():
                for conn in self._idle:
                    conn.close()
                self._idle = []
                self._pid = os.getpid()

    def get(self) -> Connection:
        if self._pid != os.getpid():
            self._after_fork()
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self.connect()
            # One the server closed while it sat idle (its `timeout`, a restart, CLIENT KILL)
            # is dropped before anything is sent on it: a retry there would be ambiguous (a
            # retried release cannot tell an expired lock from its own earlier DEL).
            if not conn.closed_by_server():
                return conn
            conn.close()

    def connect(self) -> Connection:
        """A fresh connection, after up to ``settings.retries`` retries."""
        attempt = 0
        while True:
            try:
                return Connection(self.settings, self._core)
            except errors.AuthenticationError:
                raise
            except errors.ConnectionError:
                if attempt >= self.settings.retries:
                    raise
                time.sleep(min(0.05 * 2**attempt, 1.0))
                attempt += 1

    def call(self, *args: bytes | str | int) -> Any:
        """One command on a pooled connection; an error reply is raised as ReplyError."""
        conn = self.get()
        try:
            reply = conn.call(*args)
        except errors.ReplyError:
            self.put(conn)
            raise
        except BaseException:
            conn.close()
            raise
        self.put(conn)
        return reply

    def evalsha(self, sha: bytes, key: bytes, *args: bytes | str | int) -> Any:
        """EVALSHA of one of joblock's scripts over one key, loading them on NOSCRIPT."""
        try:
            return self.call(b"EVALSHA", sha, 1, key, *args)
        except errors.ReplyError as e:
            if e.code != "NOSCRIPT":
                raise
        conn = self.get()
        try:
            conn.load_scripts()
        finally:
            self.put(conn)
        return self.call(b"EVALSHA", sha, 1, key, *args)

    def put(self, conn: Connection) -> None:
        if conn.pid == os.getpid() and conn.alive:
            with self._lock:
                if len(self._idle) < self._max_idle:
                    self._idle.append(conn)
                    return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
