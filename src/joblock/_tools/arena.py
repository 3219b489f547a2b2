"""Where ``joblock bench`` and ``benchmarks/`` run their contenders: the arena.

One Redis server (and, for the Redis Cluster group, a local cluster started on first
use), a key namespace unique to the run, the clients every contender needs, and the
clean-up after each repetition. The contenders themselves are in ``cases`` and
``crowds``; measuring and reporting in ``bench``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import os
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from .. import _core_py
from .._client import holder_suffix
from .._core import compiled
from .._engine.native import PROBE, Dialect, dialect
from .._scripts import EXTEND, RELEASE
from ..aio import AsyncLocks
from ..cluster import ClusterLocks
from ..locks import Locks
from ..settings import Settings, parse_url
from .admin import Node
from .servers import LocalCluster, RedisServer

__all__ = [
    "JOB", "MISSING", "RB_KEYSPACE", "RB_PATTERN", "REFERENCE", "TTL", "WINDOW", "Arena", "Case", "Group",
    "Unavailable", "WITHOUT_GET", "chunks", "compiled_core", "peer", "succeeded",
]  # fmt: skip

T = TypeVar("T")

WINDOW = 1000  # keys per batch call, and redis-benchmark's -P
JOB = "ProductSalesJob"
TTL = 60.0
# The reference of the batch groups, its release run on keys that are not there, and
# its acquire without GET (what Redis does for SET NX PX alone: the cost of the GET).
REFERENCE = "redis-benchmark"
MISSING = "redis-benchmark-missing"
WITHOUT_GET = "redis-benchmark-without-get"
# redis-benchmark's keys: "joblock:bench:" + 12 digits below this, i.e. "000" then 9
# digits. joblock's own keys put a run id of 100-999 in those first three digits.
RB_KEYSPACE = 10**9
RB_PATTERN = "joblock:bench:000*"


class Unavailable(Exception):
    """A contender that cannot run here: a peer not installed, the core not built."""


def peer(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise Unavailable(f"not installed (pip install {package})") from None


def compiled_core() -> ModuleType:
    found = compiled()
    if found is None:
        raise Unavailable("not built, or disabled here (JOBLOCK_NO_EXTENSIONS, not CPython)")
    return found


# -- the arena: one server, fresh keys, cleanup ---------------------------------------------


class Arena:
    """Where the contenders run: one Redis URL, a key namespace unique to this run.

    Keys are ``joblock:bench:<12 digits>``: a run id of 100-999, then a counter, so
    every repetition takes keys no one has used. ``purge()`` deletes what a
    repetition left (the peers' own key forms included).
    """

    def __init__(self, url: str, ttl: float = TTL) -> None:
        self.url = url
        self.settings: Settings = parse_url(url)
        self.ttl = ttl
        self.ms = round(ttl * 1000)
        self.run_id = random.randrange(100, 1000)
        self.namespace = f"joblock:bench:{self.run_id}"
        self._counter = 0
        self._admin: Node | None = None
        self._locks: dict[tuple[type[Any], str], Any] = {}
        self._redis: Any = None
        self._aio_redis: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cluster: LocalCluster | None = None
        self._cluster_nodes: list[Node] = []
        self._cluster_redis: Any = None
        self._closers: list[Callable[[], object]] = []
        self._redlock: list[RedisServer] = []
        self._redlock_nodes: list[Node] = []
        self.holder = holder_suffix()
        # joblock's lock values: 32 hex chars of token, then "@host:pid".
        self.value_len = 32 + len(self.holder)

    # keys
    def keys(self, n: int) -> list[str]:
        """``n`` keys never handed out before: ``joblock:bench:`` + 12 digits."""
        start = self._counter
        self._counter += n
        return [f"{self.namespace}{i:09d}" for i in range(start, start + n)]

    def arg_tuples(self, n: int) -> list[tuple[Any, ...]]:
        """Dedupe's input: ``(product_id, "daily")``, one in ten a repeat of the one before."""
        start = self._counter
        self._counter += n
        return [(start + i * 9 // 10, "daily") for i in range(n)]

    def tokens(self, n: int) -> list[str]:
        """Lock values for the peers written by hand: as long as joblock's, as random."""
        hexes = os.urandom(16 * n).hex()
        holder = self.holder.decode()
        return [hexes[i : i + 32] + holder for i in range(0, 32 * n, 32)]

    # clients
    def admin(self) -> Node:
        if self._admin is None:
            self._admin = Node(self.settings)
        return self._admin

    def locks(self, contender: str, kind: type[Any] = Locks) -> Any:
        """Locks (AsyncLocks, ClusterLocks) on the compiled or the pure twin, in this run's namespace."""
        if (kind, contender) not in self._locks:
            core = compiled_core() if contender.startswith("joblock-c") else _core_py
            cls = type(kind.__name__, (kind,), {"_core": core})
            url = self.cluster().url if issubclass(kind, ClusterLocks) else self.url
            # joblock-c-scripts: the compiled core with the server's native commands turned off.
            native = contender != "joblock-c-scripts"
            self._locks[kind, contender] = cls(url, prefix=self.namespace, native_commands=native)
        return self._locks[kind, contender]

    def on_close(self, closer: Callable[[], object]) -> None:
        """Something of a contender's to close with the arena (a socket of its own)."""
        self._closers.append(closer)

    def cluster(self) -> LocalCluster:
        """A local Redis Cluster of 3 primaries (no replicas), started on first use."""
        if self._cluster is None:
            try:
                self._cluster = LocalCluster(primaries=3, replicas=0).start()
            except (FileNotFoundError, RuntimeError) as e:
                raise Unavailable(f"no local Redis Cluster here: {e}") from None
            self._cluster_nodes = [Node(_node_settings(n.port)) for n in self._cluster.nodes]
        return self._cluster

    def redlock_urls(self) -> list[str]:
        """Three independent servers for the Redlock groups: the arena's and two started on first use."""
        if not self._redlock:
            try:
                self._redlock = [RedisServer().start() for _ in range(2)]
            except (FileNotFoundError, RuntimeError) as e:
                raise Unavailable(f"no redis-server here to start Redlock's servers: {e}") from None
            self._redlock_nodes = [Node(_node_settings(s.port)) for s in self._redlock]
        return [self.url, *(s.url for s in self._redlock)]

    def cluster_redis(self) -> Any:
        """redis-py's RedisCluster client on the arena's cluster."""
        if self._cluster_redis is None:
            cluster = peer("redis.cluster", "redis")
            self._cluster_redis = cluster.RedisCluster(host="127.0.0.1", port=self.cluster().nodes[0].port)
        return self._cluster_redis

    def redis(self) -> Any:
        """A redis-py client (hiredis parses its replies when installed)."""
        if self._redis is None:
            redis = peer("redis", "redis")
            self._redis = redis.Redis.from_url(self.url)
            for script in (RELEASE, EXTEND):  # the pipelines' EVALSHA
                self._redis.script_load(script)
        return self._redis

    def aio_redis(self) -> Any:
        """A redis.asyncio client, on the arena's event loop (hiredis parses its replies too)."""
        if self._aio_redis is None:
            aioredis = peer("redis.asyncio", "redis")
            # Enough connections for the largest crowd of tasks (redis-py caps its pool).
            self._aio_redis = aioredis.Redis.from_url(self.url, max_connections=1024)
            self.run(self._aio_redis.script_load(RELEASE))
        return self._aio_redis

    def run(self, work: Awaitable[T]) -> T:
        """Runs a coroutine to its end on the arena's event loop (made at first use)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(work)

    # server
    def call(self, *args: bytes | str | int) -> Any:
        return self.admin().call(*args)

    def info(self, section: str = "server") -> dict[str, str]:
        text = self.call("INFO", section).decode()
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    @functools.cached_property
    def nx_get(self) -> bool:
        """Whether the server takes SET with both NX and GET (Redis 7 and later); joblock
        sends SET NX then GET to Redis 6.2, which the references cannot send as one command.
        Asked once: every reference of a run asks it."""
        return int(self.info()["redis_version"].split(".")[0]) >= 7

    @functools.cached_property
    def dialect(self) -> Dialect | None:
        """The server's native compare-and-act commands, as a joblock connection learns them."""
        return dialect(*self.admin().calls(PROBE, errors_as_replies=True))

    def purge(self, pattern: str | None = None) -> int:
        """Deletes the keys matching ``pattern`` (default: all this run made), on the cluster too."""
        pattern = pattern or f"*{self.namespace}*"
        deleted = 0
        for node in [*self._cluster_nodes, *self._redlock_nodes]:  # the arena's own: nothing else there
            deleted += int(node.call("DBSIZE"))
            node.call("FLUSHALL")
        cursor = b"0"
        while True:
            cursor, found = self.call("SCAN", cursor, "MATCH", pattern, "COUNT", 10000)
            if found:
                deleted += self.call("UNLINK", *found)
            if cursor == b"0":
                return deleted

    def close(self) -> None:
        for closer in self._closers:
            closer()
        self.purge()
        self.purge(RB_PATTERN)
        for locks in self._locks.values():
            if isinstance(locks, AsyncLocks):
                self.run(locks.close())
            else:
                locks.close()
        if self._redis is not None:
            self._redis.close()
        if self._aio_redis is not None:
            self.run(getattr(self._aio_redis, "aclose", self._aio_redis.close)())
        if self._loop is not None:
            self._loop.close()
        if self._admin is not None:
            self._admin.close()
        if self._cluster_redis is not None:
            self._cluster_redis.close()
        for node in [*self._cluster_nodes, *self._redlock_nodes]:
            node.close()
        if self._cluster is not None:
            self._cluster.close()
        for server in self._redlock:
            server.close()

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class Group:
    id: str
    title: str
    unit: str  # what one operation is
    batch: int  # operations per call (and per pytest-benchmark round)
    reference: str  # a contender id, or REFERENCE
    contenders: tuple[str, ...]
    # One path with and without a layer: every contender does the reference's number of
    # operations, so that batch size plays no part in the ratio.
    alike: bool = False
    # One operation in this many finds its lock held (0: none does; 1: all do).
    held_every: int = 0

    def expected(self, n: int) -> int:
        """How many of ``n`` operations succeed."""
        return n - n // self.held_every if self.held_every else n


@dataclass
class Case:
    """One contender in one group.

    ``prepare(n)`` (untimed) makes the input of ``n`` operations: fresh keys, or the
    leases to release; ``run(input)`` (timed) does them and returns one entry per
    operation (a lease or lock, True, or a falsy value where it failed).
    """

    group: str
    contender: str
    prepare: Callable[[int], Any]
    run: Callable[[Any], list[Any]]


def chunks(items: Sequence[Any], size: int | None = WINDOW) -> list[Sequence[Any]]:
    """``items`` in calls of ``size``; all in one call when ``size`` is None."""
    if size is None:
        return [items]
    return [items[i : i + size] for i in range(0, len(items), size)]


def succeeded(results: list[Any]) -> int:
    """How many operations of a run succeeded (None, False and 0 did not)."""
    return sum(1 for r in results if r is not None and r is not False and not (type(r) is int and r <= 0))


def _node_settings(port: int) -> Settings:
    return Settings(port=port)
