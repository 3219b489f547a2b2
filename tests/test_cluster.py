"""ClusterLocks on a real local Redis Cluster (3 primaries, 3 replicas), on every twin.

The suite starts the cluster itself: six ``redis-server --cluster-enabled yes`` joined
by ``redis-cli --cluster create``. Slots are migrated by hand (CLUSTER SETSLOT and
MIGRATE) in the middle of batches, and a primary is killed so that its replica takes
over while locks are being taken.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

import joblock
from conftest import TWINS
from helpers import assert_counted_once
from joblock._engine import waits
from joblock._engine.waits import queue_key
from joblock._tools import admin
from joblock._tools.servers import LocalCluster, RedisServer, free_port
from joblock.cluster import ClusterLocks
from rig.migration import Migration
from test_acl import LEAST, PASSWORD

_prefixes = itertools.count()
_any_core = TWINS.get("c", TWINS["python"])


@pytest.fixture
def raw(cluster_raw: RedisCluster) -> RedisCluster:
    return cluster_raw


def cluster_class(core: ModuleType) -> type[ClusterLocks]:
    return type("ClusterLocks", (ClusterLocks,), {"_core": core})


@pytest.fixture
def make(core: ModuleType, cluster: LocalCluster) -> Iterator[Callable[..., ClusterLocks]]:
    made: list[ClusterLocks] = []
    prefix = f"c{next(_prefixes)}"

    def build(url: str | None = None, **kwargs: Any) -> ClusterLocks:
        kwargs.setdefault("prefix", prefix)
        locks = cluster_class(core)(url or cluster.url, **kwargs)
        made.append(locks)
        return locks

    yield build
    for locks in made:
        locks.close()


# -- the tests -----------------------------------------------------------------------------


def test_topology(make: Callable[..., ClusterLocks], cluster: LocalCluster) -> None:
    locks = make(cluster.nodes[4].url)  # any node will do as the seed, a replica too
    assert locks.nodes() == sorted(f"127.0.0.1:{n.port}" for n in cluster.primaries())
    assert "ClusterLocks" in repr(locks)


def test_arguments(core: ModuleType, cluster: LocalCluster) -> None:
    with pytest.raises(ValueError, match="only database 0"):
        cluster_class(core)("redis://127.0.0.1:7000/3")
    with pytest.raises(ValueError, match="over TCP"):
        cluster_class(core)("unix:///tmp/x.sock")
    with pytest.raises(ValueError, match="at least one"):
        cluster_class(core)([])
    locks = cluster_class(core)(["redis://127.0.0.1:1/0", cluster.url], connect_timeout=1, retries=0)
    assert len(locks.nodes()) == 3  # the first seed is down: the next one answers
    locks.close()
    nowhere = cluster_class(core)("redis://127.0.0.1:1/0", connect_timeout=1, retries=0)
    with pytest.raises(joblock.ConnectionError, match="CLUSTER SLOTS"):
        nowhere.acquire("k", ttl=1)


def test_single_locks(make: Callable[..., ClusterLocks], raw: RedisCluster) -> None:
    locks = make()
    keys = [locks.key("Job", i) for i in range(12)]  # spread over the three primaries
    for key in keys:
        lease = locks.acquire(key, ttl=10)
        assert lease is not None and raw.get(key) == lease.token
        assert locks.acquire(key, ttl=10) is None
        assert lease.extend(20) is True and raw.pttl(key) > 15000
        left = lease.remaining()
        assert left is not None and 15 < left <= 20
        assert lease.release() is True and raw.get(key) is None
    with locks.lock(keys[0], ttl=5), pytest.raises(joblock.LockNotAcquired), locks.lock(keys[0], ttl=5):
        pass


def test_fence_counter_in_the_lock_slot(
    make: Callable[..., ClusterLocks], raw: RedisCluster, core: ModuleType
) -> None:
    locks = make()
    for key in (locks.key("Fenced", 1), f"{{user7}}:{locks.prefix}", f"{locks.prefix}:a{{b"):
        fences = []
        for _ in range(3):
            lease = locks.acquire(key, ttl=10, fence=True)
            assert lease is not None
            fences.append(lease.fence)
            assert lease.release() is True
        assert fences == sorted(set(fences))  # strictly increasing
        counter = core.fence_key(key.encode())
        assert raw.keyslot(counter) == raw.keyslot(key)
        assert int(raw.get(counter)) >= fences[-1]
    leases = locks.acquire_many([locks.key("F", i) for i in range(300)], ttl=10, fence=True)
    assert all(lease.fence >= 1 for lease in leases)
    assert all(locks.release_many(leases))


def test_batches_across_all_slots(
    make: Callable[..., ClusterLocks], raw: RedisCluster, one_key_per_slot: list[str]
) -> None:
    locks = make(window=700)
    keys = [f"{locks.prefix}:{{{k}}}" for k in one_key_per_slot]
    assert sorted(raw.keyslot(k) for k in keys[:50]) == list(range(50))
    batch = [*keys, keys[5], keys[16000]]
    leases = locks.acquire_many(iter(batch), ttl=30)
    assert len(leases) == len(batch)
    assert leases[-2:] == [None, None]  # a key twice: the first wins
    assert all(lease is not None and lease.key == key for lease, key in zip(leases, keys))
    pipe = raw.pipeline()
    for key in keys:
        pipe.get(key)
    assert pipe.execute() == [lease.token for lease in leases[: len(keys)]]
    # Taken by someone else in between: refused, in place.
    raw.delete(keys[100])
    raw.set(keys[100], b"other", px=10000)
    again = locks.acquire_many(keys, ttl=30)
    assert again == [None] * len(keys)
    extended = locks.extend_many(leases, ttl=60)
    assert extended == [i != 100 and i < len(keys) for i in range(len(batch))]
    assert raw.pttl(keys[9000]) > 50000
    released = locks.release_many(leases)
    assert released == [i < len(keys) and i != 100 for i in range(len(batch))]
    assert raw.get(keys[100]) == b"other"
    assert raw.exists(*keys[:1]) == 0


def test_dedupe(make: Callable[..., ClusterLocks], raw: RedisCluster) -> None:
    locks = make()
    tuples = [(i % 500,) for i in range(1000)]
    leases = locks.dedupe("ProductSalesJob", tuples, ttl=10)
    assert [lease is not None for lease in leases] == [True] * 500 + [False] * 500
    assert leases[7] is not None and raw.get(locks.key("ProductSalesJob", 7)) == leases[7].token
    assert sum(locks.release_many(leases)) == 500


def test_stale_slot_map_follows_moved(make: Callable[..., ClusterLocks], raw: RedisCluster) -> None:
    locks = make()
    locks.nodes()
    # Every slot pointed at the wrong primary: each key meets MOVED once.
    owners = sorted({a for a in locks._topology.slots if a is not None})
    locks._topology.slots = [owners[(owners.index(a) + 1) % 3] if a else a for a in locks._topology.slots]
    keys = [locks.key("Moved", i) for i in range(2000)]
    leases = locks.acquire_many(keys, ttl=10)
    assert all(lease is not None for lease in leases)
    assert raw.get(keys[1234]) == leases[1234].token
    lease = locks.acquire(locks.key("MovedSingle"), ttl=10)
    assert lease is not None and lease.release() is True
    locks._topology.slots = [owners[(owners.index(a) + 2) % 3] if a else a for a in locks._topology.slots]
    assert all(locks.release_many(leases))


def test_no_redirects_left_raises(make: Callable[..., ClusterLocks]) -> None:
    locks = make(max_redirects=0)
    locks.nodes()
    owners = sorted({a for a in locks._topology.slots if a is not None})
    locks._topology.slots = [owners[(owners.index(a) + 1) % 3] if a else a for a in locks._topology.slots]
    with pytest.raises(joblock.ReplyError, match="MOVED"):
        locks.acquire(locks.key("NoRedirects"), ttl=5)
    locks._topology.slots = [owners[(owners.index(a) + 1) % 3] if a else a for a in locks._topology.slots]
    with pytest.raises(joblock.BatchError, match="MOVED"):
        locks.acquire_many([locks.key("NoRedirects", i) for i in range(100)], ttl=5)


def test_ask_during_a_migration(
    make: Callable[..., ClusterLocks], raw: RedisCluster, cluster: LocalCluster, core: ModuleType
) -> None:
    locks = make()
    tag = f"{{ask-{locks.prefix}}}"
    slot = core.key_slot(tag[1:-1].encode())
    held, ours, fresh = (
        [f"{tag}:held{i}" for i in range(6)],
        f"{tag}:ours",
        [f"{tag}:new{i}" for i in range(6)],
    )
    for key in held:
        raw.set(key, b"other", px=60000)
    lease = locks.acquire(ours, ttl=60)
    assert lease is not None
    migration = Migration(cluster, slot)
    migration.begin()
    try:
        migration.move([k.encode() for k in held[:3]] + [ours.encode()])
        # held[:3] and ours now live on the target: the source answers ASK for them.
        got = locks.acquire_many([*held, *fresh], ttl=60)
        assert got[:6] == [None] * 6
        assert locks.redirects["ASK"] >= 9  # held[:3] and the six new keys
        assert all(g is not None for g in got[6:])
        assert migration.on_target("EXISTS", fresh[0]) == 1
        assert lease.extend(30) is True
        assert lease.release() is True
        assert locks.release_many(got) == [False] * 6 + [True] * 6
    finally:
        migration.finish()
    assert cluster.primary_of(slot) is migration.target
    assert locks.acquire(held[0], ttl=5) is None  # MOVED, then still someone else's


def test_tryagain_while_a_lock_and_its_counter_are_split(
    make: Callable[..., ClusterLocks], cluster: LocalCluster, core: ModuleType
) -> None:
    locks = make()
    key = f"{{try-{locks.prefix}}}:job"
    slot = core.key_slot(key.encode())
    first = locks.acquire(key, ttl=30, fence=True)
    assert first is not None and first.release() is True
    migration = Migration(cluster, slot)
    migration.begin()
    try:
        # The counter is on the source, the lock key nowhere: the two-key script gets
        # TRYAGAIN (from the source, then from the target after ASK) until the slot
        # has moved; then MOVED sends it to the target.
        later = threading.Timer(0.3, migration.finish)
        later.start()
        lease = locks.acquire(key, ttl=30, fence=True)
        later.join()
        assert lease is not None and lease.fence > first.fence
        assert locks.redirects["TRYAGAIN"] > 0
        assert lease.release() is True
    finally:
        if cluster.primary_of(slot) is not migration.target:
            migration.finish()


def test_rounds_spent_after_a_lost_node_raise_its_connection_error(
    make: Callable[..., ClusterLocks], cluster: LocalCluster, core: ModuleType
) -> None:
    # Out of rounds on a redirection (here TRYAGAIN: a fenced lock and its counter split
    # by a migration) after a node was lost: the cluster is failing over, as far as the
    # client can tell, and the caller hears the node's ConnectionError, not the reply.
    locks = make(max_redirects=2)
    key = f"{{spent-{locks.prefix}}}:job"
    slot = core.key_slot(key.encode())
    first = locks.acquire(key, ttl=30, fence=True)
    assert first is not None and first.release() is True
    migration = Migration(cluster, slot)
    migration.begin()
    try:
        locks._topology.slots[slot] = ("127.0.0.1", free_port())  # a primary that died
        with pytest.raises(joblock.ConnectionError):
            locks.acquire(key, ttl=30, fence=True)
        assert locks.redirects["unreachable"] >= 1 and locks.redirects["TRYAGAIN"] >= 1
        with pytest.raises(joblock.ReplyError, match=r"TRYAGAIN|ASK"):  # no node lost: the reply
            locks.acquire(key, ttl=30, fence=True)
    finally:
        migration.finish()
    lease = locks.acquire(key, ttl=30, fence=True)
    assert lease is not None and lease.fence > first.fence and lease.release() is True


def test_a_waiting_acquire_rides_through_a_migration(
    make: Callable[..., ClusterLocks], cluster: LocalCluster, core: ModuleType
) -> None:
    # A waiting acquire that meets ASK or TRYAGAIN (or CLUSTERDOWN, during a failover)
    # starts over after a pause, until the slot has moved: without one it spent its
    # rounds at once and raised the reply.
    locks = make()
    key = f"{{wait-try-{locks.prefix}}}:job"
    slot = core.key_slot(key.encode())
    first = locks.acquire(key, ttl=30, fence=True)
    assert first is not None and first.release() is True
    migration = Migration(cluster, slot)
    migration.begin()
    try:
        later = threading.Timer(0.3, migration.finish)
        later.start()
        lease = locks.acquire(key, ttl=30, wait=20, fence=True)
        later.join()
        assert lease is not None and lease.fence > first.fence
        assert locks.redirects["ASK"] + locks.redirects["TRYAGAIN"] > 0
        assert lease.release() is True
    finally:
        if cluster.primary_of(slot) is not migration.target:
            migration.finish()


@pytest.mark.parametrize("form", ["counting", "handed over"])
def test_a_fenced_grant_whose_keys_are_not_all_on_the_node_waits_for_the_migration(
    make: Callable[..., ClusterLocks], cluster: LocalCluster, core: ModuleType, form: str
) -> None:
    """The lock and its slot's counter are on the source, but the per-key counter that an
    earlier release would have kept (not among the script's KEYS) is not: Redis refuses
    the script that touches it, which answers TRYAGAIN until the slot has moved."""
    locks = make()
    key = f"{{mig-{locks.prefix}}}:job"
    slot = core.key_slot(key.encode())
    counting = form == "counting"
    first = locks.acquire(key, ttl=30, fence=True, limit=2 if counting else 1)
    assert first is not None
    got: list[Any] = []

    def wait() -> None:
        try:
            got.append(locks.acquire(key, 30, wait=20, fence=True))
        except joblock.ReplyError as e:
            got.append(e)

    waiter = threading.Thread(target=wait)
    if not counting:  # queued before the migration begins: its queue is on the source
        waiter.start()
        until = time.monotonic() + 10
        while cluster.call(cluster.primary_of(slot), "LLEN", queue_key(key.encode())) != 1:
            assert time.monotonic() < until, "the waiter never queued"
            time.sleep(0.01)
    migration = Migration(cluster, slot)
    migration.begin()
    later = threading.Timer(0.3, migration.finish)
    try:
        if counting:
            later.start()
            lease = locks.acquire(key, ttl=30, fence=True, limit=2)  # a second holder's place
            later.join()
            assert lease is not None and lease.fence > first.fence
            assert locks.redirects["TRYAGAIN"] > 0
            assert locks.release_many([lease, first]) == [True, True]
        else:
            # The release hands the lock to nobody (the waiter is told to look again) and
            # deletes it, rather than failing.
            assert first.release() is True
            later.start()
            later.join()
            waiter.join(30)
            # Its next look meets the migration: it pauses at each redirection until
            # the slot has moved, and takes the lock there.
            assert got[0] is not None and not isinstance(got[0], joblock.ReplyError), got[0]
            assert got[0].fence > first.fence and got[0].release() is True
    finally:
        if cluster.primary_of(slot) is not migration.target:
            migration.finish()


@pytest.mark.parametrize("fence", [False, True])
def test_slot_migrated_while_a_batch_runs(
    make: Callable[..., ClusterLocks], raw: RedisCluster, cluster: LocalCluster, core: ModuleType, fence: bool
) -> None:
    locks = make(window=250)
    tag = f"{{mig-{locks.prefix}-{fence}}}"
    slot = core.key_slot(tag[1:-1].encode())
    migration = Migration(cluster, slot)
    keys = [f"{tag}:{i}" if i % 2 else locks.key("Other", i) for i in range(6000)]

    finisher = threading.Timer(0.5, migration.finish)

    def feed() -> Iterator[str]:
        # Windows go out one after another: the slot starts moving between two of them
        # and the move ends while later ones are in flight. (A fenced acquire of a new
        # key in a slot being imported gets TRYAGAIN until then: two keys, not both there.)
        for i, key in enumerate(keys):
            if i == 1500:
                migration.begin()
                migration.move_all(limit=300)
                finisher.start()
            elif i == 4500:
                finisher.join()
            yield key

    try:
        leases = locks.acquire_many(feed(), ttl=60, fence=fence)
    finally:
        if finisher.is_alive() or not finisher.finished.is_set():
            finisher.cancel()
            migration.finish()
        finisher.join()
    assert cluster.primary_of(slot) is migration.target
    # A fenced grant meets ASK, or TRYAGAIN while its slot's counter is still on the source.
    moving = locks.redirects["ASK"] + (locks.redirects["TRYAGAIN"] if fence else 0)
    assert moving > 0 and locks.redirects["MOVED"] > 0, locks.redirects
    assert all(lease is not None and lease.key == key for lease, key in zip(leases, keys))
    if fence:
        assert_counted_once(leases)
    pipe = raw.pipeline()
    for key in keys:
        pipe.get(key)
    assert pipe.execute() == [lease.token for lease in leases]
    assert locks.acquire_many(keys[:500], ttl=5) == [None] * 500
    assert locks.release_many(leases) == [True] * len(keys)
    assert raw.exists(*keys[1:2]) == 0


def test_inspect_scans_every_primary(
    make: Callable[..., ClusterLocks], cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    locks = make()
    keys = [locks.key("Inspected", i) for i in range(30)]
    leases = locks.acquire_many(keys, ttl=30, fence=True)
    assert len({locks._topology.slots[_any_core.key_slot(k.encode())] for k in keys}) == 3
    assert admin.inspect(cluster.nodes[5].url, locks.prefix, "*") == 0
    out = capsys.readouterr().out
    assert all(key in out for key in keys)
    assert "30 locks held" in out
    # `joblock release` finds the primary of the key's slot, whichever node it is given.
    assert admin.release(cluster.nodes[0].url, keys[0]) == 0
    assert admin.release(cluster.nodes[1].url, keys[1]) == 0
    assert "released" in capsys.readouterr().out
    assert locks.release_many(leases) == [False, False] + [True] * 28


def test_a_killed_primary_fails_over(core: ModuleType, one_key_per_slot: list[str]) -> None:
    with LocalCluster(primaries=3, replicas=1) as cluster:
        cluster.wait_replicated()
        raw = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        locks = cluster_class(core)(cluster.url, prefix="f", window=500)
        try:
            keys = [f"held:{{{k}}}" for k in one_key_per_slot[::4]]
            fresh = [f"new:{{{k}}}" for k in one_key_per_slot[1::4]]
            leases = locks.acquire_many(keys, ttl=120)
            assert all(lease is not None for lease in leases)
            for primary in cluster.primaries():
                assert cluster.call(primary, "WAIT", 1, 5000) == 1
            cluster.wait_caught_up()  # the replicas have every lock
            victim = cluster.primary_of(0)
            replica = next(
                n for n in cluster.nodes if n is not victim and cluster.call(n, "ROLE")[0] == b"slave"
                and int(cluster.call(n, "ROLE")[2]) == victim.port
            )  # fmt: skip
            victim.kill()
            started = time.monotonic()
            # No waiting for the failover: the client rides through it.
            got = locks.acquire_many(fresh, ttl=120)
            assert all(lease is not None and lease.key == key for lease, key in zip(got, fresh))
            assert time.monotonic() - started < 30
            assert locks.redirects["unreachable"] > 0
            assert cluster.call(replica, "ROLE")[0] == b"master"
            cluster.wait_ok()  # the other nodes learn of the promotion by gossip, a moment later
            assert cluster.primary_of(0) is replica
            single = locks.acquire(fresh[0], ttl=5)
            assert single is None
            assert locks.acquire_many(keys, ttl=5) == [None] * len(keys)  # replicated before the kill
            assert locks.release_many(leases) == [True] * len(keys)
            assert locks.release_many(got) == [True] * len(fresh)
            assert raw.get(keys[0]) is None
        finally:
            locks.close()
            raw.close()


def test_a_server_that_is_no_cluster(core: ModuleType) -> None:
    with RedisServer() as server:
        locks = cluster_class(core)(server.url)
        with pytest.raises(joblock.ConnectionError, match="CLUSTER SLOTS"):
            locks.acquire("k", ttl=1)
        locks.close()


def test_redis_py_sees_the_same_slots(raw: RedisCluster, one_key_per_slot: list[str]) -> None:
    for slot in range(0, 16384, 97):
        assert raw.keyslot(one_key_per_slot[slot]) == slot
    assert isinstance(raw, redis.RedisCluster)


# -- waiting: the queue and the wake-up subscription live on the key's primary ---------------


def test_a_waiter_is_handed_the_lock_on_its_primary(make: Callable[..., ClusterLocks]) -> None:
    holder, waiter = make(), make()
    keys = [holder.key("Wait", i) for i in range(3)]  # different slots, likely different primaries
    for key in keys:
        lease = holder.acquire(key, ttl=30)
        assert lease is not None
        threading.Timer(0.2, lease.release).start()
        started = time.monotonic()
        got = waiter.acquire(key, ttl=30, wait=20, fence=True)
        assert got is not None and got.fence is not None
        assert time.monotonic() - started < 10  # handed over, not found at the wait's end
        assert got.release() is True


def test_a_waiter_with_a_stale_slot_map_starts_over_on_the_right_primary(
    make: Callable[..., ClusterLocks],
) -> None:
    holder, waiter = make(), make()
    waiter.nodes()
    owners = sorted({a for a in waiter._topology.slots if a is not None})
    waiter._topology.slots = [owners[(owners.index(a) + 1) % 3] if a else a for a in waiter._topology.slots]
    key = holder.key("WaitMoved")
    lease = holder.acquire(key, ttl=30)
    assert lease is not None
    threading.Timer(0.2, lease.release).start()
    got = waiter.acquire(key, ttl=30, wait=20, fair=True)
    assert got is not None and waiter.redirects["MOVED"] >= 1
    assert got.release() is True


# -- sharded pub/sub: wake-ups stay on the slot's shard ------------------------------------


def bus_publishes(cluster: LocalCluster) -> int:
    """Classic PUBLISH messages the nodes sent each other over the cluster bus."""
    total = 0
    for node in cluster.alive():
        for line in cluster.call(node, "CLUSTER", "INFO").splitlines():
            if line.startswith(b"cluster_stats_messages_publish_sent:"):
                total += int(line.split(b":")[1])
    return total


def spublished(cluster: LocalCluster) -> int:
    """The SPUBLISH commands the primaries ran (the scripts' included)."""
    total = 0
    for node in cluster.primaries():
        for line in cluster.call(node, "INFO", "commandstats").splitlines():
            if line.startswith(b"cmdstat_spublish:"):
                total += int(line.split(b"calls=")[1].split(b",")[0])
    return total


def shard_channels(cluster: LocalCluster, node: RedisServer) -> list[bytes]:
    return list(cluster.call(node, "PUBSUB", "SHARDCHANNELS", "joblock:wake:*"))


def test_hand_offs_go_by_sharded_pub_sub_on_the_key_s_primary(
    make: Callable[..., ClusterLocks], cluster: LocalCluster, core: ModuleType
) -> None:
    holder, waiter = make(), make()
    keys = [holder.key("Shard", i) for i in range(6)]  # slots on every primary, likely
    before = bus_publishes(cluster)
    for key in keys:
        lease = holder.acquire(key, ttl=30)
        assert lease is not None
        threading.Timer(0.1, lease.release).start()
        # A wait shorter than the waiter's own re-check (its ttl, 30 s, and SAFETY, 10 s):
        # only the release's message can end it with the lock.
        got = waiter.acquire(key, ttl=30, wait=8)
        assert got is not None and got.release() is True
        # The waiter's client listens on a channel of the key's slot, on its primary.
        primary = cluster.primary_of(core.key_slot(key.encode()))
        channel = waits.tagged(key.encode(), b"")
        assert [c for c in shard_channels(cluster, primary) if c.endswith(b":" + channel)]

    # Contended: threads of two clients take turns at three keys, locks handed over.
    def take_turns(locks: ClusterLocks) -> None:
        for n in range(20):
            got = locks.acquire(keys[n % 3], ttl=30, wait=8)
            assert got is not None and got.release() is True

    published = spublished(cluster)
    threads = [threading.Thread(target=take_turns, args=(c,)) for c in (holder, waiter) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert spublished(cluster) > published
    # Nothing a hand-off said went to every node, and no classic subscription was made.
    assert bus_publishes(cluster) == before
    for node in cluster.primaries():
        assert cluster.call(node, "PUBSUB", "CHANNELS", "joblock:*") == []


def test_a_slot_moved_under_its_waiter_loses_no_wake_up(
    make: Callable[..., ClusterLocks], cluster: LocalCluster, core: ModuleType
) -> None:
    # The slot moves while the waiter is parked: the old primary ends its sharded channel
    # (SUNSUBSCRIBE), the waiter looks again, meets MOVED and queues and listens on the new
    # primary, where the holder's release then hands it the lock.
    holder, waiter = make(), make()
    key = holder.key("ShardMoved")
    slot = core.key_slot(key.encode())
    lease = holder.acquire(key, ttl=30)
    assert lease is not None
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(key, ttl=30, wait=8)))
    thread.start()
    source = cluster.primary_of(slot)
    deadline = time.monotonic() + 5
    while not [c for c in shard_channels(cluster, source) if c.endswith(waits.tagged(key.encode(), b""))]:
        assert time.monotonic() < deadline, "the waiter never listened on the key's primary"
        time.sleep(0.01)
    migration = Migration(cluster, slot)
    migration.begin()
    migration.finish()
    target = migration.target
    deadline = time.monotonic() + 5
    while not [c for c in shard_channels(cluster, target) if c.endswith(waits.tagged(key.encode(), b""))]:
        assert time.monotonic() < deadline, "the waiter did not listen on the new primary"
        time.sleep(0.01)
    assert lease.release() is True
    thread.join()
    # Within its wait, shorter than its own re-check: the release's message woke it.
    assert got[0] is not None and got[0].release() is True


# docs/security.md's least-privilege user, on a Cluster with sharded pub/sub: no PUBLISH
# or SUBSCRIBE, their sharded forms instead.
SHARDED = [
    "-publish", "-subscribe", "+ssubscribe", "+sunsubscribe", "+spublish", "+pubsub|shardnumsub",
    "+command|info", "+cluster|slots",
]  # fmt: skip


@pytest.fixture
def sharded_only(cluster: LocalCluster) -> Iterator[str]:
    """That user on every node; its URL."""
    for node in cluster.nodes:
        cluster.call(node, "ACL", "SETUSER", "sharded", "reset", *LEAST, *SHARDED)
    yield f"redis://sharded:{PASSWORD}@127.0.0.1:{cluster.nodes[0].port}"
    for node in cluster.alive():
        cluster.call(node, "ACL", "DELUSER", "sharded")


def test_waits_under_an_acl_that_allows_only_sharded_pub_sub(
    make: Callable[..., ClusterLocks], sharded_only: str
) -> None:
    prefix = f"joblock:c{next(_prefixes)}"  # under the user's key patterns
    holder, waiter = make(sharded_only, prefix=prefix), make(sharded_only, prefix=prefix)
    for key in [holder.key("Acl", i) for i in range(3)]:
        lease = holder.acquire(key, ttl=30)
        assert lease is not None
        threading.Timer(0.1, lease.release).start()
        got = waiter.acquire(key, ttl=30, wait=8)  # handed over: see the test above
        assert got is not None and got.release() is True


def test_an_operator_s_release_reaches_a_guarded_lease_by_its_slot(
    make: Callable[..., ClusterLocks], cluster: LocalCluster, sharded_only: str
) -> None:
    # Told on the key's sharded channel of lost notices (the holder's client may not SUBSCRIBE).
    locks = make(sharded_only, prefix=f"joblock:c{next(_prefixes)}")
    key = locks.key("Told")
    with locks.lock(key, ttl=30, on_lost=lambda lease: None) as lease:
        assert admin.release(cluster.url, key) == 0
        assert lease.lost.wait(5)
        with pytest.raises(joblock.LockLost, match="released"):
            lease.check()
