"""What a type checker tells a user of Locks and its leases (checked by mypy, never run).

Every ``assert_type`` fails mypy when the type joblock gives changes; every misuse
marked ``# type: ignore[code]`` fails it (strict mode reports unused ignores) when
joblock's types stop rejecting it. The other files here work the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from datetime import timedelta

import redis
from typing_extensions import assert_type

import joblock
from joblock import Lease, LockNotAcquired, Locks, Settings


def single_locks(locks: Locks) -> None:
    key = locks.key("ProductSalesJob", 42, region="eu")
    assert_type(key, str)
    lease = locks.acquire(key, ttl=300)
    assert_type(lease, Lease | None)
    assert_type(locks.acquire(b"raw-key", ttl=timedelta(minutes=5), wait=5), Lease | None)
    assert_type(locks.acquire(key, 300, wait=timedelta(seconds=1), fence=True), Lease | None)
    if lease is None:
        return
    assert_type(lease.key, str | bytes)
    assert_type(lease.token, bytes)
    assert_type(lease.fence, int | None)
    assert_type(lease.held, bool)
    assert_type(lease.extend(300), bool)
    assert_type(lease.extend(timedelta(seconds=30)), bool)
    assert_type(lease.remaining(), float | None)
    assert_type(lease.release(), bool)
    with lease as same:
        assert_type(same, Lease)
    lease.extend("300")  # type: ignore[arg-type]
    lease.fence = 3  # type: ignore[misc]


def lock_blocks(locks: Locks) -> None:
    block: AbstractContextManager[Lease] = locks.lock("k", ttl=30)
    with block as lease:
        assert_type(lease, Lease)
    with locks.lock("k", ttl=30, wait=1, fence=True) as lease:
        assert_type(lease, Lease)
    try:
        with locks.lock(b"k", 30):
            pass
    except LockNotAcquired as busy:
        assert_type(busy, LockNotAcquired)
    locks.lock(42, ttl=30)  # type: ignore[arg-type]


def batches(locks: Locks, keys: Iterator[str]) -> None:
    leases = locks.acquire_many(keys, ttl=300)
    assert_type(leases, list[Lease | None])
    assert_type(locks.acquire_many(["a", b"b"], ttl=1, fence=True), list[Lease | None])
    assert_type(locks.dedupe("ProductSalesJob", [(1,), (2,), (1,)], ttl=300), list[Lease | None])
    assert_type(locks.dedupe("J", [[1, "x"]], ttl=timedelta(seconds=9), fence=True), list[Lease | None])
    assert_type(locks.release_many(leases), list[bool])
    assert_type(locks.extend_many(leases, ttl=300), list[bool])
    locks.release_many(["not a lease"])  # type: ignore[list-item]


def clients(client: redis.Redis) -> None:
    assert_type(joblock.__version__, str)
    assert_type(Locks(), Locks)
    locks = Locks("redis://127.0.0.1:6379/0", prefix="app", window=500, password="pw", socket_timeout=2.0)
    assert_type(locks.from_redis(client, prefix="app", window=100), Locks)
    assert_type(Locks.from_redis(client), Locks)
    assert_type(locks.settings, Settings)
    assert_type(locks.prefix, str)
    assert_type(locks.implementation, str)
    assert_type(joblock.implementation, str)
    with locks as same:
        assert_type(same, Locks)
    locks.close()
    Locks(socket_timeout="2")  # type: ignore[arg-type]
    Locks(pasword="typo")  # type: ignore[call-arg]


def errors() -> None:
    try:
        pass
    except joblock.BatchError as e:
        assert_type(e.granted, int)
        assert_type(e.unreleased, int)
    except joblock.ReplyError as e:
        assert_type(e.code, str)
    except joblock.JoblockError as e:
        assert_type(e, joblock.JoblockError)
    assert issubclass(joblock.TimeoutError, joblock.ConnectionError)
