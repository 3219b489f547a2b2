"""The contenders with many callers at once, the bare references, and the Redis Cluster group.

- ``threads8``, ``threads32``: that many threads share one client, each looping acquire +
  release on its own keys (redis-py's Lock gets a shared client, whose pool opens a
  connection per thread, as many as it needs).
- ``aio_tasks16`` ... ``aio_tasks512``: the same with asyncio tasks on one loop
  (redis.asyncio's pool is unbounded too).
- ``bare-socket`` and ``bare-protocol``, in the single-caller groups: a blocking socket
  and an asyncio protocol that write the very bytes of joblock's SET NX PX GET and EVALSHA
  release and compare the replies with a grant's and a release's: what a client with no
  overhead of its own would do, the ceiling of one caller.
- ``cluster_acquire``: batch acquire on a local 3-primary cluster, against ``Locks`` on
  the arena's one server and redis-py's cluster pipeline.
- ``redlock_single``, ``redlock_acquire``: ``Redlock`` over 3 servers (the arena's and two
  more) against pottery's Redlock, whose batch is a loop over its single locks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .. import _core_py
from .._scripts import RELEASE_PLAIN, RELEASE_PLAIN_SHA
from ..aio import AsyncLocks
from ..cluster import ClusterLocks
from ..locks import Locks
from ..redlock import Redlock
from .arena import WINDOW, Arena, Case, Group, Unavailable, chunks, compiled_core, peer

__all__ = ["CROWD_GROUPS", "make_case"]

THREADS = (8, 32)
TASKS = (16, 128, 512)
# A crowd's operations per call (and per pytest-benchmark round): ten rounds of every caller.

CROWD_GROUPS = [
    *(
        Group(f"threads{n}", f"{n} threads sharing one client: acquire + release", "acquire+release pairs",
              10 * n, "redis-py-lock", ("joblock-c", "joblock-py", "redis-py-lock"))
        for n in THREADS
    ),
    *(
        Group(f"aio_tasks{n}", f"asyncio: {n} tasks sharing one client: acquire + release",
              "acquire+release pairs", 10 * n, "redis-py-asyncio-lock",
              ("joblock-c", "joblock-py", "redis-py-asyncio-lock"))
        for n in TASKS
    ),
    Group("cluster_acquire", "Redis Cluster, 3 local primaries: batch acquire (windows of 1000)",
          "locks acquired", WINDOW, "redis-py-cluster-pipeline",
          ("joblock-c", "joblock-py", "joblock-c-one-server", "redis-py-cluster-pipeline")),
    Group("redlock_single", "Redlock, 3 servers: single acquire + release", "acquire+release pairs", 1,
          "pottery", ("joblock-c", "joblock-py", "pottery")),
    Group("redlock_acquire", "Redlock, 3 servers: batch acquire (calls of 1000)", "locks acquired", WINDOW,
          "pottery", ("joblock-c", "joblock-py", "pottery")),
]  # fmt: skip


def make_case(arena: Arena, group: str, contender: str) -> Case | None:
    """The case of ``contender`` in one of this module's groups or references; None otherwise."""
    if contender == "bare-socket":
        pair = BareSocket(arena).pair
        return Case(group, contender, arena.keys, lambda keys: [pair(k) for k in keys])
    if contender == "bare-protocol":
        return Case(group, contender, arena.keys, lambda keys: arena.run(_bare_protocol(arena, keys)))
    if group.startswith("threads"):
        return Case(group, contender, arena.keys, _in_threads(int(group[7:]), _pair(arena, contender)))
    if group.startswith("aio_tasks"):
        tasks, async_pair = int(group[9:]), _async_pair(arena, contender)
        return Case(group, contender, arena.keys, lambda keys: arena.run(_in_tasks(tasks, async_pair, keys)))
    if group == "cluster_acquire":
        return _cluster_case(arena, contender)
    if group.startswith("redlock"):
        return _redlock_case(arena, group, contender)
    return None


# -- many callers ------------------------------------------------------------------------------


def _pair(arena: Arena, contender: str) -> Callable[[str], bool]:
    """One acquire + release of ``key`` by ``contender``, as a user of it would write it."""
    ttl = arena.ttl
    if contender == "redis-py-lock":
        r = arena.redis()

        def redis_py(key: str) -> bool:
            lock = r.lock(key, timeout=ttl)
            if not lock.acquire(blocking=False):
                return False
            lock.release()
            return True

        return redis_py
    locks: Locks = arena.locks(contender)

    def joblock(key: str) -> bool:
        lease = locks.acquire(key, ttl)
        return lease is not None and lease.release()

    return joblock


def _async_pair(arena: Arena, contender: str) -> Callable[[str], Awaitable[bool]]:
    ttl = arena.ttl
    if contender == "redis-py-asyncio-lock":
        r = arena.aio_redis()

        async def redis_py(key: str) -> bool:
            lock = r.lock(key, timeout=ttl)
            if not await lock.acquire(blocking=False):
                return False
            await lock.release()
            return True

        return redis_py
    locks: AsyncLocks = arena.locks(contender, AsyncLocks)

    async def joblock(key: str) -> bool:
        lease = await locks.acquire(key, ttl)
        return lease is not None and await lease.release()

    return joblock


def _shares(keys: Sequence[str], n: int) -> list[Sequence[str]]:
    return [keys[i::n] for i in range(n)]


def _in_threads(n: int, pair: Callable[[str], bool]) -> Callable[[Sequence[str]], list[Any]]:
    def run(keys: Sequence[str]) -> list[Any]:
        shares = _shares(keys, n)
        out: list[list[bool]] = [[] for _ in shares]

        def work(i: int) -> None:
            out[i] = [pair(key) for key in shares[i]]

        threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [ok for share in out for ok in share]

    return run


async def _in_tasks(n: int, pair: Callable[[str], Awaitable[bool]], keys: Sequence[str]) -> list[Any]:
    async def work(share: Sequence[str]) -> list[bool]:
        return [await pair(key) for key in share]

    done = await asyncio.gather(*(work(share) for share in _shares(keys, n)))
    return [ok for share in done for ok in share]


# -- the bare references -------------------------------------------------------------------------


class _Bytes:
    """The bytes of joblock's SET NX PX GET and release for a key, with a fresh token: the
    release joblock sends for a lock nobody waits for, the server's DELIFEQ where it has
    it, else EVALSHA of the plain compare-and-delete script.

    On Redis 6.2, which refuses NX with GET, the acquire is SET NX PX alone: one command
    where joblock sends two (SET NX PX, then GET), so joblock is compared with less work
    than its own."""

    def __init__(self, arena: Arena) -> None:
        s = arena.settings
        if s.tls or s.password is not None or s.path is not None:
            raise Unavailable("only for a plain TCP server without a password")
        self.holder = arena.holder
        ms = b"%d" % arena.ms
        self.set_tail = b"$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
        if arena.nx_get:
            self.set_head = b"*7\r\n$3\r\nSET\r\n"
            self.set_tail += b"$3\r\nGET\r\n"
            self.granted = b"$-1\r\n"  # SET NX GET's reply to a grant: the key had no value
        else:
            self.set_head = b"*6\r\n$3\r\nSET\r\n"
            self.granted = b"+OK\r\n"
        native = arena.dialect.release if arena.dialect is not None else None
        if native is not None and not native[1]:  # DELIFEQ key token: the key and token end it
            self.release_head = native[0]
        else:  # (DELEX puts IFEQ between them: the script stands in for it here)
            self.release_head = b"*5\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n" % RELEASE_PLAIN_SHA
            arena.call("SCRIPT", "LOAD", RELEASE_PLAIN)
        self.select = b"*2\r\n$6\r\nSELECT\r\n$%d\r\n%d\r\n" % (len(str(s.db)), s.db) if s.db else b""

    def commands(self, key: str) -> tuple[bytes, bytes]:
        k = key.encode()
        v = os.urandom(16).hex().encode() + self.holder
        args = b"$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(k), k, len(v), v)
        return self.set_head + args + self.set_tail, self.release_head + args


class BareSocket(_Bytes):
    """A blocking socket writing joblock's two commands and reading their replies, nothing else."""

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena)
        s = arena.settings
        self.sock = socket.create_connection((s.host, s.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.select:
            self.sock.sendall(self.select)
            self._reply()
        arena.on_close(self.sock.close)

    def _reply(self) -> bytes:
        data = self.sock.recv(65536)
        while not data.endswith(b"\r\n"):
            data += self.sock.recv(65536)
        return data

    def pair(self, key: str) -> bool:
        acquire, release = self.commands(key)
        self.sock.sendall(acquire)
        if self._reply() != self.granted:
            return False
        self.sock.sendall(release)
        return self._reply() == b":1\r\n"


class _BareProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[bytes] | None = None
        self.data = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.data += data
        if self.data.endswith(b"\r\n") and self.waiter is not None:
            self.waiter.set_result(self.data)
            self.data, self.waiter = b"", None

    async def call(self, payload: bytes) -> bytes:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return await self.waiter


async def _bare_protocol(arena: Arena, keys: Sequence[str]) -> list[Any]:
    """An asyncio protocol writing joblock's two commands per key, one after the other."""
    made = _Bytes(arena)
    s = arena.settings
    transport, protocol = await asyncio.get_running_loop().create_connection(_BareProtocol, s.host, s.port)
    try:
        if made.select:
            await protocol.call(made.select)
        out = []
        for key in keys:
            acquire, release = made.commands(key)
            if await protocol.call(acquire) != made.granted:
                out.append(False)
                continue
            out.append(await protocol.call(release) == b":1\r\n")
        return out
    finally:
        transport.close()


# -- Redis Cluster ------------------------------------------------------------------------------


def _cluster_case(arena: Arena, contender: str) -> Case:
    ttl, ms = arena.ttl, arena.ms

    def keys(n: int) -> list[Sequence[str]]:
        return chunks(arena.keys(n), None if contender.startswith("joblock") else WINDOW)

    if contender == "redis-py-cluster-pipeline":
        rc = arena.cluster_redis()

        def pipeline(calls: list[Sequence[str]]) -> list[Any]:
            out: list[Any] = []
            for call in calls:
                pipe = rc.pipeline()
                values = arena.tokens(len(call))
                for key, value in zip(call, values):
                    pipe.set(key, value, nx=True, px=ms)
                out += pipe.execute()
            return out

        return Case("cluster_acquire", contender, keys, pipeline)
    kind = Locks if contender == "joblock-c-one-server" else ClusterLocks
    locks = arena.locks(contender, kind)
    return Case("cluster_acquire", contender, keys, lambda calls: locks.acquire_many(calls[0], ttl))


def _redlock_case(arena: Arena, group: str, contender: str) -> Case:
    urls, ttl = arena.redlock_urls(), arena.ttl
    if contender == "pottery":
        pottery = peer("pottery", "pottery")
        logging.getLogger("pottery").setLevel(logging.ERROR)  # it warns of every lock found taken
        redis = peer("redis", "redis")
        masters = {redis.Redis.from_url(url) for url in urls}
        for client in masters:
            arena.on_close(client.close)

        def acquire(keys: Sequence[str]) -> list[Any]:
            locks = [pottery.Redlock(key=k, masters=masters, auto_release_time=ttl) for k in keys]
            return [lock.acquire(blocking=False) for lock in locks]

        def pair(key: str) -> bool:
            lock = pottery.Redlock(key=key, masters=masters, auto_release_time=ttl)
            if not lock.acquire(blocking=False):
                return False
            lock.release()
            return True

    else:
        core = compiled_core() if contender == "joblock-c" else _core_py
        redlock: Redlock = type("Redlock", (Redlock,), {"_core": core})(urls, prefix=arena.namespace)
        arena.on_close(redlock.close)

        def acquire(keys: Sequence[str]) -> list[Any]:
            return list(redlock.acquire_many(keys, ttl))

        def pair(key: str) -> bool:
            lease = redlock.acquire(key, ttl)
            return lease is not None and lease.release()

    if group == "redlock_single":
        return Case(group, contender, arena.keys, lambda keys: [pair(k) for k in keys])
    size = None if contender.startswith("joblock") else WINDOW
    return Case(group, contender, lambda n: chunks(arena.keys(n), size),
                lambda calls: [r for call in calls for r in acquire(call)])  # fmt: skip
