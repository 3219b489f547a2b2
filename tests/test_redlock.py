"""Redlock over 3 and 5 real, independent redis-servers, one of them down, on every twin."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest
import redis

import joblock
from joblock._tools.servers import RedisServer
from joblock.redlock import Redlock, RedlockLease

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def clients(servers: list[RedisServer]) -> Iterator[list[redis.Redis]]:
    made = [redis.Redis.from_url(s.url) for s in servers]
    yield made
    for client in made:
        client.close()


def redlock_class(core: ModuleType) -> type[Redlock]:
    return type("Redlock", (Redlock,), {"_core": core})


@pytest.fixture
def make(core: ModuleType) -> Iterator[Callable[..., Redlock]]:
    made: list[Redlock] = []
    prefix = f"rl{next(_prefixes)}"

    def build(urls: list[str], **kwargs: Any) -> Redlock:
        kwargs.setdefault("prefix", prefix)
        kwargs.setdefault("retries", 1)
        kwargs.setdefault("connect_timeout", 1.0)
        redlock = redlock_class(core)(urls, **kwargs)
        made.append(redlock)
        return redlock

    yield build
    for redlock in made:
        redlock.close()


def urls(servers: list[RedisServer], n: int) -> list[str]:
    return [s.url for s in servers[:n]]


@pytest.mark.parametrize("n", [3, 5])
def test_acquire_sets_the_same_token_everywhere(
    make: Callable[..., Redlock], servers: list[RedisServer], clients: list[redis.Redis], n: int
) -> None:
    rl = make(urls(servers, n))
    assert rl.quorum == n // 2 + 1
    key = rl.key("Job", n)
    lease = rl.acquire(key, ttl=10)
    assert isinstance(lease, RedlockLease)
    assert lease.key == key and lease.held and lease.fence is None
    assert 0 < lease.validity <= 10 - rl.drift(10)
    remaining = lease.remaining()
    assert remaining is not None and 0 < remaining <= 10
    for client in clients[:n]:
        assert client.get(key) == lease.token
        assert 9000 < client.pttl(key) <= 10000
    assert rl.acquire(key, ttl=10) is None
    assert lease.release() is True
    assert not lease.held and lease.remaining() is None
    assert lease.release() is False
    for client in clients[:n]:
        assert client.get(key) is None


@pytest.mark.parametrize("n", [3, 5])
def test_one_server_down(
    make: Callable[..., Redlock],
    servers: list[RedisServer],
    clients: list[redis.Redis],
    down_url: str,
    n: int,
) -> None:
    rl = make([*urls(servers, n - 1), down_url])
    key = rl.key("Down", n)
    with rl.lock(key, ttl=5) as lease:
        for client in clients[: n - 1]:
            assert client.get(key) == lease.token
        assert rl.acquire(key, ttl=5) is None
        assert lease.extend(20) is True
        for client in clients[: n - 1]:
            assert client.pttl(key) > 15000
    for client in clients[: n - 1]:
        assert client.get(key) is None
    leases = rl.acquire_many([f"{key}:{i}" for i in range(50)], ttl=5)
    assert all(lease is not None for lease in leases)
    assert rl.release_many(leases) == [True] * 50


def test_quorum_out_of_reach_raises(
    make: Callable[..., Redlock], servers: list[RedisServer], clients: list[redis.Redis], down_url: str
) -> None:
    rl = make([servers[0].url, down_url, down_url])
    key = rl.key("Unreachable")
    with pytest.raises(joblock.ConnectionError, match="only 1 of 3 servers reachable, 2 needed"):
        rl.acquire(key, ttl=5)
    assert clients[0].get(key) is None  # released on the one that granted
    with pytest.raises(joblock.BatchConnectionError):
        rl.acquire_many([key, key + "x"], ttl=5)
    assert clients[0].get(key) is None


@pytest.mark.parametrize(
    ("n", "taken", "granted"), [(3, 1, True), (3, 2, False), (5, 2, True), (5, 3, False)]
)
def test_quorum(
    make: Callable[..., Redlock],
    servers: list[RedisServer],
    clients: list[redis.Redis],
    n: int,
    taken: int,
    granted: bool,
) -> None:
    rl = make(urls(servers, n))
    key = rl.key("Quorum", n, taken)
    for client in clients[:taken]:
        client.set(key, b"someone else", px=10000)
    lease = rl.acquire(key, ttl=10)
    assert (lease is not None) is granted
    for client in clients[:taken]:
        assert client.get(key) == b"someone else"
    for client in clients[taken:n]:
        # Without a quorum the lock goes from every server that granted it.
        assert client.get(key) == (lease.token if lease is not None else None)
    if lease is not None:
        assert lease.release() is True  # a quorum held it
        for client in clients[:taken]:
            assert client.get(key) == b"someone else"


def test_no_validity_left_means_no_lock(
    make: Callable[..., Redlock], servers: list[RedisServer], clients: list[redis.Redis]
) -> None:
    rl = make(urls(servers, 3))
    key = rl.key("Tiny")
    # The drift allowance alone (1 % + 2 ms) exceeds a 1 ms ttl: never valid.
    assert rl.acquire(key, ttl=0.001) is None
    assert rl.acquire_many([key, key + "2"], ttl=0.001) == [None, None]
    for client in clients[:3]:
        assert client.get(key) is None


def test_wait(make: Callable[..., Redlock], servers: list[RedisServer], clients: list[redis.Redis]) -> None:
    rl = make(urls(servers, 3))
    key = rl.key("Wait")
    for client in clients[:3]:
        client.set(key, b"someone else", px=300)
    assert rl.acquire(key, ttl=5) is None
    started = time.monotonic()
    lease = rl.acquire(key, ttl=5, wait=5)
    assert lease is not None and time.monotonic() - started < 5
    assert lease.release() is True


@pytest.mark.parametrize("n", [3, 5])
def test_batches_in_order(
    make: Callable[..., Redlock],
    servers: list[RedisServer],
    clients: list[redis.Redis],
    down_url: str,
    n: int,
) -> None:
    rl = make([*urls(servers, n - 1), down_url], window=64)
    keys = [rl.key("Batch", i) for i in range(300)]
    # With one server down, taken on n // 2 servers: refused; on one fewer: granted.
    for client in clients[: n // 2]:
        client.set(keys[7], b"other", px=10000)
    for client in clients[: n // 2 - 1]:
        client.set(keys[11], b"other", px=10000)
    leases = rl.acquire_many([*keys, keys[0]], ttl=10)
    assert len(leases) == 301
    assert leases[7] is None and leases[300] is None  # busy; a repeat: the first wins
    assert all(
        lease is not None and lease.key == k for i, (lease, k) in enumerate(zip(leases, keys)) if i != 7
    )
    assert clients[n - 2].get(keys[7]) is None  # released where it had been granted
    extended = rl.extend_many(leases, ttl=30)
    assert extended == [lease is not None for lease in leases]
    assert clients[0].pttl(keys[0]) > 25000
    # Someone takes one of ours on a majority: its extend fails and it is dropped.
    for client in clients[: n // 2 + 1]:
        client.set(keys[3], b"thief", px=10000)
    assert rl.extend_many([leases[3], leases[4]], ttl=30) == [False, True]
    assert not leases[3].held
    released = rl.release_many(leases)
    assert released == [lease is not None and i != 3 for i, lease in enumerate(leases)]
    assert clients[0].get(keys[3]) == b"thief"
    assert all(client.get(keys[0]) is None for client in clients[: n - 1])


def test_a_ttl_may_be_a_timedelta(
    make: Callable[..., Redlock], servers: list[RedisServer], clients: list[redis.Redis]
) -> None:
    rl = make(urls(servers, 3))
    ttl = timedelta(seconds=5)
    lease = rl.acquire(rl.key("Delta"), ttl)
    many = rl.acquire_many([rl.key("Delta", 1), rl.key("Delta", 2)], ttl)
    deduped = rl.dedupe("Delta", [(3,)], ttl)
    leases = [lease, *many, *deduped]
    assert all(lease is not None and 4 < lease.validity <= 5 for lease in leases)
    assert all(4_000 < client.pttl(lease.key) <= 5_000 for client in clients[:3] for lease in leases)
    assert rl.release_many(leases) == [True] * 4


def test_dedupe(make: Callable[..., Redlock], servers: list[RedisServer], clients: list[redis.Redis]) -> None:
    rl = make(urls(servers, 3))
    leases = rl.dedupe("ProductSalesJob", [(1,), (2,), (1,)], ttl=5)
    assert [lease is not None for lease in leases] == [True, True, False]
    assert leases[0] is not None and leases[0].key == rl.key("ProductSalesJob", 1)
    assert clients[2].get(rl.key("ProductSalesJob", 2)) == leases[1].token
    assert rl.release_many(leases) == [True, True, False]


def test_lock_context_raises_when_busy(make: Callable[..., Redlock], servers: list[RedisServer]) -> None:
    rl = make(urls(servers, 3))
    key = rl.key("Ctx")
    with rl.lock(key, ttl=5), pytest.raises(joblock.LockNotAcquired), rl.lock(key, ttl=5):
        pass
    assert rl.acquire(key, ttl=5) is not None


def test_arguments(make: Callable[..., Redlock], servers: list[RedisServer], core: ModuleType) -> None:
    with pytest.raises(TypeError, match="urls"):
        redlock_class(core)(servers[0].url)
    with pytest.raises(ValueError, match="at least one"):
        redlock_class(core)([])
    with pytest.raises(ValueError, match="drift_factor"):
        redlock_class(core)([servers[0].url], drift_factor=2)
    rl = make(urls(servers, 3))
    with pytest.raises(ValueError, match="ttl"):
        rl.acquire("k", ttl=0)
    with pytest.raises(TypeError, match="key must be str or bytes"):
        rl.acquire(5, ttl=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"leases\[1\] must be a RedlockLease"):
        rl.release_many([None, "x"])
    assert "quorum=2" in repr(rl)
