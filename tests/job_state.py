"""What the test jobs of Celery, RQ, Huey and Dramatiq share: their Locks and an event log in Redis.

Imported by the test process and by the worker processes. Jobs write what they do to
the Redis list ``events:<run>``, ``run`` being a per-test id, so tests sharing a
worker never see each other's jobs.
"""

from __future__ import annotations

import time
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

    @staticmethod
    def gate(run: str) -> str:
        """The key a test sets once every copy of a burst is sent."""
        return f"gate:{run}"

    def until_gate(self, run: str) -> None:
        """A gated job's wait for its test's gate: a run keeps its lock while any copy of
        its arguments is still being sent (the deadline only frees the workers of a
        failed test)."""
        deadline = time.monotonic() + 30
        while not self.events.exists(self.gate(run)) and time.monotonic() < deadline:
            time.sleep(0.01)

    def note(self, run: str, *words: object) -> None:
        self._state["events"].rpush(f"events:{run}", " ".join(str(w) for w in words))

    def until_stopped(self, run: str) -> str:
        """A job's body that a lost lock must stop (``lock_on_lost``): it says it started
        with its lease's token, works in small steps of Python (where an interrupt lands)
        for longer than any test waits, and says "end" only if nothing stopped it."""
        from joblock import current_lease

        lease = current_lease()
        self.note(run, "start", "-" if lease is None else lease.token.decode())
        end = time.monotonic() + 60
        while time.monotonic() < end:
            time.sleep(0.005)
        self.note(run, "end")
        return "not stopped"
