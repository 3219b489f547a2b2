"""The asyncio fixtures of redis-py's conftest that its asyncio lock tests use."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio

from joblock._tools.servers import RedisServer
from joblock.compat import aclose


@pytest_asyncio.fixture(params=[True, False], ids=["single", "pool"])
async def create_redis(
    request: pytest.FixtureRequest, redis_py_server: RedisServer
) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """redis-py's client factory: a single-connection client, or one over a pool."""
    made: list[Any] = []

    async def client_factory(**kwargs: Any) -> Any:
        client = redis.asyncio.Redis.from_url(redis_py_server.url, **kwargs)
        if request.param:
            client = client.client()
            await client.initialize()
        made.append(client)
        return client

    yield client_factory
    for client in made:
        await client.flushdb()
        await aclose(client)  # the connections joblock.compat opened for the client's locks
        await client.aclose()
        await client.connection_pool.disconnect()


@pytest_asyncio.fixture
async def r(create_redis: Callable[..., Awaitable[Any]]) -> Any:
    return await create_redis()
