"""What a type checker tells a user of compat.AsyncRedisLock (checked by mypy, never run)."""

from __future__ import annotations

from typing import Literal

import redis.asyncio
from redis.asyncio.lock import Lock
from typing_extensions import assert_type

from joblock.compat import AsyncRedisLock


async def compat_aio(client: redis.asyncio.Redis) -> None:
    client.lock("resource", timeout=30, lock_class=AsyncRedisLock)
    mine = AsyncRedisLock(
        client, "resource", timeout=30, sleep=0.05, blocking=True, blocking_timeout=5, thread_local=False,
        raise_on_release_error=False,
    )  # fmt: skip
    theirs: Lock = mine  # wherever redis-py's asyncio Lock is expected
    assert_type(await mine.acquire(blocking=True, blocking_timeout=5), bool)
    assert_type(await mine.acquire(token=b"t"), bool)
    assert_type(await mine.locked(), bool)
    assert_type(await mine.owned(), bool)
    assert_type(await mine.extend(10, replace_ttl=True), Literal[True])  # or raises LockNotOwnedError
    assert_type(await mine.reacquire(), Literal[True])
    assert_type(await mine.do_release(b"t"), None)
    assert_type(await theirs.release(), None)
    async with mine:  # redis-py leaves __aenter__ untyped
        pass
    assert_type(await mine.acquire(sleep=0.01), bool)  # as redis-py's since 8.2
