"""Redis Cluster and Redlock: joblock against redis-py's cluster pipeline and pottery's Redlock.

Groups:
- ``cluster-batch-acquire``: 1000 locks (``SET NX PX``) spread over the slots of a
  local 3-primary cluster (with 3 replicas), per round; then released outside the timing.
- ``redlock-acquire``: one lock taken and released on 3 independent servers (quorum 2).
- ``redlock-batch-acquire``: 1000 locks taken on 3 servers (joblock only: pottery
  has no batch acquire; its per-key loop is in ``redlock-acquire``).

Nothing asserts on speed; each round checks that the locks were really granted.

    python -m pytest benchmarks/test_bench_cluster.py
    python -m pytest benchmarks/test_bench_cluster.py --benchmark-disable   # smoke run
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from joblock import _core_py
from joblock._core import compiled
from joblock._tools.servers import LocalCluster, RedisServer
from joblock.cluster import ClusterLocks
from joblock.redlock import Redlock

_compiled = compiled()
TWINS: dict[str, Any] = {"py": _core_py} if _compiled is None else {"c": _compiled, "py": _core_py}

BATCH = 1000
_rounds = itertools.count()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(primaries=3, replicas=1) as started:
        yield started


@pytest.fixture(scope="module")
def servers() -> Iterator[list[RedisServer]]:
    started = [RedisServer().start() for _ in range(3)]
    yield started
    for server in started:
        server.close()


def batch_keys(tag: str) -> list[str]:
    n = next(_rounds)
    return [f"bench:{tag}:{n}:{i}" for i in range(BATCH)]


# -- cluster ------------------------------------------------------------------------------


@pytest.mark.benchmark(group="cluster-batch-acquire")
@pytest.mark.parametrize("twin", list(TWINS))
def test_cluster_joblock(benchmark: Any, cluster: LocalCluster, twin: str) -> None:
    locks = type("ClusterLocks", (ClusterLocks,), {"_core": TWINS[twin]})(cluster.url, prefix="bench")
    held: list[Any] = []

    def run(keys: list[str]) -> list[Any]:
        leases = locks.acquire_many(keys, ttl=60)
        held.append(leases)
        return leases

    benchmark.extra_info.update(contender=f"joblock ClusterLocks ({twin})", operations_per_round=BATCH)
    benchmark.pedantic(run, setup=lambda: ((batch_keys(twin),), {}), rounds=30, warmup_rounds=1)
    for leases in held:
        assert all(lease is not None for lease in leases)
        locks.release_many(leases)
    locks.close()


@pytest.mark.benchmark(group="cluster-batch-acquire")
def test_cluster_redis_py_pipeline(benchmark: Any, cluster: LocalCluster) -> None:
    from redis.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    held: list[list[str]] = []

    def run(keys: list[str]) -> list[Any]:
        pipe = client.pipeline()
        for key in keys:
            pipe.set(key, b"token", nx=True, px=60000)
        replies: list[Any] = pipe.execute()
        held.append(keys)
        return replies

    benchmark.extra_info.update(contender="redis-py RedisCluster pipeline", operations_per_round=BATCH)
    replies = benchmark.pedantic(
        run, setup=lambda: ((batch_keys("redis-py"),), {}), rounds=30, warmup_rounds=1
    )
    assert all(replies)
    for keys in held:
        pipe = client.pipeline()
        for key in keys:
            pipe.delete(key)
        pipe.execute()
    client.close()


# -- Redlock ------------------------------------------------------------------------------


@pytest.mark.benchmark(group="redlock-acquire")
@pytest.mark.parametrize("twin", list(TWINS))
def test_redlock_joblock(benchmark: Any, servers: list[RedisServer], twin: str) -> None:
    redlock = type("Redlock", (Redlock,), {"_core": TWINS[twin]})([s.url for s in servers], prefix="bench")
    key = f"bench:redlock:{twin}"

    def run() -> bool:
        lease = redlock.acquire(key, ttl=10)
        assert lease is not None
        return lease.release()

    benchmark.extra_info.update(contender=f"joblock Redlock ({twin}), 3 servers")
    assert benchmark.pedantic(run, rounds=300, warmup_rounds=5) is True
    redlock.close()


@pytest.mark.benchmark(group="redlock-acquire")
def test_redlock_pottery(benchmark: Any, servers: list[RedisServer]) -> None:
    pottery = pytest.importorskip("pottery")
    import redis

    logging.getLogger("pottery").setLevel(logging.ERROR)
    masters = {redis.Redis.from_url(s.url) for s in servers}
    lock = pottery.Redlock(key="bench:redlock:pottery", masters=masters, auto_release_time=10)

    def run() -> bool:
        assert lock.acquire(blocking=False)
        lock.release()
        return True

    benchmark.extra_info.update(contender="pottery Redlock, 3 servers")
    assert benchmark.pedantic(run, rounds=300, warmup_rounds=5) is True
    for client in masters:
        client.close()


@pytest.mark.benchmark(group="redlock-batch-acquire")
@pytest.mark.parametrize("twin", list(TWINS))
def test_redlock_batch_joblock(benchmark: Any, servers: list[RedisServer], twin: str) -> None:
    redlock = type("Redlock", (Redlock,), {"_core": TWINS[twin]})([s.url for s in servers], prefix="bench")
    held: list[Any] = []

    def run(keys: list[str]) -> list[Any]:
        leases = redlock.acquire_many(keys, ttl=60)
        held.append(leases)
        return leases

    benchmark.extra_info.update(contender=f"joblock Redlock ({twin}), 3 servers", operations_per_round=BATCH)
    benchmark.pedantic(run, setup=lambda: ((batch_keys(f"rl-{twin}"),), {}), rounds=20, warmup_rounds=1)
    for leases in held:
        assert all(lease is not None for lease in leases)
        redlock.release_many(leases)
    redlock.close()


@pytest.mark.benchmark(group="redlock-batch-acquire")
def test_redlock_batch_pottery(benchmark: Any, servers: list[RedisServer]) -> None:
    pottery = pytest.importorskip("pottery")
    import redis

    logging.getLogger("pottery").setLevel(logging.ERROR)
    masters = {redis.Redis.from_url(s.url) for s in servers}
    held: list[Any] = []

    def run(keys: list[str]) -> int:
        # pottery takes Redlocks one at a time: its batch is a loop.
        locks = [pottery.Redlock(key=k, masters=masters, auto_release_time=60) for k in keys]
        got = sum(1 for lock in locks if lock.acquire(blocking=False))
        held.append(locks)
        return got

    benchmark.extra_info.update(contender="pottery Redlock loop, 3 servers", operations_per_round=BATCH)
    got = benchmark.pedantic(run, setup=lambda: ((batch_keys("rl-pottery"),), {}), rounds=3, warmup_rounds=0)
    assert got == BATCH
    for locks in held:
        for lock in locks:
            lock.release()
    for client in masters:
        client.close()
