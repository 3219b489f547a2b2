"""``joblock.compat.AsyncRedisLock`` against redis-py's own ``redis.asyncio.lock.Lock``.

As in test_compat.py, every test runs once with redis-py's asyncio Lock and once with
AsyncRedisLock bound to each twin of the core, through ``client.lock(name,
lock_class=...)`` on a real server. ``TestLock`` is redis-py's own
``tests/test_asyncio/test_lock.py``, ported: each test awaits on a fresh event loop
(the suite has no asyncio plugin), the key "foo" is a fresh name per test (the
suite's server is shared, so there is no FLUSHALL after each test), and the two
measured waits also assert the sleeps they take (see ``asleep``); tests/redis_py runs
the file itself, unchanged. The tests after it cover what that file does not: the
constructor, redis-py's exceptions, cancellation, clients, tasks and event loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import uuid

import pytest
import redis
import redis.asyncio
from redis.asyncio.lock import Lock
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import LockError, LockNotOwnedError

from conftest import API_TWINS, TWINS
from joblock import compat
from joblock._tools.servers import RedisServer
from joblock.compat import AsyncRedisLock

IMPLEMENTATIONS = ["redis-py", *API_TWINS]


def lock_class_for(implementation):
    if implementation == "redis-py":
        return Lock
    return type("AsyncRedisLock", (AsyncRedisLock,), {"_core": TWINS[implementation]})


@pytest.fixture(params=IMPLEMENTATIONS)
def lock_class(request):
    return lock_class_for(request.param)


@pytest.fixture(params=API_TWINS)
def ours(request):
    """AsyncRedisLock on each twin: for what joblock promises beyond redis-py's Lock."""
    return lock_class_for(request.param)


async def closed(client):
    """Closes a redis.asyncio client and the connections joblock opened for its locks."""
    await compat.aclose(client)
    await client.aclose()


def on_a_loop(test):
    """Runs an ``async def`` test on a fresh event loop, then closes the clients it was given."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        async def main():
            try:
                await test(*args, **kwargs)
            finally:
                for value in kwargs.values():
                    if isinstance(value, redis.asyncio.Redis):
                        await closed(value)

        asyncio.run(main())

    return run


@pytest.fixture
def r(redis_server):
    return redis.asyncio.Redis.from_url(redis_server.url)


@pytest.fixture
def r_decoded(redis_server):
    return redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)


@pytest.fixture
def name():
    return f"compat-aio:{uuid.uuid4().hex}"


@pytest.fixture
def foo(name):
    """The lock name redis-py's tests call "foo", fresh for each test."""
    return name


@pytest.fixture(scope="module")
def secured():
    """A server that wants a password."""
    with RedisServer("--requirepass", "pw") as server:
        yield server


@pytest.fixture
def asleep(monkeypatch):
    """The seconds of every ``asyncio.sleep`` the test awaits (they still sleep)."""
    slept = []
    real = asyncio.sleep

    async def sleep(delay, *args, **kwargs):
        slept.append(delay)
        return await real(delay, *args, **kwargs)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return slept


async def gone(client, key, timeout=3.0):
    """Waits until ``key`` is gone from Redis; True when it is."""
    deadline = time.monotonic() + timeout
    while await client.exists(key):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def cancelled_after(turns, coro):
    """Runs ``coro`` as a task cancelled after ``turns`` loop iterations: whether it was."""
    task = asyncio.ensure_future(coro)
    for _ in range(turns):
        await asyncio.sleep(0)
    if task.done():
        task.result()
        return False
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


# -- redis-py's tests/test_asyncio/test_lock.py ----------------------------------------------


class TestLock:
    @pytest.fixture(autouse=True)
    def _lock_class(self, lock_class):
        self.lock_class = lock_class

    def get_lock(self, redis, *args, **kwargs):
        kwargs["lock_class"] = self.lock_class
        return redis.lock(*args, **kwargs)

    @on_a_loop
    async def test_lock(self, r, foo):
        lock = self.get_lock(r, foo)
        assert await lock.acquire(blocking=False)
        assert await r.get(foo) == lock.local.token
        assert await r.ttl(foo) == -1
        await lock.release()
        assert await r.get(foo) is None

    @on_a_loop
    async def test_lock_token(self, r, foo):
        lock = self.get_lock(r, foo)
        await self._test_lock_token(r, lock, foo)

    @on_a_loop
    async def test_lock_token_thread_local_false(self, r, foo):
        lock = self.get_lock(r, foo, thread_local=False)
        await self._test_lock_token(r, lock, foo)

    async def _test_lock_token(self, r, lock, foo):
        assert await lock.acquire(blocking=False, token="test")
        assert await r.get(foo) == b"test"
        assert lock.local.token == b"test"
        assert await r.ttl(foo) == -1
        await lock.release()
        assert await r.get(foo) is None
        assert lock.local.token is None

    @on_a_loop
    async def test_locked(self, r, foo):
        lock = self.get_lock(r, foo)
        assert await lock.locked() is False
        await lock.acquire(blocking=False)
        assert await lock.locked() is True
        await lock.release()
        assert await lock.locked() is False

    async def _test_owned(self, client, foo):
        lock = self.get_lock(client, foo)
        assert await lock.owned() is False
        await lock.acquire(blocking=False)
        assert await lock.owned() is True
        await lock.release()
        assert await lock.owned() is False

        lock2 = self.get_lock(client, foo)
        assert await lock.owned() is False
        assert await lock2.owned() is False
        await lock2.acquire(blocking=False)
        assert await lock.owned() is False
        assert await lock2.owned() is True
        await lock2.release()
        assert await lock.owned() is False
        assert await lock2.owned() is False

    @on_a_loop
    async def test_owned(self, r, foo):
        await self._test_owned(r, foo)

    @on_a_loop
    async def test_owned_with_decoded_responses(self, r_decoded, foo):
        await self._test_owned(r_decoded, foo)

    @on_a_loop
    async def test_competing_locks(self, r, foo):
        lock1 = self.get_lock(r, foo)
        lock2 = self.get_lock(r, foo)
        assert await lock1.acquire(blocking=False)
        assert not await lock2.acquire(blocking=False)
        await lock1.release()
        assert await lock2.acquire(blocking=False)
        assert not await lock1.acquire(blocking=False)
        await lock2.release()

    @on_a_loop
    async def test_timeout(self, r, foo):
        lock = self.get_lock(r, foo, timeout=10)
        assert await lock.acquire(blocking=False)
        assert 8 < (await r.ttl(foo)) <= 10
        await lock.release()

    @on_a_loop
    async def test_float_timeout(self, r, foo):
        lock = self.get_lock(r, foo, timeout=9.5)
        assert await lock.acquire(blocking=False)
        assert 8 < (await r.pttl(foo)) <= 9500
        await lock.release()

    @on_a_loop
    async def test_blocking(self, r, foo):
        blocking = False
        lock = self.get_lock(r, foo, blocking=blocking)
        assert not lock.blocking

        lock_2 = self.get_lock(r, foo)
        assert lock_2.blocking

    @on_a_loop
    async def test_blocking_timeout(self, r, foo, asleep):
        lock1 = self.get_lock(r, foo)
        assert await lock1.acquire(blocking=False)
        bt = 0.2
        sleep = 0.05
        lock2 = self.get_lock(r, foo, sleep=sleep, blocking_timeout=bt)
        start = asyncio.get_running_loop().time()
        assert not await lock2.acquire()
        if isinstance(lock2, AsyncRedisLock):
            # joblock's acquire waits in the lock's queue until blocking_timeout: no polling.
            assert asleep == []
        else:  # redis-py's sleeps between tries, none past the deadline
            assert asleep and set(asleep) == {sleep}
            assert sum(asleep) <= bt
        # The elapsed duration should be less than the total blocking_timeout
        assert bt >= (asyncio.get_running_loop().time() - start) > bt - sleep
        await lock1.release()

    @on_a_loop
    async def test_sleep_given_to_acquire_is_taken(self, r, foo, asleep):
        # redis-py 8.2's asyncio acquire takes sleep= too.
        lock1 = self.get_lock(r, foo)
        assert await lock1.acquire(blocking=False)
        lock2 = self.get_lock(r, foo, sleep=0.05)
        assert not await lock2.acquire(blocking_timeout=0.1, sleep=0.02)
        # redis-py sleeps that long between tries; joblock's wait does not poll.
        assert asleep == [] if isinstance(lock2, AsyncRedisLock) else set(asleep) == {0.02}
        await lock1.release()

    @on_a_loop
    async def test_context_manager(self, r, foo):
        # blocking_timeout prevents a deadlock if the lock can't be acquired
        # for some reason
        async with self.get_lock(r, foo, blocking_timeout=0.2) as lock:
            assert await r.get(foo) == lock.local.token
        assert await r.get(foo) is None

    @on_a_loop
    async def test_context_manager_raises_when_locked_not_acquired(self, r, foo):
        await r.set(foo, "bar")
        with pytest.raises(LockError):
            async with self.get_lock(r, foo, blocking_timeout=0.1):
                pass

    @on_a_loop
    async def test_high_sleep_small_blocking_timeout(self, r, foo, asleep):
        lock1 = self.get_lock(r, foo)
        assert await lock1.acquire(blocking=False)
        sleep = 60
        bt = 1
        lock2 = self.get_lock(r, foo, sleep=sleep, blocking_timeout=bt)
        assert not await lock2.acquire()
        # the elapsed timed is less than the blocking_timeout as the lock is
        # unattainable given the sleep/blocking_timeout configuration: it never sleeps
        assert asleep == []
        await lock1.release()

    @on_a_loop
    async def test_releasing_unlocked_lock_raises_error(self, r, foo):
        lock = self.get_lock(r, foo)
        with pytest.raises(LockError):
            await lock.release()

    @on_a_loop
    async def test_releasing_lock_no_longer_owned_raises_error(self, r, foo):
        lock = self.get_lock(r, foo)
        await lock.acquire(blocking=False)
        # manually change the token
        await r.set(foo, "a")
        with pytest.raises(LockNotOwnedError):
            await lock.release()
        # even though we errored, the token is still cleared
        assert lock.local.token is None

    @on_a_loop
    async def test_extend_lock(self, r, foo):
        lock = self.get_lock(r, foo, timeout=10)
        assert await lock.acquire(blocking=False)
        assert 8000 < (await r.pttl(foo)) <= 10000
        assert await lock.extend(10)
        assert 16000 < (await r.pttl(foo)) <= 20000
        await lock.release()

    @on_a_loop
    async def test_extend_lock_replace_ttl(self, r, foo):
        lock = self.get_lock(r, foo, timeout=10)
        assert await lock.acquire(blocking=False)
        assert 8000 < (await r.pttl(foo)) <= 10000
        assert await lock.extend(10, replace_ttl=True)
        assert 8000 < (await r.pttl(foo)) <= 10000
        await lock.release()

    @on_a_loop
    async def test_extend_lock_float(self, r, foo):
        lock = self.get_lock(r, foo, timeout=10.0)
        assert await lock.acquire(blocking=False)
        assert 8000 < (await r.pttl(foo)) <= 10000
        assert await lock.extend(10.0)
        assert 16000 < (await r.pttl(foo)) <= 20000
        await lock.release()

    @on_a_loop
    async def test_extending_unlocked_lock_raises_error(self, r, foo):
        lock = self.get_lock(r, foo, timeout=10)
        with pytest.raises(LockError):
            await lock.extend(10)

    @on_a_loop
    async def test_extending_lock_with_no_timeout_raises_error(self, r, foo):
        lock = self.get_lock(r, foo)
        assert await lock.acquire(blocking=False)
        with pytest.raises(LockError):
            await lock.extend(10)
        await lock.release()

    @on_a_loop
    async def test_extending_lock_no_longer_owned_raises_error(self, r, foo):
        lock = self.get_lock(r, foo, timeout=10)
        assert await lock.acquire(blocking=False)
        await r.set(foo, "a")
        with pytest.raises(LockNotOwnedError):
            await lock.extend(10)

    @on_a_loop
    async def test_reacquire_lock(self, r, foo):
        lock = self.get_lock(r, foo, timeout=10)
        assert await lock.acquire(blocking=False)
        assert await r.pexpire(foo, 5000)
        assert await r.pttl(foo) <= 5000
        assert await lock.reacquire()
        assert 8000 < (await r.pttl(foo)) <= 10000
        await lock.release()

    @on_a_loop
    async def test_reacquiring_unlocked_lock_raises_error(self, r, foo):
        lock = self.get_lock(r, foo, timeout=10)
        with pytest.raises(LockError):
            await lock.reacquire()

    @on_a_loop
    async def test_reacquiring_lock_with_no_timeout_raises_error(self, r, foo):
        lock = self.get_lock(r, foo)
        assert await lock.acquire(blocking=False)
        with pytest.raises(LockError):
            await lock.reacquire()
        await lock.release()

    @on_a_loop
    async def test_reacquiring_lock_no_longer_owned_raises_error(self, r, foo):
        lock = self.get_lock(r, foo, timeout=10)
        assert await lock.acquire(blocking=False)
        await r.set(foo, "a")
        with pytest.raises(LockNotOwnedError):
            await lock.reacquire()


# -- construction ----------------------------------------------------------------------------


@on_a_loop
async def test_the_constructor_is_redis_pys(r, lock_class, name):
    lock = lock_class(
        r, name, timeout=5, sleep=0.05, blocking=False, blocking_timeout=1, thread_local=False,
        raise_on_release_error=False,
    )  # fmt: skip
    assert isinstance(lock, Lock)
    settings = (lock.redis, lock.name, lock.timeout, lock.sleep, lock.blocking, lock.blocking_timeout)
    assert settings == (r, name, 5, 0.05, False, 1)
    assert (lock.thread_local, lock.raise_on_release_error, lock.local.token) == (False, False, None)
    defaults = r.lock(name, lock_class=lock_class)
    assert type(defaults) is lock_class
    default_settings = (defaults.timeout, defaults.sleep, defaults.blocking, defaults.blocking_timeout)
    assert default_settings == (None, 0.1, True, None)
    assert (defaults.thread_local, defaults.raise_on_release_error) == (True, True)


@on_a_loop
async def test_bytes_name_and_a_token_given_as_bytes(r, lock_class, name):
    key = name.encode() + b"\xff"
    lock = r.lock(key, timeout=5, lock_class=lock_class)
    assert await lock.acquire(token=b"t\xc3\xb6ken") is True
    assert await r.get(key) == lock.local.token == b"t\xc3\xb6ken"
    assert await lock.owned() is True
    await lock.release()
    assert await r.exists(key) == 0


@on_a_loop
async def test_each_acquire_gets_a_fresh_token(r, lock_class, name):
    lock = r.lock(name, lock_class=lock_class)
    await lock.acquire()
    first = lock.local.token
    assert isinstance(first, bytes)
    await lock.release()
    await lock.acquire()
    assert lock.local.token != first
    await lock.release()


# -- the steps redis-py's methods take ---------------------------------------------------------


@on_a_loop
async def test_do_release_with_a_token(r, lock_class, name):
    lock = r.lock(name, timeout=5, lock_class=lock_class)
    await lock.acquire(token="mine")
    other = r.lock(name, timeout=5, lock_class=lock_class)
    with pytest.raises(LockNotOwnedError):
        await other.do_release(b"not-mine")
    assert await r.get(name) == b"mine"
    assert await other.do_release(b"mine") is None
    assert await r.exists(name) == 0


@on_a_loop
async def test_do_acquire_extend_and_reacquire(r, lock_class, name):
    lock = r.lock(name, timeout=1, lock_class=lock_class)
    assert await lock.do_acquire(b"step") is True
    assert await lock.do_acquire(b"step") is False
    lock.local.token = b"step"
    assert await lock.do_extend(10, False) is True
    assert await r.pttl(name) > 10_000
    assert await lock.do_reacquire() is True
    assert 0 < await r.pttl(name) <= 1000
    await lock.release()


def test_extend_and_reacquire_refuse_before_any_await(r, lock_class, name):
    # redis-py checks these when called, not when awaited: no event loop needed.
    lock = r.lock(name, timeout=1, lock_class=lock_class)
    with pytest.raises(LockError, match="Cannot extend an unlocked lock"):
        lock.extend(1)
    with pytest.raises(LockError, match="Cannot reacquire an unlocked lock"):
        lock.reacquire()
    forever = r.lock(name, lock_class=lock_class)
    forever.local.token = b"t"
    with pytest.raises(LockError, match="Cannot extend a lock with no timeout"):
        forever.extend(1)
    with pytest.raises(LockError, match="Cannot reacquire a lock with no timeout"):
        forever.reacquire()


# -- expiry and the async context manager ---------------------------------------------------


@on_a_loop
async def test_blocking_acquire_waits_for_the_release_and_the_expiry(r, lock_class, name):
    holder = r.lock(name, timeout=5, lock_class=lock_class)
    await holder.acquire()
    waiter = r.lock(name, timeout=5, sleep=0.02, blocking_timeout=5, lock_class=lock_class)
    waiting = asyncio.ensure_future(waiter.acquire())
    await asyncio.sleep(0.1)
    assert not waiting.done()
    await holder.release()
    assert await waiting is True
    assert await waiter.owned() is True
    await waiter.release()
    await r.lock(name, timeout=0.2, lock_class=lock_class).acquire()
    assert await waiter.acquire() is True  # once Redis expired the first one
    await waiter.release()


@on_a_loop
async def test_release_never_deletes_the_next_holders_lock(r, lock_class, name):
    lock = r.lock(name, timeout=0.2, lock_class=lock_class)
    await lock.acquire()
    assert await gone(r, name)
    nxt = r.lock(name, timeout=5, lock_class=lock_class)
    assert await nxt.acquire(blocking=False) is True
    with pytest.raises(LockNotOwnedError, match="no longer owned"):
        await lock.release()
    assert await r.get(name) == nxt.local.token
    for step in (lambda: lock.extend(1), lock.reacquire):
        with pytest.raises(LockError):
            await step()
    await nxt.release()


@on_a_loop
async def test_context_manager_raises_when_the_lock_expired_in_the_block(r, lock_class, name):
    with pytest.raises(LockNotOwnedError):
        async with r.lock(name, timeout=0.2, lock_class=lock_class):
            assert await gone(r, name)


@on_a_loop
async def test_context_manager_releases_when_the_block_raises(r, lock_class, name):
    with pytest.raises(ZeroDivisionError):
        async with r.lock(name, timeout=5, lock_class=lock_class):
            1 / 0  # noqa: B018
    assert await r.exists(name) == 0


@on_a_loop
async def test_raise_on_release_error_false_logs_instead(r, lock_class, name, caplog):
    async with r.lock(name, timeout=0.2, raise_on_release_error=False, lock_class=lock_class):
        assert await gone(r, name)
    messages = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert messages == ["Lock was unlocked or no longer owned when exiting context manager."]


# -- tasks and cancellation ------------------------------------------------------------------


@on_a_loop
async def test_tasks_with_a_lock_each_exclude_each_other(r, lock_class, name):
    inside = []
    most = []

    async def worker():
        for _ in range(5):
            async with r.lock(name, timeout=5, sleep=0.002, lock_class=lock_class):
                inside.append(1)
                most.append(len(inside))
                await asyncio.sleep(0.001)
                inside.pop()

    await asyncio.gather(*(worker() for _ in range(6)))
    assert max(most) == 1
    assert len(most) == 30
    assert await r.exists(name) == 0


@on_a_loop
async def test_a_cancelled_release_keeps_the_token_until_a_release_completes(r, lock_class, name):
    # redis-py's fix for a release cancelled mid-way (issue 3847): the lock object
    # keeps its token, so the lock can still be released rather than stay held.
    for turns in itertools.count():
        lock = r.lock(name, lock_class=lock_class)
        assert await lock.acquire() is True
        token = lock.local.token
        if not await cancelled_after(turns, lock.release()):
            break
        assert lock.local.token == token
        with contextlib.suppress(LockNotOwnedError):  # raised if the cancelled one went through
            await lock.release()
        assert lock.local.token is None
        assert await gone(r, name)
    assert lock.local.token is None
    assert await r.exists(name) == 0


@on_a_loop
async def test_a_cancelled_acquire_leaves_no_lock_that_nobody_owns(r, ours, name):
    # Beyond redis-py: at whatever await the acquire is cancelled, a lock Redis
    # granted it is given back (this one has no timeout, so it would stay forever).
    cancelled = 0
    for turns in itertools.count():
        lock = r.lock(name, lock_class=ours)
        if not await cancelled_after(turns, lock.acquire()):
            break
        cancelled += 1
        assert lock.local.token is None
        assert await gone(r, name)
    assert cancelled > 0
    assert await r.get(name) == lock.local.token
    await lock.release()


@on_a_loop
async def test_the_locks_of_one_client_share_one_connection(r, ours, name):
    async def connections():
        return (await r.info("stats"))["total_connections_received"]

    before = await connections()  # r's own connection is made by now
    locks = [r.lock(f"{name}:{i}", timeout=5, lock_class=ours) for i in range(20)]
    assert await asyncio.gather(*(lock.acquire() for lock in locks)) == [True] * 20
    assert await connections() == before + 1
    await asyncio.gather(*(lock.release() for lock in locks))


def test_one_client_on_two_event_loops(redis_server, ours, name):
    client = redis.asyncio.Redis.from_url(redis_server.url)
    lock = client.lock(name, timeout=5, thread_local=False, lock_class=ours)
    assert asyncio.run(lock.acquire()) is True
    # Each loop gets a connection of its own; the previous loop's is dropped.
    assert asyncio.run(lock.owned()) is True
    asyncio.run(lock.release())
    assert asyncio.run(lock.locked()) is False
    asyncio.run(closed(client))


@on_a_loop
async def test_aclose_closes_the_connection_and_the_locks_reopen_it(r, ours, name):
    async def connections():
        return (await r.info("stats"))["total_connections_received"]

    lock = r.lock(name, timeout=5, lock_class=ours)
    assert await lock.acquire() is True
    before = await connections()
    await compat.aclose(r)
    await compat.aclose(r)  # closing twice is harmless
    assert await lock.owned() is True
    assert await connections() == before + 1  # a new connection: the old one was closed
    await lock.release()


# -- clients ---------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["kwargs", "url"])
@on_a_loop
async def test_a_client_with_a_password_on_another_database(secured, lock_class, name, how):
    if how == "url":
        client = redis.asyncio.Redis.from_url(f"redis://:pw@127.0.0.1:{secured.port}/2")
    else:
        client = redis.asyncio.Redis(host="127.0.0.1", port=secured.port, password="pw", db=2)
    db0 = redis.asyncio.Redis(host="127.0.0.1", port=secured.port, password="pw")
    try:
        lock = client.lock(name, timeout=5, lock_class=lock_class)
        assert await lock.acquire() is True
        assert await client.get(name) == lock.local.token
        assert await db0.exists(name) == 0
        assert await lock.extend(1) is True
        assert await lock.reacquire() is True
        assert await lock.owned() is True
        await lock.release()
        assert await client.exists(name) == 0
    finally:
        await closed(client)
        await closed(db0)


@on_a_loop
async def test_a_client_on_a_unix_socket(redis_server, r, lock_class, name):
    local = redis.asyncio.Redis(unix_socket_path=redis_server.unixsocket)
    try:
        lock = local.lock(name, timeout=5, lock_class=lock_class)
        assert await lock.acquire() is True
        assert await r.get(name) == lock.local.token
        await lock.release()
        assert await r.exists(name) == 0
    finally:
        await closed(local)


@on_a_loop
async def test_script_flush_between_acquire_and_release(r, lock_class, name):
    lock = r.lock(name, timeout=5, lock_class=lock_class)
    await lock.acquire()
    await r.script_flush()
    assert await lock.extend(1) is True
    await r.script_flush()
    assert await lock.reacquire() is True
    await r.script_flush()
    await lock.release()
    assert await r.exists(name) == 0


# -- errors are redis-py's ---------------------------------------------------------------------


@on_a_loop
async def test_an_unreachable_server_raises_redis_py_connection_error(lock_class, name):
    with RedisServer() as server:
        port = server.port
    client = redis.asyncio.Redis(
        host="127.0.0.1", port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    try:
        lock = client.lock(name, timeout=5, lock_class=lock_class)
        for method in (lock.acquire, lock.locked):
            with pytest.raises(redis.exceptions.ConnectionError):
                await method()
    finally:
        await closed(client)


@on_a_loop
async def test_a_wrong_password_raises_redis_py_authentication_error(secured, lock_class, name):
    client = redis.asyncio.Redis(
        host="127.0.0.1", port=secured.port, password="wrong", retry=Retry(NoBackoff(), 0)
    )
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            await client.lock(name, timeout=5, lock_class=lock_class).acquire()
    finally:
        await closed(client)


@on_a_loop
async def test_a_key_of_another_type_raises_redis_py_response_error(r, lock_class, name):
    await r.rpush(name, "job")
    lock = r.lock(name, timeout=5, lock_class=lock_class)
    assert await lock.acquire(blocking=False) is False
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        await lock.locked()
    await r.delete(name)
