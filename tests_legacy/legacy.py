"""What the arq and taskiq tests share: AsyncLocks on one twin, worker environments, events."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import redis
import redis.asyncio

from joblock.aio import AsyncLocks
from workers import wait_for, worker_env

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 30


def async_locks_class(core: ModuleType) -> type[AsyncLocks]:
    return type("AsyncLocks", (AsyncLocks,), {"_core": core})


def legacy_env(twin: str, redis_url: str) -> dict[str, str]:
    """The suite's worker environment, with this directory's job modules importable."""
    env = worker_env(twin, redis_url)
    env["PYTHONPATH"] = os.pathsep.join([HERE, env["PYTHONPATH"]])
    return env


def events(client: redis.Redis, run: str) -> list[str]:
    return [e.decode() for e in client.lrange(f"events:{run}", 0, -1)]


def wait_events(client: redis.Redis, run: str, n: int, what: str) -> list[str]:
    def ready() -> list[str] | None:
        found = events(client, run)
        return found if len(found) >= n else None

    return wait_for(ready, TIMEOUT, what)  # type: ignore[no-any-return]


def starts(items: list[str]) -> int:
    return sum(1 for e in items if e.startswith("start"))


class AsyncState:
    """The AsyncLocks of the job module (swapped by the test process) and its event log."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.state: dict[str, Any] = {}
        if os.environ.get("JOBLOCK_TEST_REDIS"):
            self.configure(os.environ["JOBLOCK_TEST_REDIS"])

    def configure(self, url: str) -> None:
        self.state["url"] = url
        self.state["events"] = redis.Redis.from_url(url)
        self.state.setdefault("locks", AsyncLocks(url, prefix=self.prefix))

    def use_locks(self, locks: AsyncLocks) -> None:
        self.state["locks"] = locks

    def get_locks(self) -> AsyncLocks:
        return self.state["locks"]  # type: ignore[no-any-return]

    def note(self, run: str, *words: object) -> int:
        """Adds an event; returns how many the run has now."""
        # A blocking write to the event list: ordering is all the tests need.
        return self.state["events"].rpush(f"events:{run}", " ".join(str(w) for w in words))  # type: ignore[no-any-return]

    async def word(self, run: str) -> None:
        """Waits (without blocking the worker's loop) for the test's ``go:<run>``."""
        client = redis.asyncio.Redis.from_url(self.state["url"])
        try:
            await client.blpop([f"go:{run}"], timeout=TIMEOUT)
        finally:
            await client.aclose()


def most_at_once(items: list[str]) -> int:
    """The most runs between their "start" and "end" events at one point of the log."""
    running = most = 0
    for e in items:
        running += e.startswith("start") - e.startswith("end")
        most = max(most, running)
    return most
