"""Read-write locks (``shared=True``): readers hold a key together, a plain acquire of
the key is the writer and excludes them, and new readers queue behind a waiting writer.

Readers share a sorted set at the key (each reader's token scored by its expiry in ms of
the server's clock, the member "limit" scored 0); a writer is a plain lock there.

Every test runs once per core twin, against real redis-servers: the session's server,
and the session's local Redis Cluster where it says so. Time bounds are generous ("well
before the wait ends"); what is asserted exactly is Redis' state and the order of grants.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

import joblock
from helpers import name, stored, twin_name
from joblock._scripts import MARK
from joblock.aio import AsyncLocks
from test_waits import PROMPT, Waiter, granted_promptly, queue_key, queue_waiters, queued, until, until_queued

TTL = 30
READER = "a read-write lock (shared=True)"


def readers(raw, key):
    """The readers' members of a read-write lock's sorted set, without its "limit" entry."""
    return {m for m in raw.zrange(key, 0, -1) if m != b"limit"}


def server_ms(raw):
    seconds, micros = raw.time()
    return seconds * 1000 + micros // 1000


# -- readers together, the writer alone ----------------------------------------------------


def test_readers_hold_the_key_together_each_with_its_own_token(locks, raw, lease_type):
    key = name(locks, "report")
    before = server_ms(raw)
    leases = [locks.acquire(key, TTL, shared=True) for _ in range(3)]
    after = server_ms(raw)
    assert all(type(lease) is lease_type and lease.held for lease in leases)
    assert len({lease.token for lease in leases}) == 3
    assert all(lease.fence is None for lease in leases)
    # The sorted set: each reader scored by its expiry, "limit" by 0.
    assert raw.type(key) == b"zset"
    scores = dict(raw.zrange(key, 0, -1, withscores=True))
    assert scores.pop(b"limit") == 0
    assert set(scores) == {lease.token for lease in leases}
    assert all(before + TTL * 1000 <= score <= after + TTL * 1000 for score in scores.values())
    assert 25_000 < raw.pttl(key) <= TTL * 1000  # the key lives as long as its longest reader
    # The writer finds them busy, however it asks.
    counter = raw.get(locks._core.fence_key(key.encode()))
    assert locks.acquire(key, TTL) is None
    assert locks.acquire(key, TTL, fence=True) is None
    assert locks.acquire_many([key], TTL) == [None]
    with pytest.raises(joblock.LockNotAcquired):
        locks.lock(key, TTL).__enter__()
    assert raw.get(locks._core.fence_key(key.encode())) == counter  # no fencing number was taken
    assert leases[1].release() is True
    assert leases[1].release() is False  # already gone
    assert readers(raw, key) == {leases[0].token, leases[2].token}
    assert locks.acquire(key, TTL) is None  # two readers left
    assert locks.release_many([leases[0], leases[2]]) == [True, True]
    assert stored(raw, locks) == []  # the last reader out deletes the key
    writer = locks.acquire(key, TTL)
    assert writer is not None and raw.get(key) == writer.token
    assert writer.release() is True


def test_a_writer_excludes_readers(locks, make_locks, raw):
    key = name(locks, "written")
    writer = locks.acquire(key, TTL, fence=True)
    assert writer.fence >= 1
    other = make_locks()
    assert other.acquire(key, TTL, shared=True) is None
    assert other.acquire(key, TTL, shared=True, fair=True) is None
    with pytest.raises(joblock.LockNotAcquired), other.lock(key, TTL, shared=True):
        pass
    started = time.monotonic()
    assert other.acquire(key, TTL, shared=True, wait=0.3) is None
    assert time.monotonic() - started >= 0.25
    assert stored(raw, locks) == [key.encode()]  # nobody queued
    assert raw.get(key) == writer.token
    assert writer.release() is True
    reader = other.acquire(key, TTL, shared=True)
    assert reader is not None and readers(raw, key) == {reader.token}
    assert reader.release() is True


def test_extend_and_remaining_are_per_reader(locks, raw):
    key = name(locks, "per-reader")
    short, long = locks.acquire(key, 5, shared=True), locks.acquire(key, 50, shared=True)
    assert 3 < short.remaining() <= 5
    assert 45 < long.remaining() <= 50
    assert 45_000 < raw.pttl(key) <= 50_000
    assert short.extend(100) is True
    assert 95 < short.remaining() <= 100
    assert 45 < long.remaining() <= 50  # the other reader's expiry did not move
    assert 95_000 < raw.pttl(key) <= 100_000
    assert short.release() is True
    assert 45_000 < raw.pttl(key) <= 50_000  # back to the longest reader left
    assert short.extend(10) is False
    assert short.remaining() is None
    assert long.release() is True
    assert long.extend(10) is False
    assert long.remaining() is None
    assert raw.exists(key) == 0


def test_a_crashed_readers_place_frees_at_its_ttl(locks, make_locks, raw):
    key = name(locks, "crashed")
    gone = locks.acquire(key, 0.2, shared=True)  # a reader that never releases
    stays = locks.acquire(key, 0.8, shared=True)
    writing = make_locks()
    assert writing.acquire(key, TTL) is None
    time.sleep(0.4)
    # By the server's clock the first reader is gone; the second still holds the key.
    assert gone.remaining() is None
    assert gone.extend(10) is False
    assert gone.release() is False  # expired before release
    assert stays.remaining() is not None
    assert writing.acquire(key, TTL) is None
    another = locks.acquire(key, TTL, shared=True)  # readers still join
    assert another is not None and another.release() is True
    time.sleep(0.6)
    assert raw.exists(key) == 0  # expired with its last reader
    assert stays.release() is False
    writer = writing.acquire(key, TTL)
    assert writer is not None and writer.release() is True


def test_the_lock_context_manager_and_fair_readers(locks, make_locks, raw):
    key = name(locks, "context")
    other = make_locks()
    with locks.lock(key, TTL, shared=True) as first, other.lock(key, TTL, shared=True, fair=True) as second:
        assert first.held and second.held
        assert readers(raw, key) == {first.token, second.token}
        assert other.acquire(key, TTL) is None
        fair = other.acquire(key, TTL, shared=True, fair=True)
        assert fair is not None and fair.release() is True
    assert (first.held, second.held) == (False, False)
    assert stored(raw, locks) == []
    # A fair reader waits its turn as any reader: after the writer.
    writer = locks.acquire(key, 0.3)
    started = time.monotonic()
    lease = other.acquire(key, TTL, shared=True, fair=True, wait=10)
    assert lease is not None
    assert time.monotonic() - started < PROMPT
    assert writer.release() is False  # it expired, and the reader took the key
    assert readers(raw, key) == {lease.token}
    assert lease.release() is True


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"limit": 2}, "limit"),
        ({"limit": 3, "wait": 1}, "limit"),
        ({"fence": True}, "fence"),
        ({"fence": True, "wait": 1}, "fence"),
        ({"fence": True, "fair": True}, "fence"),
    ],
)
def test_shared_with_limit_or_fence_is_a_value_error_and_writes_nothing(locks, raw, options, word):
    key = name(locks, "bad")
    for call in (
        lambda: locks.acquire(key, TTL, shared=True, **options),
        lambda: locks.lock(key, TTL, shared=True, **options).__enter__(),
    ):
        with pytest.raises(ValueError, match=word) as caught:
            call()
        assert "shared=True" in str(caught.value)
    assert stored(raw, locks) == []


def test_readers_and_counting_locks_do_not_mix(locks, raw):
    counted, shared = name(locks, "counted"), name(locks, "shared")
    holder = locks.acquire(counted, TTL, limit=2)
    reader = locks.acquire(shared, TTL, shared=True)
    before = {key: raw.zrange(key, 0, -1, withscores=True) for key in (counted, shared)}
    for wait in (None, 2):
        started = time.monotonic()
        with pytest.raises(joblock.LimitMismatchError) as caught:
            locks.acquire(counted, TTL, shared=True, wait=wait)
        assert str(caught.value) == f"lock {counted.encode()!r} is a counting lock with limit=2, not {READER}"
        assert (caught.value.held, caught.value.asked) == (2, 0)
        with pytest.raises(joblock.LimitMismatchError) as caught:
            locks.acquire(shared, TTL, limit=2, wait=wait)
        assert str(caught.value) == f"lock {shared.encode()!r} is {READER}, not a counting lock with limit=2"
        assert (caught.value.held, caught.value.asked) == (0, 2)
        assert time.monotonic() - started < 1.5  # met at once, not at the wait's end
    with pytest.raises(joblock.BatchError, match="is a read-write lock") as batch:
        locks.acquire_many([name(locks, "fresh"), shared], TTL, limit=2)
    assert isinstance(batch.value.__cause__, joblock.LimitMismatchError)
    # Nothing written, nobody queued.
    assert {key: raw.zrange(key, 0, -1, withscores=True) for key in (counted, shared)} == before
    assert queued(raw, counted) == queued(raw, shared) == 0
    assert raw.exists(name(locks, "fresh")) == 0
    assert locks.release_many([holder, reader]) == [True, True]
    assert stored(raw, locks) == []


# -- waiting: the writer's turn, the readers' turn --------------------------------------------


def test_a_waiting_writer_is_handed_the_lock_by_the_last_reader(locks, make_locks, raw, lease_type):
    key = name(locks, "last-reader")
    first, second = (locks.acquire(key, TTL, shared=True) for _ in range(2))
    waiter = Waiter(make_locks(), key, wait=10, fence=True)
    waiter.start()
    until_queued(raw, key, 1)
    assert first.release() is True
    # One reader left: the writer still waits, queued.
    assert queued(raw, key) == 1 and readers(raw, key) == {second.token}
    assert waiter.is_alive()
    released = time.monotonic()
    assert second.release() is True
    lease = waiter.result()
    assert type(lease) is lease_type and lease.fence >= 1
    assert waiter.returned - released < PROMPT
    assert raw.get(key) == lease.token  # the release set the writer's lock in place
    assert raw.exists(queue_key(key)) == 0
    assert lease.release() is True
    assert stored(raw, locks) == []


def test_a_new_reader_queues_behind_a_waiting_writer(locks, make_locks, raw):
    key = name(locks, "writer-first")
    reader = locks.acquire(key, TTL, shared=True)
    writing, reading = make_locks(), make_locks()
    writer = Waiter(writing, key, wait=10)
    writer.start()
    until_queued(raw, key, 1)
    # Readers hold the key, but a writer waits: a new reader does not pass it.
    assert reading.acquire(key, TTL, shared=True) is None
    assert reading.acquire(key, TTL, shared=True, fair=True) is None
    with pytest.raises(joblock.LockNotAcquired), reading.lock(key, TTL, shared=True):
        pass
    assert readers(raw, key) == {reader.token}
    later = Waiter(reading, key, wait=10, shared=True)
    later.start()
    until_queued(raw, key, 2)
    assert reader.release() is True
    written = writer.result()
    assert written is not None and raw.get(key) == written.token + MARK  # a reader still queues
    # The writer has its turn; the reader still waits behind it.
    assert later.is_alive() and queued(raw, key) == 1
    time.sleep(0.1)
    assert later.is_alive() and raw.get(key) == written.token + MARK
    released = time.monotonic()
    assert written.release() is True
    lease = later.result()
    assert lease is not None
    assert released <= later.returned < released + PROMPT
    assert readers(raw, key) == {lease.token}
    assert lease.release() is True
    assert stored(raw, locks) == []


def test_a_writers_release_grants_every_reader_at_the_head_together(locks, make_locks, raw):
    key = name(locks, "batch-of-readers")
    writer = locks.acquire(key, TTL)
    waiting = make_locks()
    # The queue: two readers, a writer, another reader.
    kinds = [True, True, False, True]
    waiters = [
        Waiter(waiting, key, wait=15, shared=shared) if shared else Waiter(waiting, key, wait=15)
        for shared in kinds
    ]
    for i, waiter in enumerate(waiters):
        waiter.start()
        until_queued(raw, key, i + 1)
    r1, r2, w2, r3 = waiters
    released = time.monotonic()
    assert writer.release() is True
    leases = [r1.result(), r2.result()]
    assert all(leases) and max(r1.returned, r2.returned) - released < PROMPT
    assert readers(raw, key) == {lease.token for lease in leases}
    # The second writer is next; the reader behind it waits for its turn.
    assert queued(raw, key) == 2
    assert w2.is_alive() and r3.is_alive()
    assert leases[0].release() is True
    assert w2.is_alive()  # one reader still holds the key
    assert leases[1].release() is True
    written = w2.result()
    assert written is not None and raw.get(key) == written.token + MARK  # the reader r3 queues
    assert r3.is_alive() and queued(raw, key) == 1
    assert written.release() is True
    last = r3.result()
    assert last is not None and readers(raw, key) == {last.token}
    assert last.release() is True
    assert stored(raw, locks) == []


def test_readers_waiting_for_a_crashed_writer_are_granted_at_its_expiry(locks, make_locks, raw):
    key = name(locks, "crashed-writer")
    assert locks.acquire(key, 0.5) is not None  # never released
    leases = granted_promptly(*queue_waiters(make_locks(), raw, key, 3, shared=True))
    assert readers(raw, key) == {lease.token for lease in leases}
    assert raw.exists(queue_key(key)) == 0
    assert locks.release_many(leases) == [True, True, True]
    assert stored(raw, locks) == []


def test_a_waiting_writer_takes_the_key_when_the_last_crashed_readers_ttl_ends(locks, make_locks, raw):
    key = name(locks, "crashed-reader")
    assert locks.acquire(key, 0.5, shared=True) is not None  # never released
    long = locks.acquire(key, TTL, shared=True)
    waiter = Waiter(make_locks(), key, wait=4)
    started = time.monotonic()
    waiter.start()
    until_queued(raw, key, 1)
    assert long.release() is True  # only the crashed reader is left, for 0.5 s at most
    lease = waiter.result()
    assert lease is not None
    assert waiter.returned - started < 3, "the writer waited past the crashed reader's ttl"
    assert lease.release() is True


def test_a_reader_behind_a_writer_that_gives_up_joins_the_readers(locks, make_locks, raw):
    key = name(locks, "writer-gave-up")
    reader = locks.acquire(key, TTL, shared=True)
    waiting = make_locks()
    writer = Waiter(waiting, key, wait=0.5)
    writer.start()
    until_queued(raw, key, 1)
    later = Waiter(waiting, key, wait=4, shared=True)
    later.start()
    until_queued(raw, key, 2)
    assert writer.result() is None
    lease = later.result()
    assert lease is not None
    assert later.returned - writer.returned < 2, "the reader waited past the writer's turn"
    assert locks.release_many([reader, lease]) == [True, True]


# -- exclusion ------------------------------------------------------------------------------


def test_a_writer_is_never_with_anyone_and_readers_overlap(make_locks, raw):
    """Threads of two clients take one key as readers or writers, with waits, for about a
    second; a counter in memory checks who is inside at once."""
    clients = [make_locks(), make_locks()]
    key = name(clients[0], "exclusion")
    guard = threading.Lock()
    inside = {"readers": 0, "writers": 0}
    seen = {"writers_overlap": 0, "most_readers": 0, "reads": 0, "writes": 0}
    failures: list[str] = []
    stop = time.monotonic() + 1.0

    def work(t: int) -> None:
        locks, rng = clients[t % 2], random.Random(t)
        try:
            while time.monotonic() < stop:
                shared = rng.random() < 0.7
                lease = locks.acquire(key, TTL, shared=shared, wait=20)
                if lease is None:
                    failures.append(f"thread {t}: the wait ended without the lock")
                    return
                with guard:
                    inside["readers" if shared else "writers"] += 1
                    if inside["writers"] > 1 or (inside["writers"] and inside["readers"]):
                        seen["writers_overlap"] += 1
                    seen["most_readers"] = max(seen["most_readers"], inside["readers"])
                    seen["reads" if shared else "writes"] += 1
                time.sleep(rng.uniform(0.001, 0.01))
                with guard:
                    inside["readers" if shared else "writers"] -= 1
                if lease.release() is not True:
                    failures.append(f"thread {t}: release found the lock gone")
        except Exception as e:  # reported in the test's thread
            failures.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a thread never came back"
    assert failures == []
    assert seen["writers_overlap"] == 0
    assert seen["most_readers"] >= 2, seen
    assert seen["reads"] and seen["writes"], seen
    until(lambda: stored(raw, clients[0]) == [], "the key and its queue gone")


# -- asyncio and the cluster -------------------------------------------------------------


def test_async_readers_and_writers(core, redis_server, raw):
    cls = type("AsyncLocks", (AsyncLocks,), {"_core": core})
    prefix = f"rw-aio-{twin_name(core)}"

    async def main():
        async with (
            cls(redis_server.url, prefix=prefix) as locks,
            cls(redis_server.url, prefix=prefix) as other,
        ):
            key = name(locks, "aio")
            leases = await asyncio.gather(*(locks.acquire(key, TTL, shared=True) for _ in range(3)))
            assert all(lease is not None for lease in leases)
            assert readers(raw, key) == {lease.token for lease in leases}
            assert await locks.acquire(key, TTL) is None
            assert await locks.acquire(key, TTL, fence=True) is None
            assert await locks.acquire_many([key], TTL) == [None]
            assert 25 < await leases[0].remaining() <= TTL
            assert await leases[0].extend(60) is True
            assert 55 < await leases[0].remaining() <= 60
            with pytest.raises(ValueError, match="limit"):
                await locks.acquire(key, TTL, shared=True, limit=2)
            with pytest.raises(ValueError, match="fence"):
                await locks.acquire(key, TTL, shared=True, fence=True)
            with pytest.raises(joblock.LimitMismatchError, match="is a read-write lock"):
                await locks.acquire(key, TTL, limit=2)
            # A writer waits; a new reader does not pass it.
            task = asyncio.ensure_future(other.acquire(key, TTL, wait=10))
            while queued(raw, key) < 1:
                assert not task.done(), task
                await asyncio.sleep(0.005)
            assert await locks.acquire(key, TTL, shared=True) is None
            reader_task = asyncio.ensure_future(locks.acquire(key, TTL, shared=True, wait=10))
            while queued(raw, key) < 2:
                assert not reader_task.done(), reader_task
                await asyncio.sleep(0.005)
            assert await leases[0].release() is True
            assert await leases[0].release() is False
            assert not task.done()
            released = time.monotonic()
            assert await locks.release_many(leases[1:]) == [True, True]
            writer = await asyncio.wait_for(task, 30)
            assert writer is not None and time.monotonic() - released < PROMPT
            assert raw.get(key) == writer.token + MARK  # the reader still queues
            assert not reader_task.done()
            assert await writer.release() is True
            reader = await asyncio.wait_for(reader_task, 30)
            assert reader is not None and readers(raw, key) == {reader.token}
            async with other.lock(key, TTL, shared=True) as second:
                assert readers(raw, key) == {reader.token, second.token}
            assert await reader.release() is True
            counted = name(locks, "aio-counted")
            holder = await locks.acquire(counted, TTL, limit=2)
            with pytest.raises(joblock.LimitMismatchError, match="not a read-write lock"):
                await locks.acquire(counted, TTL, shared=True)
            assert await holder.release() is True

    asyncio.run(main())
    assert list(raw.scan_iter(f"{prefix}:*")) == []


def test_cluster_readers_and_writers_on_every_primary(core, cluster, cluster_raw, one_key_per_slot):
    cls = type("ClusterLocks", (joblock.ClusterLocks,), {"_core": core})
    prefix = f"rw-cluster-{twin_name(core)}"
    with cls(cluster.url, prefix=prefix) as locks, cls(cluster.url, prefix=prefix) as other:
        # Hash-tagged into slots 0, 8000 and 16000: one key on each primary.
        keys = [f"{prefix}:{{{one_key_per_slot[slot]}}}" for slot in (0, 8000, 16000)]
        assert {cluster_raw.keyslot(key) for key in keys} == {0, 8000, 16000}
        for key in keys:
            first, second = (locks.acquire(key, TTL, shared=True) for _ in range(2))
            assert first is not None and second is not None
            scores = dict(cluster_raw.zrange(key, 0, -1, withscores=True))
            assert scores.pop(b"limit") == 0 and set(scores) == {first.token, second.token}
            assert other.acquire(key, TTL) is None
            assert other.acquire_many([key], TTL) == [None]
            with pytest.raises(joblock.LimitMismatchError, match="is a read-write lock"):
                other.acquire(key, TTL, limit=2)
            assert 25 < second.remaining() <= TTL and second.extend(60) is True
            assert first.release() is True
            threading.Timer(0.2, second.release).start()
            started = time.monotonic()
            writer = other.acquire(key, TTL, wait=20, fence=True)
            assert writer is not None and writer.fence is not None
            assert time.monotonic() - started < 10  # handed over, not found at the wait's end
            assert cluster_raw.get(key) == writer.token
            assert locks.acquire(key, TTL, shared=True) is None
            threading.Timer(0.2, writer.release).start()
            reader = locks.acquire(key, TTL, shared=True, wait=20)
            assert reader is not None and reader.release() is True
            assert cluster_raw.exists(key) == 0
        counted = keys[0]
        holder = locks.acquire(counted, TTL, limit=2)
        with pytest.raises(joblock.LimitMismatchError, match="not a read-write lock"):
            other.acquire(counted, TTL, shared=True)
        assert holder.release() is True
