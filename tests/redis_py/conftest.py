"""redis-py's own lock test suites, run against joblock.compat's drop-ins.

``test_lock.py`` and ``test_asyncio/test_lock.py`` are redis-py 5.3.1's
``tests/test_lock.py`` and ``tests/test_asyncio/test_lock.py``, unchanged (MIT licence,
Copyright (c) 2022-2023, Redis, inc.; see LICENSE in redis-py). 5.3.1's and not 8.x's:
the 8.x files time the asyncio waits by patching ``redis.asyncio.lock``'s own ``asyncio``
module, which tests redis-py's implementation rather than the Lock API.

Each test runs with redis-py's Lock and with RedisLock/AsyncRedisLock on each twin of
the core: the fixture below puts the class under test where the files name ``Lock``.
The fixtures are the few of redis-py's conftest that the files use (``r`` single
connection and pool, ``_get_client``, ``create_redis``), on a server of their own,
since redis-py's tests use the key "foo" and FLUSHDB after each test.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.asyncio.lock import Lock as RedisPyAsyncLock
from redis.lock import Lock as RedisPyLock

from conftest import TWINS
from joblock._tools.servers import RedisServer
from joblock.compat import AsyncRedisLock, RedisLock


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "onlynoncluster: redis-py's mark (a test not run on a Cluster)")


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    # redis-py runs pytest-asyncio in auto mode; joblock's suite keeps its strict mode
    # (the rest of the suite runs its coroutines itself), so the files' tests are marked here.
    if inspect.iscoroutinefunction(obj) and not any(
        m.name == "asyncio" for m in getattr(obj, "pytestmark", ())
    ):
        pytest.mark.asyncio(obj)


@pytest.fixture(scope="package")
def redis_py_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(params=["redis-py", *TWINS], autouse=True)
def lock_class(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> type:
    """The class the test file's ``get_lock`` hands ``client.lock(lock_class=...)``."""
    asynchronous = request.module.__name__.endswith("test_asyncio.test_lock")
    if request.param == "redis-py":
        chosen: type = RedisPyAsyncLock if asynchronous else RedisPyLock
    else:
        ours = AsyncRedisLock if asynchronous else RedisLock
        chosen = type(ours.__name__, (ours,), {"_core": TWINS[request.param]})
    monkeypatch.setattr(request.module, "Lock", chosen)
    return chosen


def _get_client(
    cls: type, request: pytest.FixtureRequest, single_connection_client: bool = True, **kwargs: Any
) -> Any:
    """redis-py's helper: a client of the suite's server, flushed and closed after the test."""
    server = request.getfixturevalue("redis_py_server")
    client = cls.from_url(server.url, **kwargs)
    if single_connection_client:
        client = client.client()

    def teardown() -> None:
        client.flushdb()
        client.close()
        client.connection_pool.disconnect()

    request.addfinalizer(teardown)
    return client


@pytest.fixture
def r(request: pytest.FixtureRequest) -> Any:
    return _get_client(redis.Redis, request)
