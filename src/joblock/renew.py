"""Auto-renewal: one background thread per Locks (one task per AsyncLocks) keeps leases alive.

Every lease registered here is extended at about a third of its ttl, in pipelined
batches (``extend_many``), so a thousand long jobs cost one round trip per beat, not
a thread each, and a slow round trip still ends well before the lease's deadline.
When an extend finds the lock gone, the lease is lost (the extend's verdict says so,
and its guard, if its block has one, stops the work: see ``joblock.lost``) and a
warning is logged; a renewal that does not come in time leaves the lease lost at its
deadline, whatever the renewer's thread is doing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from . import errors, metrics

if TYPE_CHECKING:
    from .aio import AsyncLease, AsyncLocks
    from .locks import Lease, Locks

logger = logging.getLogger("joblock")


class Entry:
    __slots__ = ("due", "lease", "ttl")

    # The lease is a Lease under a Renewer, an AsyncLease under an AsyncRenewer.
    def __init__(self, lease: Any, ttl: float) -> None:
        self.lease = lease
        self.ttl = ttl
        self.due = time.monotonic() + ttl / 3


class Schedule:
    """Which registered leases are due for renewal, and what an extend's verdicts mean.

    Not thread-safe by itself: the thread and asyncio renewers each guard it.
    """

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}

    def add(self, lease: Any, ttl: float) -> None:
        self.entries[id(lease)] = Entry(lease, ttl)

    def remove(self, lease: Any) -> None:
        self.entries.pop(id(lease), None)

    def due(self) -> tuple[list[Entry], float]:
        """The entries to extend now, and seconds until the next one is due otherwise."""
        now = time.monotonic()
        due = [e for e in self.entries.values() if e.due <= now]
        wait = 0.0 if due else min(e.due for e in self.entries.values()) - now
        return due, wait

    @staticmethod
    def by_ttl(due: list[Entry]) -> dict[float, list[Entry]]:
        groups: dict[float, list[Entry]] = {}
        for entry in due:
            groups.setdefault(entry.ttl, []).append(entry)
        return groups

    @staticmethod
    def postpone(entries: list[Entry], error: Exception) -> None:
        # Redis unreachable: try again soon; the locks hold until their ttl.
        logger.warning("joblock could not renew %d locks: %s", len(entries), error)
        if metrics.recorder is not None:
            metrics.recorder.unrenewed([entry.lease for entry in entries])
        for entry in entries:
            entry.due = time.monotonic() + min(1.0, entry.ttl / 10)

    def settle(self, entries: list[Entry], results: list[bool]) -> list[Entry]:
        """Reschedules the extended entries; returns (and drops) the lost ones."""
        lost = []
        for entry, ok in zip(entries, results):
            if ok:
                entry.due = time.monotonic() + entry.ttl / 3
            elif self.entries.get(id(entry.lease)) is entry:  # else released meanwhile: not lost
                del self.entries[id(entry.lease)]
                lost.append(entry)
        return lost

    @staticmethod
    def report_lost(entry: Entry) -> None:
        if entry.lease._watch is None or not entry.lease._watch.guards:  # else its guard says so
            logger.warning("joblock lost the lock %r: it expired or was taken", entry.lease.key)


class Renewer:
    """Extends registered leases from one thread until they are unregistered (or lost)."""

    def __init__(self, locks: Locks) -> None:
        self._locks = locks
        self._schedule = Schedule()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        _renewers.add(self)

    def _forked(self) -> None:
        # A forked child must not keep its parent's leases alive (a crashed parent's
        # locks would never expire), nor wait on a lock held at the fork by the
        # parent's renewer thread, which does not exist in the child.
        self._schedule = Schedule()
        self._wake = threading.Condition()
        self._thread = None

    def add(self, lease: Lease, ttl: float) -> None:
        with self._wake:
            self._schedule.add(lease, ttl)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="joblock-renewer", daemon=True)
                self._thread.start()
            self._wake.notify()

    def remove(self, lease: Lease) -> None:
        with self._wake:
            self._schedule.remove(lease)
            if not self._schedule.entries:
                self._wake.notify()  # the thread ends rather than sleep out a beat

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._schedule.entries:
                    self._thread = None
                    return
                due, wait = self._schedule.due()
                if not due:
                    self._wake.wait(wait)
                    continue
            for ttl, entries in Schedule.by_ttl(due).items():
                try:
                    results = self._locks.extend_many([e.lease for e in entries], ttl)
                except errors.JoblockError as e:
                    Schedule.postpone(entries, e)
                    continue
                with self._wake:
                    lost = self._schedule.settle(entries, results)
                for entry in lost:
                    Schedule.report_lost(entry)


class AsyncRenewer:
    """Extends registered leases from one task until they are unregistered (or lost)."""

    def __init__(self, locks: AsyncLocks) -> None:
        self._locks = locks
        self._schedule = Schedule()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, lease: AsyncLease, ttl: float) -> None:
        self._schedule.add(lease, ttl)
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()  # an Event binds to the loop it first waits on
            self._task = asyncio.ensure_future(self._run())
        self._wake.set()

    def remove(self, lease: AsyncLease) -> None:
        self._schedule.remove(lease)
        self._wake.set()

    async def _run(self) -> None:
        while self._schedule.entries:
            due, wait = self._schedule.due()
            if not due:
                self._wake.clear()
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue
            for ttl, entries in Schedule.by_ttl(due).items():
                try:
                    results = await self._locks.extend_many([e.lease for e in entries], ttl)
                except errors.JoblockError as e:
                    Schedule.postpone(entries, e)
                    continue
                for entry in self._schedule.settle(entries, results):
                    Schedule.report_lost(entry)


_renewers: weakref.WeakSet[Renewer] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for renewer in list(_renewers):
        renewer._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
