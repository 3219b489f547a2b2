"""Throwaway Redis Sentinel deployments: a primary, a replica and sentinels watching them.

For the tests of ``redis+sentinel://`` clients. The primary and the replica are
``RedisServer`` processes; each sentinel is ``redis-server <config> --sentinel`` on a
generated config file (a sentinel rewrites it as it learns, so it must be its own).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from joblock import errors
from joblock._core import core
from joblock._engine.sync import call
from joblock._tools.servers import RedisServer, ServerStartError, find_redis_server, free_port
from joblock.settings import Settings

__all__ = ["LocalSentinels", "SentinelServer"]


class SentinelServer:
    """One sentinel process on a free loopback port; ``lines`` are its config's."""

    def __init__(self, lines: list[str], binary: str, password: str | None = None) -> None:
        self.binary = binary
        self.port = free_port()
        self.password = password
        self.dir = tempfile.mkdtemp(prefix="joblock-sentinel-")
        self.config = os.path.join(self.dir, "sentinel.conf")
        self.lines = [
            f"port {self.port}", "bind 127.0.0.1", f"dir {self.dir}",
            f"logfile {os.path.join(self.dir, 'sentinel.log')}", *lines,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> SentinelServer:
        if not os.path.exists(self.config):  # a restart keeps what the sentinel learnt
            with open(self.config, "w") as config:
                config.write("\n".join(self.lines) + "\n")
        with open(os.path.join(self.dir, "stdout.log"), "wb") as stdout:
            self.process = subprocess.Popen(
                [self.binary, self.config, "--sentinel"], stdin=subprocess.DEVNULL, stdout=stdout
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                log = self.log("stdout.log") + self.log()
                raise ServerStartError(
                    f"{self.binary} --sentinel exited at start: {log[-2000:]}", self.binary, log
                )
            try:
                self.call("PING")
                return self
            except errors.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError(
                        f"sentinel: no answer within {timeout} s", self.binary, ""
                    ) from None
                time.sleep(0.02)

    def call(self, *command: Any) -> Any:
        """One command to this sentinel, on a connection of its own."""
        settings = Settings(port=self.port, password=self.password, retries=0, connect_timeout=2)
        return call(settings, core, [command])[0]

    def log(self, name: str = "sentinel.log") -> str:
        try:
            with open(os.path.join(self.dir, name), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class LocalSentinels:
    """A primary, a replica and ``sentinels`` sentinels watching them as ``service``.

    ``password`` protects the primary and the replica (the sentinels use it too);
    ``sentinel_password`` protects the sentinels themselves.
    """

    def __init__(
        self,
        sentinels: int = 3,
        service: str = "mymaster",
        password: str | None = None,
        sentinel_password: str | None = None,
        binary: str | None = None,
        replica_via: Callable[[int], int] | None = None,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.service = service
        self.password = password
        self.sentinel_password = sentinel_password
        # No wait before a full sync (Redis 7 waits 5 s for more replicas to come).
        args = ["--repl-diskless-sync-delay", "0"]
        if password:
            args += ["--requirepass", password, "--masterauth", password]
        self.servers = [RedisServer(*args, binary=self.binary)]
        # ``replica_via`` puts something (a fault proxy) on the replication link: given
        # the primary's port, the port the replica replicates from.
        link = self.servers[0].port if replica_via is None else replica_via(self.servers[0].port)
        replica_of = ["--replicaof", "127.0.0.1", str(link)]
        self.servers.append(RedisServer(*args, *replica_of, binary=self.binary))
        lines = [
            f"sentinel monitor {service} 127.0.0.1 {self.servers[0].port} {sentinels // 2 + 1}",
            f"sentinel down-after-milliseconds {service} 2000",
            f"sentinel failover-timeout {service} 20000",
        ]
        if password:
            lines.append(f"sentinel auth-pass {service} {password}")
        if sentinel_password:
            lines += [f"requirepass {sentinel_password}", f"sentinel sentinel-pass {sentinel_password}"]
        self.sentinels = [SentinelServer(lines, self.binary, sentinel_password) for _ in range(sentinels)]

    @property
    def url(self) -> str:
        """The ``redis+sentinel://`` URL of the service (without the passwords)."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self, timeout: float = 30.0) -> LocalSentinels:
        try:
            for server in self.servers:
                server.start()
            self._wait_replica(timeout)
            for sentinel in self.sentinels:
                sentinel.start()
            self.wait_ready(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def server_at(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def primary(self, sentinel: int = 0) -> RedisServer:
        """The primary, as the sentinel at ``sentinel`` names it."""
        _, port = self.sentinels[sentinel].call("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return self.server_at(int(port))

    def replica(self) -> RedisServer:
        """The server that is not the primary (as the first sentinel sees it)."""
        primary = self.primary()
        return next(s for s in self.servers if s is not primary)

    def call(self, server: RedisServer, *command: Any) -> Any:
        """One command to the primary or the replica, on a connection of its own."""
        settings = Settings(port=server.port, password=self.password, retries=0, connect_timeout=2)
        return call(settings, core, [command])[0]

    def _wait_replica(self, timeout: float) -> None:
        """Until the replica is in sync: a sentinel's first look at the primary then finds it."""
        deadline = time.monotonic() + timeout
        while b"state=online" not in self.call(self.servers[0], "INFO", "replication"):
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not get in sync with the primary")
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every sentinel names the primary and the first knows a replica in sync, able to take over."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._ready():
                    return
            except errors.JoblockError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "the local sentinels did not become ready: " + self.sentinels[0].log()[-2000:]
                )
            time.sleep(0.1)

    def _ready(self) -> bool:
        primary = self.primary()
        if any(self.primary(i) is not primary for i in range(1, len(self.sentinels))):
            return False
        replicas = self.sentinels[0].call("SENTINEL", "REPLICAS", self.service)
        for fields in replicas:
            info = dict(zip(fields[0::2], fields[1::2]))
            if info.get(b"flags") == b"slave" and info.get(b"master-link-status") == b"ok":
                return True
        return False

    def close(self) -> None:
        for sentinel in self.sentinels:
            sentinel.close()
        for server in self.servers:
            server.close()

    def __enter__(self) -> LocalSentinels:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
