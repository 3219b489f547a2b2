"""Worker subprocesses for the job framework tests, waiting on them, reading their events,
and counting what the test process writes to Redis.

A worker runs in its own process group, so that a test can kill it with all its
children (Celery's prefork pool, RQ's work horse and scheduler) as a crash would;
stopping it always ends the group, whatever the test did. Its output goes to a
file that a failing test prints.

``CountedWrites`` counts the writes on the connection of the test process's Locks: a
bulk enqueue that takes all its locks in one pipelined batch writes them at once.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import joblock

TESTS = os.path.dirname(os.path.abspath(__file__))
# Where the joblock under test was imported from (src/, or site-packages for a wheel).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(joblock.__file__))


def wait_for(predicate: Callable[[], Any], timeout: float, what: str = "condition") -> Any:
    """Polls ``predicate`` until it is truthy; fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def events(client: Any, run: str) -> list[str]:
    """What the jobs of test run ``run`` wrote to their event list, in order."""
    return [e.decode() for e in client.lrange(f"events:{run}", 0, -1)]


def wait_events(client: Any, run: str, n: int, what: str, timeout: float = 30) -> list[str]:
    """The events of ``run`` once there are at least ``n``."""

    def ready() -> list[str] | None:
        found = events(client, run)
        return found if len(found) >= n else None

    return wait_for(ready, timeout, what)  # type: ignore[no-any-return]


def wait_free(client: Any, key: str | bytes, timeout: float = 30) -> None:
    wait_for(lambda: not client.exists(key), timeout, f"the lock {key!r} to be freed")


def starts(happened: list[str]) -> int:
    return sum(1 for e in happened if e.startswith("start"))


def most_at_once(happened: list[str]) -> int:
    """The most runs inside at once in a list of a job's "start ..." and "end ..." events."""
    inside = most = 0
    for e in happened:
        inside += 1 if e.startswith("start") else -1 if e.startswith("end") else 0
        most = max(most, inside)
    return most


def import_app(name: str, redis_url: str) -> Any:
    """The test app module ``name``, imported with ``$JOBLOCK_TEST_REDIS`` naming the
    suite's Redis (as its workers see it), the environment left as it was."""
    saved = os.environ.get("JOBLOCK_TEST_REDIS")
    os.environ["JOBLOCK_TEST_REDIS"] = redis_url
    try:
        return importlib.import_module(name)
    finally:
        if saved is None:
            del os.environ["JOBLOCK_TEST_REDIS"]
        else:
            os.environ["JOBLOCK_TEST_REDIS"] = saved


def worker_env(twin: str, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS, PACKAGE_ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JOBLOCK_TEST_REDIS"] = redis_url
    if twin == "c":
        env.pop("JOBLOCK_NO_EXTENSIONS", None)
    else:
        env["JOBLOCK_NO_EXTENSIONS"] = "1"
    return env


class Worker:
    """A worker command running in its own process group, its output in ``log_path``."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path) -> None:
        self.command = command
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115  # closed in stop()
        self.process = subprocess.Popen(
            command,
            env=env,
            cwd=TESTS,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL to the whole group, as when the machine loses the worker."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def kill_and_watch_the_lock(self, client: Any, key: str | bytes, token: str, ttl: float) -> None:
        """Kills the worker mid-run, then watches the run's lock: nothing frees it, so it
        keeps the dead run's token until its ttl, and goes then, never earlier."""
        self.kill()
        killed = time.monotonic()
        left = client.pttl(key) / 1000
        assert 0 < left <= ttl
        while client.exists(key):
            assert client.get(key) in (token.encode(), None)
            assert time.monotonic() < killed + left + 5, "the lock outlived its ttl"
            time.sleep(0.02)
        assert time.monotonic() >= killed + left - 0.1, "the lock went before its ttl"

    def stop(self) -> None:
        if self.alive():
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        # Whatever is left of the group (children that outlived their parent) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(10)
        self._log.close()

    def report(self) -> str:
        tail = self.log()[-6000:]
        return f"--- {' '.join(self.command[:4])}... output (tail) ---\n{tail}"


def python() -> str:
    return sys.executable


class CountedWrites:
    """``with CountedWrites(locks) as counted:`` counts the writes of ``locks`` to Redis in the
    block (``counted.writes``); each goes on to the real socket."""

    def __init__(self, locks: joblock.Locks) -> None:
        self.locks = locks
        self.writes = 0

    def __enter__(self) -> CountedWrites:
        # One call first, so that the connection is open and its socket there to wrap.
        lease = self.locks.acquire(f"{self.locks.prefix}:warm:{os.getpid()}", 5)
        assert lease is not None and lease.release()
        self._conn = self.locks._driver._current().conns[None]
        self._sock = self._conn.sock
        self._conn.sock = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._conn.sock = self._sock

    def sendall(self, data: bytes) -> None:
        self.writes += 1
        self._sock.sendall(data)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._sock, attr)
