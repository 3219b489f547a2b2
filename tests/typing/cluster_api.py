"""What a type checker tells a user of ClusterLocks, Redlock and compat (checked by mypy, never run)."""

from __future__ import annotations

from collections import Counter
from typing import Literal

import redis
from typing_extensions import assert_type

from joblock import ClusterLocks, Lease, Locks, Redlock, RedlockLease
from joblock.compat import RedisLock


def cluster(seeds: list[str]) -> None:
    locks = ClusterLocks(seeds, prefix="app", max_redirects=8, window=200, username="u", password="p")
    assert_type(ClusterLocks("redis://127.0.0.1:7000"), ClusterLocks)
    threaded: Locks = locks  # the API of Locks, routed by hash slot
    assert_type(locks.nodes(), list[str])
    assert_type(locks.refresh(), None)
    assert_type(locks.redirects, Counter[str])
    lease = locks.acquire(locks.key("J", 1), ttl=30, fence=True)
    assert_type(lease, Lease | None)
    with locks.lock("{user1}:a", ttl=30) as held:
        assert_type(held, Lease)
    leases = locks.acquire_many(["{u}:a", "{u}:b"], ttl=30)
    assert_type(leases, list[Lease | None])
    assert_type(locks.dedupe("J", [(1,), (2,)], ttl=30), list[Lease | None])
    assert_type(locks.release_many(leases), list[bool])
    assert_type(locks.extend_many(leases, 30), list[bool])
    assert_type(threaded.acquire("k", 1), Lease | None)
    ClusterLocks(seeds, max_redirects="8")  # type: ignore[arg-type]


def redlock(servers: list[str]) -> None:
    with Redlock(servers, prefix="app", drift_factor=0.01, socket_timeout=0.5) as rl:
        assert_type(rl, Redlock)
        assert_type(rl.quorum, int)
        assert_type(rl.drift(30), float)
        assert_type(rl.key("J", 1), str)
        lease = rl.acquire("k", ttl=30, wait=2)
        assert_type(lease, RedlockLease | None)
        if lease is not None:
            assert_type(lease.key, str | bytes)
            assert_type(lease.token, bytes)
            assert_type(lease.fence, None)
            assert_type(lease.held, bool)
            assert_type(lease.validity, float)
            assert_type(lease.remaining(), float | None)
            assert_type(lease.extend(30), bool)
            assert_type(lease.release(), bool)
        with rl.lock("k", ttl=30) as held:
            assert_type(held, RedlockLease)
        leases = rl.acquire_many(["a", "b"], ttl=30)
        assert_type(leases, list[RedlockLease | None])
        assert_type(rl.dedupe("J", [(1,), (2,)], ttl=30), list[RedlockLease | None])
        assert_type(rl.release_many(leases), list[bool])
        assert_type(rl.extend_many(leases, ttl=30), list[bool])
        rl.acquire("k", ttl=30, fence=True)  # type: ignore[call-arg]


def compat(client: redis.Redis) -> None:
    client.lock("resource", timeout=30, lock_class=RedisLock)  # redis-py types this Any
    mine = RedisLock(client, "resource", timeout=30)
    assert_type(mine.acquire(blocking=True, blocking_timeout=5), bool)
    assert_type(mine.acquire(token=b"t"), bool)
    assert_type(mine.locked(), bool)
    assert_type(mine.owned(), bool)
    assert_type(mine.extend(10, replace_ttl=True), Literal[True])  # or raises LockNotOwnedError
    assert_type(mine.reacquire(), Literal[True])
    assert_type(mine.release(), None)
