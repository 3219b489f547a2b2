"""A throwaway local Redis Cluster (primaries and replicas), for tests and benchmarks.

Each node is a ``RedisServer`` started with ``--cluster-enabled yes``; ``redis-cli
--cluster create`` joins them and gives every primary its replicas.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from . import errors
from ._core import core
from .connection import Connection
from .server import RedisServer, find_redis_server
from .settings import Settings

__all__ = ["LocalCluster", "find_redis_cli"]


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

    def conn(self, server: RedisServer) -> Connection:
        return Connection(Settings(port=server.port, connect_timeout=2, socket_timeout=5), core)

    def call(self, server: RedisServer, *args: Any) -> Any:
        conn = self.conn(server)
        try:
            return conn.call(*args)
        finally:
            conn.close()

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
