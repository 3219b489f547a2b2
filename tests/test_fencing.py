"""Fencing numbers from one counter per hash slot (docs/keys.md), on every twin and real
servers: the counter keys stay bounded however many keys are fenced, each lock's numbers
strictly increase across release, expiry, a restart from the AOF and a failover with
min_replicas, and the per-key counters of earlier releases are folded in (no number goes
back)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from conftest import locks_class
from helpers import name, names, stored, wait_expired
from joblock._slot_tags import COUNTER
from joblock._tools.servers import RedisServer
from joblock.aio import AsyncLocks
from joblock.cluster import ClusterLocks
from test_replicas import NO_DELAY, in_sync, wait_until

COUNTERS = COUNTER.split(b"{")[0] + b"*"  # the SCAN pattern of every slot's counter


def legacy_counter(key: str) -> str:
    """Where releases before the slot counters kept ``key``'s fencing counter."""
    start = key.find("{")
    if start >= 0 and key.find("}", start + 1) > start + 1:
        return key + ":fence"
    return "{" + key + "}:fence"


def test_counter_keys_stay_one_per_hash_slot_however_many_keys_are_fenced(locks, raw, core):
    keys = names(locks, 20_000)
    leases = locks.acquire_many(keys, 30, fence=True)
    assert all(leases)
    assert all(locks.release_many(leases))
    slots = {key_slot(key.encode()) for key in keys}
    counters = {core.fence_key(key.encode()) for key in keys}
    assert len(counters) == len(slots) < len(keys)
    assert all(key_slot(core.fence_key(key.encode())) == key_slot(key.encode()) for key in keys)
    assert raw.exists(*counters) == len(counters)
    assert stored(raw, locks) == []  # no key of its own left behind by any fenced lock
    assert len(list(raw.scan_iter(match=COUNTERS, count=1000))) <= 16_384


def test_the_twins_name_the_same_counter_in_the_keys_slot(one_key_per_slot):
    from conftest import TWINS

    for slot, key in enumerate(one_key_per_slot):
        counters = {core.fence_key(key.encode()) for core in TWINS.values()}
        assert len(counters) == 1
        assert key_slot(counters.pop()) == slot


def test_a_keys_numbers_strictly_increase_while_its_slot_is_shared(locks, raw):
    """Other keys of the same slot (one hash tag) draw from the same counter: a key's
    numbers still only grow, across release and expiry."""
    key, others = name(locks, "{shared}:a"), [name(locks, f"{{shared}}:b{i}") for i in range(5)]
    fences = []
    for _ in range(3):
        lease = locks.acquire(key, 5, fence=True)
        fences.append(lease.fence)
        assert lease.release() is True
        taken = locks.acquire_many(others, 5, fence=True)
        assert min(other.fence for other in taken) > fences[-1]
        assert all(locks.release_many(taken))
    expiring = locks.acquire(key, 0.1, fence=True)
    fences.append(expiring.fence)
    wait_expired(raw, key)
    fences.append(locks.acquire(key, 5, fence=True).fence)
    assert fences == sorted(set(fences))


def test_a_retried_fenced_acquire_gets_its_own_number_back(locks, raw):
    """The number is kept with the lock ("<token>#<number>"), as the counter moves on with
    other keys: the retry after a lost reply finds it there."""
    from joblock._scripts import FENCED_ACQUIRE_SHA

    key = name(locks, "{again}:a")
    lease = locks.acquire(key, 5, fence=True)
    assert raw.get(key) == lease.token == lease.token.split(b"#")[0] + b"#%d" % lease.fence
    assert locks.acquire(name(locks, "{again}:b"), 5, fence=True).fence > lease.fence
    counter = locks._core.fence_key(key.encode())
    token = lease.token.split(b"#")[0]
    assert raw.evalsha(FENCED_ACQUIRE_SHA, 2, key, counter, token, 5000) == lease.fence
    assert lease.extend(5) is True and lease.release() is True


@pytest.mark.parametrize("form", ["single", "batch", "counting", "waiting"])
@pytest.mark.parametrize("tagged", [False, True])
def test_a_per_key_counter_of_an_earlier_release_is_folded_in(locks, make_locks, raw, form, tagged):
    """A lock fenced by an earlier release's per-key counter (here at 1000) goes on above
    it when the slot's counter takes over, and the old key goes."""
    key = name(locks, "{old}:a" if tagged else "old")
    raw.set(legacy_counter(key), 1000)
    if form == "single":
        lease = locks.acquire(key, 5, fence=True)
    elif form == "batch":
        lease = locks.acquire_many([key], 5, fence=True)[0]
    elif form == "counting":
        lease = locks.acquire(key, 5, fence=True, limit=2)
    else:
        holder = locks.acquire(key, 5)
        got: list[Any] = []
        other = make_locks()
        waiter = threading.Thread(target=lambda: got.append(other.acquire(key, 5, wait=10, fence=True)))
        waiter.start()
        queue = legacy_counter(key).replace(":fence", ":waiters")
        wait_until(lambda: raw.llen(queue) == 1, "the waiter to queue")
        assert holder.release() is True  # hands the lock over: the counter comes from the waiter's entry
        waiter.join(10)
        lease = got[0]
    assert lease.fence > 1000  # above the old counter, whatever the slot's was
    assert raw.exists(legacy_counter(key)) == 0
    assert lease.release() is True
    assert locks.acquire(key, 5, fence=True).fence > lease.fence


def test_a_slot_counter_ahead_of_the_old_one_is_kept(locks, raw):
    key = name(locks, "{ahead}:a")
    first = locks.acquire(name(locks, "{ahead}:b"), 5, fence=True).fence
    raw.set(legacy_counter(key), max(first - 1, 0))
    assert locks.acquire(key, 5, fence=True).fence == first + 1
    assert raw.exists(legacy_counter(key)) == 0


def test_async_locks_fence_from_the_slot_counter(core, redis_server, raw):
    async def run() -> list[int]:
        locks = type("AsyncLocks", (AsyncLocks,), {"_core": core})(redis_server.url, prefix="fa")
        try:
            key = "fa:{async}:a"
            raw.set(legacy_counter(key), 500)
            fences = []
            for _ in range(3):
                lease = await locks.acquire(key, 5, fence=True)
                fences.append(lease.fence)
                assert await lease.release() is True
            many = await locks.acquire_many([f"fa:{{async}}:b{i}" for i in range(50)], 5, fence=True)
            assert min(lease.fence for lease in many) > fences[-1]
            assert all(await locks.release_many(many))
            return fences
        finally:
            await locks.close()

    fences = asyncio.run(run())
    assert fences[0] > 500 and fences == sorted(set(fences))
    assert raw.exists(legacy_counter("fa:{async}:a")) == 0


# -- restart from the AOF and failover -----------------------------------------------------------

KEYS = ["fx:plain", "fx:{tag}:a", "fx:{tag}:b", *[f"fx:k{i}" for i in range(200)]]


def take_all(locks: Any, last: dict[str, int], ttl: float, release: bool) -> None:
    """Every key of KEYS fenced once more (alone and in a batch): each number above the
    key's last one."""
    single = locks.acquire(KEYS[0], ttl, fence=True)
    batch = locks.acquire_many(KEYS[1:], ttl, fence=True)
    for lease in [single, *batch]:
        key = lease.key if isinstance(lease.key, str) else lease.key.decode()
        assert lease.fence > last.get(key, 0), key
        last[key] = lease.fence
    if release:
        assert all(locks.release_many([single, *batch]))


def test_numbers_strictly_increase_across_restarts_from_the_aof(core):
    aof = ("--appendonly", "yes", "--appendfsync", "always")
    last: dict[str, int] = {}
    with RedisServer(*aof) as server:
        raw = redis.Redis(unix_socket_path=server.unixsocket)
        for _ in range(3):
            wait_expired(raw, *KEYS)  # those held when the server died, restored from the AOF
            locks = locks_class(core)(server.url, prefix="fx")
            take_all(locks, last, 30, release=True)
            take_all(locks, last, 0.2, release=False)  # these expire
            wait_expired(raw, *KEYS)
            take_all(locks, last, 1, release=False)  # held when the server dies
            locks.close()
            server.kill()  # SIGKILL: only the AOF is left
            server.start()
        assert len(last) == len(KEYS)
        raw.close()


def test_numbers_strictly_increase_across_a_failover_with_min_replicas(core):
    """Grants confirmed by the replica (min_replicas=1) carry their counters with them:
    on the promoted replica, every key's next number is above the last one."""
    last: dict[str, int] = {}
    with (
        RedisServer(*NO_DELAY) as primary,
        RedisServer(*NO_DELAY, "--replicaof", "127.0.0.1", str(primary.port)) as replica,
    ):
        wait_until(lambda: in_sync(primary), "the replica to sync")
        locks = locks_class(core)(primary.url, prefix="fx", min_replicas=1, replica_timeout=2)
        take_all(locks, last, 30, release=True)
        take_all(locks, last, 0.2, release=False)  # confirmed, then expiring on the replica
        locks.close()
        primary.kill()
        on_replica = redis.Redis(unix_socket_path=replica.unixsocket)
        on_replica.replicaof("NO", "ONE")
        wait_expired(on_replica, *KEYS)
        promoted = locks_class(core)(replica.url, prefix="fx")
        take_all(promoted, last, 30, release=True)
        promoted.close()
        on_replica.close()


# -- Redis Cluster ------------------------------------------------------------------------------


def test_cluster_fenced_locks_stay_in_one_slot(core, cluster, cluster_raw):
    locks = type("ClusterLocks", (ClusterLocks,), {"_core": core})(cluster.url, prefix="fc")
    try:
        keys = [f"fc:{core.__name__}:{i}" for i in range(500)]
        cluster_raw.set(legacy_counter(keys[0]), 700)
        first = locks.acquire_many(keys, 10, fence=True)
        assert first[0].fence > 700 and not cluster_raw.exists(legacy_counter(keys[0]))
        assert all(locks.release_many(first))
        again = locks.acquire_many(keys, 10, fence=True)
        assert all(b.fence > a.fence for a, b in zip(first, again))
        for key in keys[:50]:
            assert cluster_raw.keyslot(core.fence_key(key.encode())) == cluster_raw.keyslot(key)
        # A fenced waiter is handed the lock by its holder's release, which counts in the
        # slot of the counter named in the waiter's entry.
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(locks.acquire(keys[0], 10, wait=10, fence=True)))
        waiter.start()
        queue = legacy_counter(keys[0]).replace(":fence", ":waiters")
        wait_until(lambda: cluster_raw.llen(queue) == 1, "the waiter to queue")
        assert again[0].release() is True
        waiter.join(10)
        assert got[0].fence > again[0].fence
        assert all(locks.release_many([got[0], *again[1:]]))
    finally:
        locks.close()
