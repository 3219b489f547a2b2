"""``joblock demo``: the Rails article's two problems and a dispatcher, on real Redis.

1. CleanupDataJob: one cleanup at a time across all workers; a run that finds the
   lock taken re-enqueues itself (the article waits 2 minutes; the demo 0.3 s).
2. ProductSalesJob: one run per product at a time, different products side by side;
   duplicates are skipped.
3. A dispatcher deduplicating a burst of submissions with ``locks.dedupe``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .._core import implementation
from ..locks import Locks
from .admin import describe_server, server_info

REENQUEUE_DELAY = 0.3


class DelayQueue:
    """A tiny job queue with delayed jobs, standing in for Sidekiq/Celery/RQ."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._busy = 0
        self._stopped = False

    def put(self, fn: Callable[..., Any], *args: Any, delay: float = 0.0) -> None:
        with self._cond:
            if self._stopped:
                return
            heapq.heappush(self._heap, (time.monotonic() + delay, next(self._seq), fn, args))
            self._cond.notify()

    def work(self) -> None:
        """A worker: runs jobs until the queue is empty and no worker is busy."""
        while True:
            with self._cond:
                while True:
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        _, _, fn, args = heapq.heappop(self._heap)
                        self._busy += 1
                        break
                    if self._stopped or (not self._heap and not self._busy):
                        self._cond.notify_all()
                        return
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else 0.05)
            try:
                fn(*args)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def run(self, workers: int) -> None:
        threads = [threading.Thread(target=self.work) for _ in range(workers)]
        try:
            # Inside the try: Thread.start() waits for the thread to run, and Ctrl-C can
            # come then too.
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except KeyboardInterrupt:
            # Ctrl-C: the workers finish the job in hand while Redis is still there, and
            # take no more; then the command ends with its one line.
            with self._cond:
                self._stopped = True
                self._cond.notify_all()
            for t in threads:
                if t.ident is not None:  # started
                    t.join()
            raise


class Witness:
    """Counts how many runs are inside a critical section at once, per key, and which
    keys were inside together: the most at one moment, in ``together``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now: Counter[Any] = Counter()
        self.most: Counter[Any] = Counter()
        self.together: list[Any] = []

    def enter(self, key: Any) -> None:
        with self._lock:
            self._now[key] += 1
            self.most[key] = max(self.most[key], self._now[key])
            inside = sorted(k for k, n in self._now.items() if n)
            if len(inside) > len(self.together):
                self.together = inside

    def leave(self, key: Any) -> None:
        with self._lock:
            self._now[key] -= 1


def cleanup_problem(locks: Locks, out: Callable[[str], None]) -> None:
    queue = DelayQueue()
    witness = Witness()
    stats: Counter[str] = Counter()

    def reenqueue(user_id: int) -> None:
        stats["re-enqueued"] += 1
        queue.put(cleanup_data_job, user_id, delay=REENQUEUE_DELAY)

    # identifier=None: one lock for the whole job, whatever the user (the article's
    # global "cleanup_data_job_lock").
    @locks.job(ttl=300, name="CleanupDataJob", identifier=lambda user_id: None, on_locked=reenqueue)
    def cleanup_data_job(user_id: int) -> None:
        witness.enter("all")
        time.sleep(0.2)  # deleting the user's data
        stats["ran"] += 1
        witness.leave("all")

    for user_id in range(1, 5):
        queue.put(cleanup_data_job, user_id)
    queue.run(workers=4)
    out("1. CleanupDataJob: one cleanup at a time; a busy run re-enqueues itself (problem 1)")
    out(f"   4 workers, 4 users, 0.2 s each, re-enqueue after {REENQUEUE_DELAY} s (the article: 2 minutes)")
    out(
        f"   ran {stats['ran']}, re-enqueued {stats['re-enqueued']} times, "
        f"most running at once: {witness.most['all']}"
    )


def product_problem(locks: Locks, out: Callable[[str], None]) -> None:
    queue = DelayQueue()
    witness = Witness()
    stats: Counter[str] = Counter()

    def skipped(product_id: int) -> None:
        stats["skipped"] += 1

    @locks.job(ttl=300, name="ProductSalesJob", on_locked=skipped)
    def product_sales_job(product_id: int) -> None:
        witness.enter(product_id)
        time.sleep(0.05)  # fetching the product's sales
        stats["ran"] += 1
        witness.leave(product_id)

    rng = random.Random(7)
    for i in range(100):  # submissions trickle in over half a second
        queue.put(product_sales_job, rng.choice((101, 102, 103)), delay=i * 0.005)
    queue.run(workers=8)
    most = max(witness.most.values())
    out("2. ProductSalesJob: one run per product at a time, different products at once; duplicates skipped")
    out(f"   100 submissions over 3 products on 8 workers: ran {stats['ran']}, skipped {stats['skipped']}")
    out(f"   most runs of one product at once: {most}")
    together = ", ".join(map(str, witness.together))
    out(f"   most products running at once: {len(witness.together)} ({together} together)")


def _progress(items: Iterable[Any], total: int) -> Iterator[Any]:
    """Yields items, drawing a progress bar on stderr (redrawn in place on a terminal)."""
    width = 30
    tty = sys.stderr.isatty()
    every = total // 20 if tty else total // 4
    for i, item in enumerate(items, 1):
        if i % every == 0 or i == total:
            done = width * i // total
            start = "\r" if tty else ""
            sys.stderr.write(f"{start}   [{'#' * done}{'.' * (width - done)}] {i:,}/{total:,}")
            sys.stderr.write("" if tty and i < total else "\n")
            sys.stderr.flush()
        yield item


def dispatcher(locks: Locks, out: Callable[[str], None]) -> None:
    total = 200_000
    rng = random.Random(11)
    submissions = [(rng.randrange(50_000),) for _ in range(total)]
    distinct = len(set(submissions))
    out(
        f"3. Dispatcher: dedupe {total:,} submissions of ReportJob ({distinct:,} distinct) "
        "in windows of 1,000"
    )
    started = time.perf_counter()
    leases = locks.dedupe("ReportJob", _progress(submissions, total), ttl=60)
    elapsed = time.perf_counter() - started
    dispatched = sum(lease is not None for lease in leases)
    out(
        f"   dispatched {dispatched:,}, dropped {total - dispatched:,} duplicates in {elapsed:.2f} s "
        f"({total / elapsed:,.0f} submissions/s)"
    )
    released = sum(locks.release_many(leases))
    out(f"   released {released:,} locks when the dispatched jobs finished")


def run(url: str, prefix: str) -> int:
    out = print
    # The demo's own prefix, so it never touches real locks.
    locks = Locks(url, prefix=f"{prefix}-demo-{random.getrandbits(32):08x}")
    logging.basicConfig(level=logging.WARNING, format="   %(message)s")
    out(f"joblock demo against {locks.settings.url()} (core: {implementation})")
    out(f"server: {describe_server(server_info(locks.settings))}\n")
    try:
        cleanup_problem(locks, out)
        out("")
        product_problem(locks, out)
        out("")
        dispatcher(locks, out)
    finally:
        locks.close()
    return 0
