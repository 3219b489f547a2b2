"""AsyncClusterLocks and AsyncRedlock on the same real cluster and servers as their sync twins.

The cluster is started by ``test_cluster``'s fixtures (3 primaries, 3 replicas); slots
are migrated by hand mid-batch and a primary is killed; Redlock runs over 3 and 5 real
servers with one of them down. Every test runs on each twin of the core.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis

import joblock
from helpers import assert_counted_once
from joblock._engine import waits
from joblock._tools.servers import LocalCluster
from joblock.aio import AsyncClusterLocks, AsyncRedlock
from joblock.redlock import RedlockLease
from rig.migration import Migration
from test_aio import run_on
from test_cluster import bus_publishes, cluster_class, shard_channels

_prefixes = itertools.count()


def run(coro: Any) -> Any:
    return run_on(coro, asyncio.new_event_loop)


def async_cluster_class(core: ModuleType) -> type[AsyncClusterLocks]:
    return type("AsyncClusterLocks", (AsyncClusterLocks,), {"_core": core})


def async_redlock_class(core: ModuleType) -> type[AsyncRedlock]:
    return type("AsyncRedlock", (AsyncRedlock,), {"_core": core})


@pytest.fixture
def prefix() -> str:
    return f"ac{next(_prefixes)}"


# -- Redis Cluster -----------------------------------------------------------------------------


def test_single_locks_fences_and_topology(core, cluster, cluster_raw, prefix):
    async def main():
        locks = async_cluster_class(core)(cluster.nodes[4].url, prefix=prefix)
        assert await locks.nodes() == sorted(f"127.0.0.1:{n.port}" for n in cluster.primaries())
        for key in [locks.key("Job", i) for i in range(12)]:  # spread over the three primaries
            lease = await locks.acquire(key, ttl=10)
            assert lease is not None and cluster_raw.get(key) == lease.token
            assert await locks.acquire(key, ttl=10) is None
            assert await lease.extend(20) is True and cluster_raw.pttl(key) > 15000
            assert 15 < await lease.remaining() <= 20
            assert await lease.release() is True and cluster_raw.get(key) is None
        fences = []
        for _ in range(3):
            lease = await locks.acquire(locks.key("Fenced"), ttl=10, fence=True)
            fences.append(lease.fence)
            assert await lease.release() is True
        assert fences == sorted(set(fences))  # strictly increasing
        async with locks.lock(locks.key("With"), ttl=5):
            with pytest.raises(joblock.LockNotAcquired):
                async with locks.lock(locks.key("With"), ttl=5):
                    pass
        await locks.close()

    run(main())


def test_batches_across_all_slots(core, cluster, cluster_raw, one_key_per_slot, prefix):
    async def main():
        locks = async_cluster_class(core)(cluster.url, prefix=prefix, window=700)
        keys = [f"{prefix}:{{{k}}}" for k in one_key_per_slot]
        leases = await locks.acquire_many(iter([*keys, keys[5]]), ttl=30)
        assert leases[-1] is None and all(lease.key == key for lease, key in zip(leases, keys))
        pipe = cluster_raw.pipeline()
        for key in keys:
            pipe.get(key)
        assert pipe.execute() == [lease.token for lease in leases[:-1]]
        assert await locks.extend_many(leases, ttl=60) == [True] * len(keys) + [False]
        assert await locks.release_many(leases) == [True] * len(keys) + [False]
        deduped = await locks.dedupe("ProductSalesJob", [(i % 50,) for i in range(100)], ttl=10)
        assert [lease is not None for lease in deduped] == [True] * 50 + [False] * 50
        assert sum(await locks.release_many(deduped)) == 50
        await locks.close()

    run(main())


def test_hand_offs_and_a_moved_slot_by_sharded_pub_sub(core, cluster, prefix):
    # The asyncio twin of test_cluster.py's sharded tests: hand-offs on the key's slot's
    # channel, none over the cluster bus, and a waiter parked while its slot moves is
    # woken on the new primary.
    key = f"{{await-shard-{prefix}}}:job"
    slot = core.key_slot(key.encode())
    channel = waits.tagged(key.encode(), b"")

    async def listening_on(node):
        for _ in range(500):
            if [c for c in shard_channels(cluster, node) if c.endswith(b":" + channel)]:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"no sharded channel for {key} on port {node.port}")

    async def main():
        holder = async_cluster_class(core)(cluster.url, prefix=prefix)
        waiter = async_cluster_class(core)(cluster.url, prefix=prefix)
        before = bus_publishes(cluster)
        lease = await holder.acquire(key, ttl=30)
        asyncio.get_running_loop().call_later(0.1, lambda: asyncio.ensure_future(lease.release()))
        got = await waiter.acquire(key, ttl=30, wait=8)  # shorter than its own re-check
        assert got is not None and await got.release() is True
        lease = await holder.acquire(key, ttl=30)
        task = asyncio.ensure_future(waiter.acquire(key, ttl=30, wait=8))
        await listening_on(cluster.primary_of(slot))
        migration = Migration(cluster, slot)
        await asyncio.to_thread(migration.begin)
        await asyncio.to_thread(migration.finish)
        await listening_on(migration.target)
        assert await lease.release() is True
        got = await task
        assert got is not None and await got.release() is True
        assert bus_publishes(cluster) == before
        await holder.close()
        await waiter.close()

    run(main())


def test_a_waiting_acquire_rides_through_a_migration(core, cluster, prefix):
    # ASK and TRYAGAIN while the slot moves: the waiter pauses and starts over (as
    # test_cluster.py's twin of this test shows for ClusterLocks).
    key = f"{{await-try-{prefix}}}:job"
    migration = Migration(cluster, core.key_slot(key.encode()))

    async def main():
        locks = async_cluster_class(core)(cluster.url, prefix=prefix)
        first = await locks.acquire(key, ttl=30, fence=True)
        assert first is not None and await first.release() is True
        migration.begin()
        later = threading.Timer(0.3, migration.finish)
        later.start()
        lease = await locks.acquire(key, ttl=30, wait=20, fence=True)
        later.join()
        assert lease is not None and lease.fence > first.fence
        assert locks.redirects["ASK"] + locks.redirects["TRYAGAIN"] > 0
        assert await lease.release() is True
        await locks.close()

    try:
        run(main())
    finally:
        if cluster.primary_of(migration.slot) is not migration.target:
            migration.finish()


@pytest.mark.parametrize("fence", [False, True])
def test_slot_migrated_while_a_batch_runs(core, cluster, cluster_raw, prefix, fence):
    tag = f"{{amig-{prefix}-{fence}}}"
    slot = core.key_slot(tag[1:-1].encode())
    migration = Migration(cluster, slot)
    finisher = threading.Timer(0.5, migration.finish)

    async def main():
        locks = async_cluster_class(core)(cluster.url, prefix=prefix, window=250)
        keys = [f"{tag}:{i}" if i % 2 else locks.key("Other", i) for i in range(6000)]

        def feed() -> Iterator[str]:
            for i, key in enumerate(keys):
                if i == 1500:
                    migration.begin()
                    migration.move_all(limit=300)
                    finisher.start()
                elif i == 4500:
                    finisher.join()
                yield key

        leases = await locks.acquire_many(feed(), ttl=60, fence=fence)
        # A fenced grant meets ASK, or TRYAGAIN while its slot's counter is still on the source.
        moving = locks.redirects["ASK"] + (locks.redirects["TRYAGAIN"] if fence else 0)
        assert moving > 0 and locks.redirects["MOVED"] > 0, locks.redirects
        assert all(lease is not None and lease.key == key for lease, key in zip(leases, keys))
        if fence:
            assert_counted_once(leases)
        pipe = cluster_raw.pipeline()
        for key in keys:
            pipe.get(key)
        assert pipe.execute() == [lease.token for lease in leases]
        assert await locks.release_many(leases) == [True] * len(keys)
        await locks.close()

    try:
        run(main())
    finally:
        if finisher.is_alive() or not finisher.finished.is_set():
            finisher.cancel()
            migration.finish()
        finisher.join()
    assert cluster.primary_of(slot) is migration.target


def test_a_killed_primary_fails_over(core, one_key_per_slot):
    with LocalCluster(primaries=3, replicas=1) as cluster:
        cluster.wait_replicated()

        async def main():
            locks = async_cluster_class(core)(cluster.url, prefix="af", window=500)
            keys = [f"held:{{{k}}}" for k in one_key_per_slot[::4]]
            fresh = [f"new:{{{k}}}" for k in one_key_per_slot[1::4]]
            leases = await locks.acquire_many(keys, ttl=120)
            assert all(lease is not None for lease in leases)
            for primary in cluster.primaries():
                assert cluster.call(primary, "WAIT", 1, 5000) == 1
            cluster.wait_caught_up()  # the replicas have every lock
            victim = cluster.primary_of(0)
            victim.kill()
            started = time.monotonic()
            got = await locks.acquire_many(fresh, ttl=120)  # rides through the failover
            assert all(lease is not None and lease.key == key for lease, key in zip(got, fresh))
            assert time.monotonic() - started < 30
            assert locks.redirects["unreachable"] > 0
            assert await locks.acquire(fresh[0], ttl=5) is None
            assert await locks.acquire_many(keys, ttl=5) == [None] * len(keys)
            assert await locks.release_many(leases) == [True] * len(keys)
            assert await locks.release_many(got) == [True] * len(fresh)
            await locks.close()

        run(main())


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_slow_primary_delays_only_its_own_keys(core, prefix, flavour):
    """One primary stops answering mid-batch: the others go on through many windows meanwhile.

    With a barrier between nodes (each window waiting for every node), the other primaries
    could take no more than the two windows in flight before the stopped one answers.
    """
    window, n = 100, 3000
    # A long node timeout: the other nodes must not call the cluster down meanwhile.
    with LocalCluster(primaries=3, replicas=0, node_timeout_ms=60_000) as cluster:
        node_raw = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        cls = cluster_class(core) if flavour == "sync" else async_cluster_class(core)
        locks: Any = cls(cluster.url, prefix=prefix, window=window, socket_timeout=20)
        if flavour == "sync":  # the slot map is read before the node stops
            locks.nodes()
        else:
            run(locks.nodes())
        slow = cluster.primaries()[0]
        keys = [locks.key("Spread", i) for i in range(n)]
        elsewhere = [k for k in keys if cluster.primary_of(core.key_slot(k.encode())) is not slow]
        taken: list[int] = []

        def resume_once_the_others_went_on() -> None:
            deadline = time.monotonic() + 15
            count = 0
            while time.monotonic() < deadline:
                count = sum(node_raw.exists(*elsewhere[i : i + 500]) for i in range(0, len(elsewhere), 500))
                if count >= 4 * window:
                    break
                time.sleep(0.01)
            taken.append(count)
            os.kill(slow.process.pid, signal.SIGCONT)

        async def in_a_loop() -> list[Any]:
            try:
                return await locks.acquire_many(keys, ttl=30)  # type: ignore[no-any-return]
            finally:
                await locks.close()

        os.kill(slow.process.pid, signal.SIGSTOP)
        watcher = threading.Thread(target=resume_once_the_others_went_on)
        try:
            watcher.start()
            leases = locks.acquire_many(keys, ttl=30) if flavour == "sync" else run(in_a_loop())
            watcher.join()
        finally:
            os.kill(slow.process.pid, signal.SIGCONT)
            node_raw.close()
        assert taken[0] >= 4 * window  # while the slow node said nothing
        assert all(lease is not None and lease.key == key for lease, key in zip(leases, keys))


# -- Redlock -------------------------------------------------------------------------------


def test_redlock_sets_the_same_token_everywhere(core, servers, prefix):
    clients = [redis.Redis.from_url(s.url) for s in servers]

    async def main():
        rl = async_redlock_class(core)([s.url for s in servers], prefix=prefix)
        assert rl.quorum == 3
        key = rl.key("Job")
        lease = await rl.acquire(key, ttl=10)
        assert isinstance(lease, RedlockLease) and 0 < lease.validity <= 10
        assert [c.get(key) for c in clients] == [lease.token] * 5
        assert await rl.acquire(key, ttl=10) is None
        assert await lease.extend(20) is True and all(c.pttl(key) > 15000 for c in clients)
        assert await lease.release() is True and await lease.release() is False
        assert [c.get(key) for c in clients] == [None] * 5
        async with rl.lock(key, ttl=5) as held:
            with pytest.raises(TypeError, match="async with"):
                held.__exit__(None, None, None)
        keys = [f"{key}:{i}" for i in range(2500)]
        leases = await rl.acquire_many(keys, ttl=10)
        assert all(lease is not None and lease.key == k for lease, k in zip(leases, keys))
        assert await rl.extend_many(leases, ttl=20) == [True] * len(keys)
        assert await rl.release_many(leases) == [True] * len(keys)
        deduped = await rl.dedupe("J", [(i % 3,) for i in range(9)], ttl=10)
        assert [lease is not None for lease in deduped] == [True] * 3 + [False] * 6
        assert sum(await rl.release_many(deduped)) == 3
        await rl.close()

    try:
        run(main())
    finally:
        for client in clients:
            client.close()


def test_redlock_with_a_server_down_and_with_a_quorum_out_of_reach(core, servers, down_url, prefix):
    first = redis.Redis.from_url(servers[0].url)

    async def main():
        rl = async_redlock_class(core)([s.url for s in servers[:2]] + [down_url], prefix=prefix, retries=1)
        key = rl.key("Down")
        async with rl.lock(key, ttl=5) as lease:
            assert first.get(key) == lease.token
            assert await lease.extend(20) is True
        leases = await rl.acquire_many([f"{key}:{i}" for i in range(50)], ttl=5)
        assert all(lease is not None for lease in leases)
        assert await rl.release_many(leases) == [True] * 50
        await rl.close()
        out = async_redlock_class(core)([servers[0].url, down_url, down_url], prefix=prefix, retries=1)
        with pytest.raises(joblock.ConnectionError, match="only 1 of 3 servers reachable, 2 needed"):
            await out.acquire(key, ttl=5)
        assert first.get(key) is None  # released on the one that granted it
        with pytest.raises(joblock.BatchConnectionError):
            await out.acquire_many([key, key + "x"], ttl=5)
        assert first.get(key) is None
        await out.close()

    try:
        run(main())
    finally:
        first.close()
