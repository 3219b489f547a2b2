"""Counting locks (``limit=N``): up to N holders of one key at once, each with its own
token and expiry, judged by the server's clock.

Every test runs once per core twin, against real redis-servers: the session's server,
and the session's local Redis Cluster where it says so.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import joblock
from helpers import name, stored, twin_name
from joblock.aio import AsyncLocks

TTL = 30


def holders(raw, key):
    """The members of a counting lock's sorted set, without its "limit" entry."""
    return [m for m in raw.zrange(key, 0, -1) if m != b"limit"]


# -- the single-lock API ---------------------------------------------------------------


def test_up_to_limit_holders_each_with_its_own_token(locks, raw, lease_type):
    key = name(locks, "export")
    leases = [locks.acquire(key, TTL, limit=3) for _ in range(3)]
    assert all(type(lease) is lease_type and lease.held for lease in leases)
    assert len({lease.token for lease in leases}) == 3
    assert locks.acquire(key, TTL, limit=3) is None  # the fourth waits its turn
    assert sorted(holders(raw, key)) == sorted(lease.token for lease in leases)
    assert raw.zscore(key, "limit") == -3
    assert leases[1].release() is True
    assert leases[1].release() is False  # already gone
    again = locks.acquire(key, TTL, limit=3)
    assert again is not None
    assert locks.release_many([leases[0], leases[2], again]) == [True, True, True]
    assert stored(raw, locks) == []  # the last holder out deletes the key


def test_extend_and_remaining_are_per_holder(locks, raw):
    key = name(locks, "per-holder")
    short, long = locks.acquire(key, 5, limit=2), locks.acquire(key, 50, limit=2)
    assert 3 < short.remaining() <= 5
    assert 45 < long.remaining() <= 50
    assert 45_000 < raw.pttl(key) <= 50_000  # the key lives as long as its longest holder
    assert short.extend(100) is True
    assert 95 < short.remaining() <= 100
    assert 95_000 < raw.pttl(key) <= 100_000
    assert short.release() is True
    assert 45_000 < raw.pttl(key) <= 50_000  # back to the longest holder left
    assert long.release() is True
    assert long.extend(10) is False
    assert long.remaining() is None
    assert raw.exists(key) == 0


def test_a_crashed_holders_slot_frees_at_its_ttl_and_the_key_with_the_last(locks, raw):
    key = name(locks, "crashed")
    gone = locks.acquire(key, 0.2, limit=2)  # a holder that never releases
    stays = locks.acquire(key, 0.6, limit=2)
    assert locks.acquire(key, TTL, limit=2) is None
    time.sleep(0.3)
    # The server's clock says the first slot is free; the key is still there for the second.
    taken = locks.acquire(key, TTL, limit=2)
    assert taken is not None
    assert gone.release() is False  # expired before release
    assert taken.release() is True
    time.sleep(0.4)
    assert raw.exists(key) == 0  # expired with its last holder
    assert stays.remaining() is None
    assert stays.release() is False


def test_wait_takes_a_slot_when_one_frees(locks):
    key = name(locks, "wait")
    first = [locks.acquire(key, 0.3, limit=2) for _ in range(2)]
    assert all(first)
    started = time.monotonic()
    lease = locks.acquire(key, TTL, limit=2, wait=5)
    assert lease is not None
    assert time.monotonic() - started > 0.1  # it did wait for an expiry
    assert lease.release() is True
    # The other first slot's ttl may not have run out yet (the two were granted a few ms
    # apart, more on a busy machine): released here, so that both places are free below.
    for other in first:
        other.release()
    with locks.lock(key, TTL, limit=2) as held:
        assert held.held
        assert locks.acquire(key, TTL, limit=2) is not None  # its second slot
        with pytest.raises(joblock.LockNotAcquired), locks.lock(key, TTL, limit=2, wait=0.05):
            pass


def test_fenced_holders_get_growing_numbers(locks, raw):
    key = name(locks, "fenced")
    leases = [locks.acquire(key, TTL, limit=2, fence=True) for _ in range(3)]
    assert leases[2] is None and 1 <= leases[0].fence < leases[1].fence
    assert leases[0].token.endswith(b"#%d" % leases[0].fence)  # the holder's member in the sorted set
    assert sorted(holders(raw, key)) == sorted([leases[0].token, leases[1].token])
    assert leases[0].release() is True
    third = locks.acquire(key, TTL, limit=2, fence=True)
    assert third.fence > leases[1].fence
    assert raw.get(locks._core.fence_key(key.encode())) == b"%d" % third.fence
    assert locks.release_many([leases[1], third]) == [True, True]


# -- limits that do not match --------------------------------------------------------------


def test_another_limit_on_a_counting_lock_raises_naming_the_key(locks, raw):
    key = name(locks, "mismatch")
    lease = locks.acquire(key, TTL, limit=3)
    before = raw.zrange(key, 0, -1, withscores=True)
    with pytest.raises(joblock.LimitMismatchError) as caught:
        locks.acquire(key, TTL, limit=2)
    assert str(caught.value) == f"lock {key.encode()!r} is a counting lock with limit=3, not limit=2"
    assert (caught.value.held, caught.value.asked) == (3, 2)
    assert isinstance(caught.value, joblock.ReplyError)
    assert raw.zrange(key, 0, -1, withscores=True) == before  # nothing written
    # In a batch, as any error reply there: a BatchError once the grants went back.
    with pytest.raises(joblock.BatchError, match="is a counting lock with limit=3, not limit=4") as batch:
        locks.acquire_many([name(locks, "fresh"), key], TTL, limit=4)
    assert isinstance(batch.value.__cause__, joblock.LimitMismatchError)
    assert (batch.value.granted, batch.value.unreleased) == (1, 0)
    assert raw.exists(name(locks, "fresh")) == 0
    assert lease.release() is True


def test_a_plain_locks_key_as_a_counting_lock_raises(locks, raw):
    key = name(locks, "plain")
    lease = locks.acquire(key, TTL)
    with pytest.raises(joblock.LimitMismatchError) as caught:
        locks.acquire(key, TTL, limit=2)
    assert str(caught.value) == (
        f"lock {key.encode()!r} is a plain lock (limit=1), not a counting lock with limit=2"
    )
    assert raw.get(key) == lease.token
    assert lease.release() is True


def error_replies(raw):
    return int(raw.info("stats")["total_error_replies"])


def test_a_holders_token_says_its_kind_and_no_operation_meets_an_error_reply(locks, raw):
    def every_operation():
        counted = locks.acquire(name(locks, "counted"), TTL, limit=2)
        plain = locks.acquire(name(locks, "plain"), TTL)
        assert counted.token[32:33] == b"~" and plain.token[32:33] == b"@"
        for lease in (counted, plain):
            assert lease.extend(60) is True
            assert 55 < lease.remaining() <= 60
            assert lease.release() is True
            assert lease.release() is False
        batch = locks.acquire_many([name(locks, "counted")] * 3, TTL, limit=2, fence=True)
        assert locks.extend_many(batch, 60) == [True, True, False]
        assert locks.release_many(batch) == [True, True, False]

    every_operation()  # the scripts loaded (NOSCRIPT is an error reply), Redis 6.2's refusal met
    # The scripts read each kind its own way: Redis's errorstats stay as they were.
    before = error_replies(raw)
    every_operation()
    assert error_replies(raw) == before


def test_a_lease_never_touches_a_lock_of_the_other_kind_at_its_key(locks, raw):
    key = name(locks, "switched")
    counted = locks.acquire(key, 0.05, limit=2)
    time.sleep(0.1)
    plain = locks.acquire(key, TTL)  # the counting lock expired: a plain lock now
    assert (counted.remaining(), counted.extend(10), counted.release()) == (None, False, False)
    assert raw.get(key) == plain.token and 25_000 < raw.pttl(key) <= TTL * 1000
    lost = plain
    assert raw.delete(key) == 1
    theirs = locks.acquire(key, TTL, limit=3)
    assert (lost.remaining(), lost.extend(10), lost.release()) == (None, False, False)
    assert holders(raw, key) == [theirs.token]
    assert theirs.release() is True


def test_a_counting_locks_key_as_a_plain_lock_raises(locks, raw):
    key = name(locks, "counting")
    lease = locks.acquire(key, TTL, limit=2)
    before = raw.zrange(key, 0, -1, withscores=True)
    message = f"lock {key.encode()!r} is a counting lock with limit=2, not a plain lock (limit=1)"
    for plain in (
        lambda: locks.acquire(key, TTL),
        lambda: locks.acquire(key, TTL, wait=1),
        lambda: locks.acquire(key, TTL, fence=True),
        lambda: locks.lock(key, TTL).__enter__(),
    ):
        with pytest.raises(joblock.LimitMismatchError) as caught:
            plain()
        assert str(caught.value) == message
        assert (caught.value.held, caught.value.asked) == (2, 1)
    with pytest.raises(joblock.BatchError, match="is a counting lock with limit=2, not a plain") as batch:
        locks.acquire_many([name(locks, "fresh"), key], TTL)
    assert isinstance(batch.value.__cause__, joblock.LimitMismatchError)
    assert (batch.value.granted, batch.value.unreleased) == (1, 0)
    assert raw.zrange(key, 0, -1, withscores=True) == before  # nothing written
    assert raw.exists(name(locks, "fresh")) == 0
    assert lease.release() is True


def test_a_key_of_another_type_is_no_lock(locks, raw):
    key, counted = name(locks, "list"), name(locks, "zset")
    raw.rpush(key, "job")
    raw.zadd(counted, {"limit": 5})  # a sorted set that no counting lock wrote
    for taken in (key, counted):
        for fence in (False, True):
            with pytest.raises(joblock.WrongTypeError, match="WRONGTYPE"):
                locks.acquire(taken, TTL, fence=fence)
    assert raw.lrange(key, 0, -1) == [b"job"]
    raw.delete(key, counted)


@pytest.mark.parametrize(
    ("limit", "error", "message"),
    [
        (0, ValueError, "limit must be between 1 and 10000, not 0"),
        (-2, ValueError, "limit must be between 1 and 10000, not -2"),
        (10_001, ValueError, "limit must be between 1 and 10000, not 10001"),
        (2.0, TypeError, "limit must be an int, not float"),
        ("3", TypeError, "limit must be an int, not str"),
        (True, TypeError, "limit must be an int, not bool"),
        (None, TypeError, "limit must be an int, not NoneType"),
    ],
)
def test_bad_limits_name_the_argument_and_write_nothing(locks, raw, limit, error, message):
    key = name(locks, "bad")
    calls = [
        lambda: locks.acquire(key, TTL, limit=limit),
        lambda: locks.acquire(key, TTL, limit=limit, wait=1),
        lambda: locks.acquire_many([key], TTL, limit=limit),
        lambda: locks.dedupe("Export", [(1,)], TTL, limit=limit),
        lambda: locks.job(ttl=TTL, limit=limit),
    ]
    for call in calls:
        with pytest.raises(error) as caught:
            call()
        assert str(caught.value) == message
    assert stored(raw, locks) == []


# -- batches --------------------------------------------------------------------------------


def test_batches_take_slots_up_to_the_limit(locks, raw):
    a, b = name(locks, "a"), name(locks, "b")
    leases = locks.acquire_many([a, a, a, b], TTL, limit=2)
    assert [lease is not None for lease in leases] == [True, True, False, True]
    assert len(holders(raw, a)) == 2
    assert locks.extend_many(leases, 60) == [True, True, False, True]
    assert 55_000 < raw.pttl(a) <= 60_000
    plain = locks.acquire(name(locks, "plain"), TTL)
    # Plain and counting leases in one batch: one script serves both kinds.
    assert locks.release_many([*leases, plain]) == [True, True, False, True, True]
    assert stored(raw, locks) == []


def test_dedupe_lets_limit_copies_through(locks, raw):
    leases = locks.dedupe("Export", [(1,), (2,), (1,), (1,)], TTL, limit=2, fence=True)
    assert leases[3] is None and leases[2].fence > leases[0].fence  # the key's copies: one counter
    assert leases[0].key == locks.key("Export", 1)
    assert locks.release_many(leases) == [True, True, True, False]
    assert stored(raw, locks) == []


# -- jobs --------------------------------------------------------------------------------------


def test_a_job_with_a_limit_runs_at_most_n_at_once(locks):
    inside, most = [0], [0]
    started = []

    @locks.job(ttl=TTL, limit=2, identifier=lambda *a: None, wait=10)
    def cleanup(n):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        started.append(n)
        time.sleep(0.05)
        inside[0] -= 1
        return n

    threads = [threading.Thread(target=cleanup, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(started) == list(range(6))
    assert most[0] == 2


def test_a_job_with_a_limit_skips_when_all_slots_are_held(locks):
    key = locks.key("Export")
    held = [locks.acquire(key, TTL, limit=2) for _ in range(2)]

    @locks.job(ttl=TTL, limit=2, name="Export", identifier=lambda: None)
    def export():
        return "ran"

    assert export() is None
    assert held[0].release() is True
    assert export() == "ran"
    assert held[1].release() is True


# -- asyncio and the cluster -------------------------------------------------------------


def test_async_locks_count_too(core, redis_server, raw):
    cls = type("AsyncLocks", (AsyncLocks,), {"_core": core})
    prefix = f"counting-aio-{twin_name(core)}"

    async def main():
        async with cls(redis_server.url, prefix=prefix) as locks:
            key = name(locks, "aio")
            # Tasks at once, pipelined on one connection: exactly three get a slot.
            leases = await asyncio.gather(*(locks.acquire(key, TTL, limit=3) for _ in range(5)))
            granted = [lease for lease in leases if lease is not None]
            assert len(granted) == 3
            assert 25 < await granted[0].remaining() <= TTL
            assert await granted[0].extend(60) is True
            assert await locks.release_many(granted) == [True] * 3
            batch = await locks.acquire_many([key] * 4, TTL, limit=3, fence=True)
            assert batch[3] is None and 1 <= batch[0].fence < batch[1].fence < batch[2].fence
            with pytest.raises(joblock.LimitMismatchError):
                await locks.acquire(key, TTL, limit=4)
            for plain in (locks.acquire(key, TTL), locks.acquire(key, TTL, wait=1)):
                with pytest.raises(joblock.LimitMismatchError, match="not a plain lock"):
                    await plain
            with pytest.raises(joblock.BatchError) as failed:
                await locks.acquire_many([name(locks, "aio-fresh"), key], TTL)
            assert type(failed.value.__cause__) is joblock.LimitMismatchError
            waited = await locks.acquire(key, TTL, limit=3, wait=0.05)
            assert waited is None
            assert await locks.release_many(batch) == [True, True, True, False]

    asyncio.run(main())
    assert list(raw.scan_iter(f"{prefix}:*")) == []


def test_cluster_locks_count_on_every_primary(core, cluster, cluster_raw, one_key_per_slot):
    cls = type("ClusterLocks", (joblock.ClusterLocks,), {"_core": core})
    with cls(cluster.url, prefix="counting-cluster") as locks:
        keys = [f"counting-cluster:{k}" for k in one_key_per_slot[:3]]
        leases = locks.acquire_many([k for k in keys for _ in range(3)], TTL, limit=2, fence=True)
        assert [lease is not None for lease in leases] == [True, True, False] * 3
        one = locks.acquire(keys[0], TTL, limit=2)
        assert one is None
        with pytest.raises(joblock.LimitMismatchError, match="limit=2, not a plain lock"):
            locks.acquire(keys[0], TTL)
        with pytest.raises(joblock.BatchError) as failed:
            locks.acquire_many(keys, TTL)
        assert type(failed.value.__cause__) is joblock.LimitMismatchError
        assert locks.release_many(leases) == [lease is not None for lease in leases]
        single = locks.acquire(keys[1], TTL, limit=2)
        assert single.remaining() > 25
        assert single.extend(60) is True
        assert single.release() is True
        for key in keys:
            assert cluster_raw.exists(key) == 0
