"""What the Celery and RQ test jobs share: their Locks and an event log in Redis.

Imported by the test process and by the worker processes. Jobs write what they do to
the Redis list ``events:<run>``, ``run`` being a per-test id, so tests sharing a
worker never see each other's jobs.
"""

from __future__ import annotations

from typing import Any

import redis

from joblock import Locks


class JobState:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._state: dict[str, Any] = {}

    def configure(self, url: str) -> None:
        self._state["events"] = redis.Redis.from_url(url)
        self._state.setdefault("locks", Locks(url, prefix=self.prefix))

    def use_locks(self, locks: Locks) -> None:
        """The test process swaps in Locks on its own core twin."""
        self._state["locks"] = locks

    def get_locks(self) -> Locks:
        return self._state["locks"]  # type: ignore[no-any-return]

    @property
    def events(self) -> Any:
        """The redis-py client on db 0, where the events (and test counters) live."""
        return self._state["events"]

    def note(self, run: str, *words: object) -> None:
        self._state["events"].rpush(f"events:{run}", " ".join(str(w) for w in words))
