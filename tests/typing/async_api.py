"""What a type checker tells a user of joblock.aio (checked by mypy, never run).

The asyncio clients hand out the same lease objects as the threaded ones, typed as
AsyncLease and AsyncRedlockLease: their release and extend are awaited.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from contextlib import AbstractAsyncContextManager
from datetime import timedelta
from typing import Any

import redis.asyncio
from typing_extensions import assert_type

from joblock import LockNotAcquired
from joblock.aio import AsyncClusterLocks, AsyncLease, AsyncLocks, AsyncRedlock, AsyncRedlockLease


async def single_locks(locks: AsyncLocks) -> None:
    key = locks.key("CleanupDataJob")
    assert_type(key, str)
    lease = await locks.acquire(key, ttl=30)
    assert_type(lease, AsyncLease | None)
    assert_type(await locks.acquire(key, 30, wait=timedelta(seconds=2), fence=True), AsyncLease | None)
    if lease is None:
        return
    assert_type(lease.key, str | bytes)
    assert_type(lease.token, bytes)
    assert_type(lease.fence, int | None)
    assert_type(lease.held, bool)
    pending = lease.extend(30)
    _ = assert_type(pending, Coroutine[Any, Any, bool])
    await pending
    assert_type(await lease.extend(timedelta(seconds=30)), bool)
    assert_type(await lease.remaining(), float | None)
    assert_type(await asyncio.create_task(lease.release()), bool)
    with lease:  # type: ignore[attr-defined]
        pass
    done: bool = lease.release()  # type: ignore[assignment]  # a coroutine, not yet a bool
    assert_type(done, bool)


async def lock_blocks(locks: AsyncLocks) -> None:
    block: AbstractAsyncContextManager[AsyncLease] = locks.lock("k", ttl=30)
    async with block as lease:
        assert_type(lease, AsyncLease)
    try:
        async with locks.lock(b"k", 30, wait=0.5, fence=True) as lease:
            assert_type(await lease.release(), bool)
    except LockNotAcquired:
        pass


async def keys() -> AsyncIterator[str]:
    yield "a"


async def batches(locks: AsyncLocks) -> None:
    leases = await locks.acquire_many(["a", "b"], ttl=300)
    assert_type(leases, list[AsyncLease | None])
    assert_type(
        await locks.dedupe("ProductSalesJob", [(1,), (2,)], ttl=300, fence=True), list[AsyncLease | None]
    )
    assert_type(await locks.release_many(leases), list[bool])
    assert_type(await locks.extend_many(leases, ttl=timedelta(minutes=1)), list[bool])
    await locks.acquire_many(keys(), ttl=1)  # type: ignore[arg-type]  # an iterable, not an async one


async def clients(client: redis.asyncio.Redis) -> None:
    assert_type(AsyncLocks.from_redis(client, prefix="app"), AsyncLocks)
    async with AsyncLocks("redis://127.0.0.1:6379/0", prefix="app", connect_timeout=1.0) as locks:
        assert_type(locks, AsyncLocks)
    assert_type(await locks.close(), None)
    cluster = AsyncClusterLocks(["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"], max_redirects=4)
    assert_type(await cluster.nodes(), list[str])
    await cluster.refresh()
    assert_type(await cluster.acquire("k", 1), AsyncLease | None)
    assert_type(cluster.redirects, Counter[str])


async def redlock(servers: list[str]) -> None:
    async with AsyncRedlock(servers, prefix="app", drift_factor=0.02, retries=2) as rl:
        assert_type(rl.quorum, int)
        lease = await rl.acquire("k", ttl=30, wait=1)
        assert_type(lease, AsyncRedlockLease | None)
        if lease is not None:
            assert_type(lease.fence, None)
            assert_type(lease.validity, float)
            assert_type(lease.remaining(), float | None)  # the local clock: not awaited
            assert_type(await lease.extend(30), bool)
            assert_type(await lease.release(), bool)
        async with rl.lock("k", ttl=30) as held:
            assert_type(held, AsyncRedlockLease)
        many = await rl.acquire_many(["a", "b"], ttl=30)
        assert_type(many, list[AsyncRedlockLease | None])
        assert_type(await rl.dedupe("J", [(1,)], ttl=30), list[AsyncRedlockLease | None])
        assert_type(await rl.release_many(many), list[bool])
        assert_type(await rl.extend_many(many, 30), list[bool])
        await rl.acquire("k", ttl=30, fence=True)  # type: ignore[call-arg]
