"""Alarms for event loops, kept by a thread: deadlines that cost a loop nothing until they pass.

An asyncio loop with any timer armed reads the clock and the head of its timer heap on
every turn, before and after each poll. The asyncio driver keeps a watchdog per connection
(the call that ends one whose replies stopped coming); as a loop timer it cost ~11,000
instructions per acquire + release pair (callgrind, scripts/instructions.sh), 8% of a
lone task's pair, to guard against what almost never happens. Kept here instead, a
deadline costs the loop nothing until it passes; then its callback is handed to the loop
with ``call_soon_threadsafe`` and runs there, like a timer's.

One thread per process while there are alarms (a connection's watchdog is re-armed for
as long as it is open), asleep until the next deadline.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import threading
from collections.abc import Callable
from contextlib import suppress
from time import monotonic
from typing import Any

__all__ = ["Alarm", "call_at"]


Loop = asyncio.AbstractEventLoop

# How long the thread waits for a new alarm once none is left, before it ends.
LINGER = 1.0


class Alarm:
    """One deadline: ``callback(*args)`` on ``loop`` at its time, unless cancelled."""

    __slots__ = ("args", "callback", "cancelled", "loop")

    def __init__(self, loop: Loop, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self.loop = loop
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        _keeper.wake()  # with no other alarm left, the thread ends now rather than at its time


class _Keeper:
    """The alarms of a process and the thread that rings them."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """No alarms and no thread: a forked child's start (the parent's thread is not in
        the child and may have held the lock at the fork; the parent's loops are not its own)."""
        self.due: list[tuple[float, int, Alarm]] = []
        self.order = itertools.count()  # equal deadlines ring in the order they were set
        self.changed = threading.Condition()
        self.thread: threading.Thread | None = None

    def call_at(self, when: float, loop: Loop, callback: Callable[..., object], *args: Any) -> Alarm:
        """Calls ``callback(*args)`` on ``loop`` once ``time.monotonic()`` reaches ``when``."""
        alarm = Alarm(loop, callback, args)
        with self.changed:
            heapq.heappush(self.due, (when, next(self.order), alarm))
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name="joblock-alarms", daemon=True)
                self.thread.start()
            elif self.due[0][2] is alarm:  # sooner than the thread sleeps for
                self.changed.notify()
        return alarm

    def wake(self) -> None:
        with self.changed:
            self.changed.notify()

    def run(self) -> None:
        with self.changed:
            while True:
                now = monotonic()
                while self.due and (self.due[0][0] <= now or self.due[0][2].cancelled):
                    alarm = heapq.heappop(self.due)[2]
                    if not alarm.cancelled:
                        with suppress(RuntimeError):  # the loop was closed: what it watched went with it
                            alarm.loop.call_soon_threadsafe(alarm.callback, *alarm.args)
                if self.due:
                    self.changed.wait(self.due[0][0] - now)
                elif not self.changed.wait(LINGER):  # (a watchdog that rang sets its next alarm)
                    break
            # None left (every connection closed): the thread ends, and the next alarm
            # starts another. No thread stays behind a closed client (a fork warns of one).
            self.thread = None


_keeper = _Keeper()
call_at = _keeper.call_at

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keeper.forget)
