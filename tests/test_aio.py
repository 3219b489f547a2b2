"""``joblock.aio.AsyncLocks``: the lock API as coroutines, on each twin of the core.

No pytest plugin: each test drives its coroutine on a fresh event loop (``Aio.run``).
A representative subset runs on uvloop too when it is importable. Cancellation is
tested by sweeping: the call under test is cancelled after k event-loop iterations for
k = 0, 1, 2, ... until it finishes before being cancelled, so every await point it
passes is hit; after each cancellation Redis must hold no lock that nobody owns.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any

import pytest
import redis
import redis.asyncio

import joblock
from conftest import locks_class
from helpers import assert_counted_once, assert_held_in_redis
from joblock import LockNotAcquired, current_lease
from joblock._scripts import MARK
from joblock.aio import AsyncLocks
from rig.faults import FaultProxy
from test_connection import run_in_child

WINDOW = 7

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
try:
    import uvloop
except ImportError:  # the uvloop parameter is then simply absent
    pass
else:
    LOOPS["uvloop"] = uvloop.new_event_loop


def run_on(coro: Coroutine[Any, Any, Any], loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> Any:
    """``asyncio.run`` with a loop factory (asyncio.Runner before Python 3.11)."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(coro)
    loop = loop_factory()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


_prefixes = itertools.count()


class Aio:
    """A test's AsyncLocks (on its twin, under its own key prefix) and its event loop."""

    def __init__(self, core: Any, url: str) -> None:
        self.core = core
        self.cls: type[AsyncLocks] = type("AsyncLocks", (AsyncLocks,), {"_core": core})
        self.url = url
        self.prefix = f"aio{next(_prefixes)}"
        self._made: list[AsyncLocks] = []

    def locks(self, url: str | None = None, **kwargs: Any) -> AsyncLocks:
        kwargs.setdefault("prefix", self.prefix)
        locks = self.cls(url or self.url, **kwargs)
        self._made.append(locks)
        return locks

    def name(self, suffix: object) -> str:
        return f"{self.prefix}:{suffix}"

    def names(self, n: int, tag: str = "k") -> list[str]:
        return [self.name(f"{tag}{i}") for i in range(n)]

    def run(self, main: Callable[[], Awaitable[Any]], loop: str = "asyncio") -> Any:
        """Runs ``main()`` on a fresh loop, then closes every AsyncLocks it made."""

        async def body() -> Any:
            try:
                return await main()
            finally:
                made, self._made = self._made, []
                for locks in made:
                    await locks.close()

        return run_on(body(), LOOPS[loop])


@pytest.fixture
def aio(core, redis_server):
    return Aio(core, redis_server.url)


@pytest.fixture(params=list(LOOPS))
def loop(request):
    """The event loops a test runs on: asyncio's, and uvloop's where it is installed."""
    return request.param


@pytest.fixture
def raw(redis_server):
    """A redis-py client on the same server, to look at what joblock wrote."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def stored(raw, aio):
    """Every key in Redis under the test's prefix."""
    return sorted(raw.scan_iter(match=f"*{aio.prefix}:*", count=1000))


# -- acquire, release, extend, remaining -----------------------------------------------


def test_acquire_release_extend_and_batches(aio, raw, loop):
    async def main():
        locks = aio.locks(window=WINDOW)
        key = aio.name("a")
        lease = await locks.acquire(key, 5)
        assert type(lease) is aio.core.Lease
        assert (lease.key, lease.held, lease.fence) == (key, True, None)
        assert raw.get(key) == lease.token
        assert await locks.acquire(key, 5) is None
        assert 4 < await lease.remaining() <= 5
        assert await lease.extend(60) is True
        assert raw.pttl(key) > 50_000
        assert await lease.release() is True
        assert lease.held is False
        assert await lease.remaining() is None
        assert await lease.extend(5) is False
        assert await lease.release() is False

        keys = aio.names(30)
        leases = await locks.acquire_many(iter(keys), 30)
        assert [lease.key for lease in leases] == keys
        assert_held_in_redis(raw, leases)
        assert await locks.extend_many(leases, 60) == [True] * 30
        assert await locks.release_many(leases) == [True] * 30
        deduped = await locks.dedupe("J", [(1,), (2,), (1,)], 30)
        assert [lease is not None for lease in deduped] == [True, True, False]
        assert deduped[1].key == locks.key("J", 2)
        assert await locks.release_many(deduped) == [True, True, False]

    aio.run(main, loop)
    assert stored(raw, aio) == []


def test_bytes_keys_are_kept_as_given(aio, raw):
    async def main():
        locks = aio.locks()
        key = aio.name("bytes\xff").encode("latin-1")
        lease = await locks.acquire(key, 5)
        assert lease.key == key
        assert raw.get(key) == lease.token
        assert await lease.release() is True

    aio.run(main)


def test_release_after_expiry_is_false_and_keeps_the_next_holders_lock(aio, raw):
    async def main():
        locks, other = aio.locks(), aio.locks()
        key = aio.name("expired")
        mine = await locks.acquire(key, 0.1)
        await asyncio.sleep(0.25)
        theirs = await other.acquire(key, 30)
        assert theirs is not None
        assert await mine.extend(30) is False
        assert mine.held is False
        assert await mine.release() is False
        assert raw.get(key) == theirs.token
        # A takeover without expiry (an operator's DEL, then another holder) alike.
        raw.delete(key)
        again = await locks.acquire(key, 30)
        assert await theirs.release() is False
        assert raw.get(key) == again.token
        assert await again.release() is True

    aio.run(main)
    assert stored(raw, aio) == []


def test_tokens_are_on_the_lease_so_tasks_cannot_release_each_others_lock(aio, raw):
    # redis-py's asyncio Lock keeps its token in thread-local storage, which every task
    # on a loop shares: here task A's late release would delete task B's lock.
    async def main():
        locks = aio.locks()
        key = aio.name("shared")
        a_acquired, a_expired, b_acquired = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def task_a():
            lease = await locks.acquire(key, 0.1)
            a_acquired.set()
            await asyncio.sleep(0.25)
            a_expired.set()
            await b_acquired.wait()
            return lease, await lease.release()

        async def task_b():
            await a_acquired.wait()
            await a_expired.wait()
            lease = await locks.acquire(key, 30)
            b_acquired.set()
            await asyncio.sleep(0.01)
            still = raw.get(key) == lease.token
            return lease, still

        (a, a_released), (b, b_still_held) = await asyncio.gather(task_a(), task_b())
        assert a.token != b.token
        assert a_released is False
        assert b_still_held is True
        assert raw.get(key) == b.token

        # A lease handed to another task still releases with its own token.
        c = await locks.acquire(aio.name("handed"), 30)
        assert await asyncio.ensure_future(b.release()) is True
        assert raw.get(c.key) == c.token
        assert await asyncio.ensure_future(c.release()) is True

    aio.run(main)
    assert stored(raw, aio) == []


def test_with_on_an_asyncio_lease_is_refused(aio):
    async def main():
        lease = await aio.locks().acquire(aio.name("with"), 5)
        with pytest.raises(TypeError, match="async with"), lease:
            pass
        assert await lease.release() is True

    aio.run(main)


# -- lock() -------------------------------------------------------------------------------


def test_lock_holds_the_lock_for_the_block_and_raises_when_busy(aio, raw):
    async def main():
        locks = aio.locks()
        key = aio.name("with")
        async with locks.lock(key, 5) as lease:
            assert raw.get(key) == lease.token
            with pytest.raises(LockNotAcquired) as info:
                async with locks.lock(key, 5):
                    pytest.fail("the block must not run")
            assert info.value.key == key
            assert isinstance(info.value, joblock.JoblockError)
        assert lease.held is False
        assert raw.exists(key) == 0

        with pytest.raises(RuntimeError):
            async with locks.lock(key, 5):
                raise RuntimeError("job failed")
        assert raw.exists(key) == 0

    aio.run(main)


def test_lock_releases_when_the_block_is_cancelled(aio, raw):
    async def main():
        locks = aio.locks()
        key = aio.name("cancelled-block")
        inside = asyncio.Event()

        async def block():
            async with locks.lock(key, 30):
                inside.set()
                await asyncio.sleep(30)

        task = asyncio.ensure_future(block())
        await inside.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await locks.close()
        assert raw.exists(key) == 0

    aio.run(main)


def test_lock_warns_when_the_lock_expired_inside_the_block(aio, caplog):
    async def main():
        async with aio.locks().lock(aio.name("expired-inside"), 0.05):
            await asyncio.sleep(0.2)

    with caplog.at_level(logging.WARNING, logger="joblock"):
        aio.run(main)
    assert "expired or was taken" in caplog.text


# -- wait and fence -----------------------------------------------------------------------


def test_wait_gets_the_lock_once_the_holder_releases_or_it_expires(aio, raw):
    async def main():
        locks, other = aio.locks(), aio.locks()
        key = aio.name("wait")
        holder = await other.acquire(key, 30)

        async def release_later():
            await asyncio.sleep(0.15)
            return await holder.release()

        releasing = asyncio.ensure_future(release_later())
        lease = await locks.acquire(key, 30, wait=5)
        assert await releasing is True
        assert raw.get(key) == lease.token
        assert await lease.release() is True

        await other.acquire(key, 0.15)  # never released: it expires
        lease = await locks.acquire(key, 30, wait=5)
        assert raw.get(key) == lease.token
        assert await lease.release() is True

    aio.run(main)


@pytest.mark.parametrize("wait", [0, timedelta(0), 0.2])
def test_wait_gives_up_with_none(aio, wait):
    async def main():
        locks = aio.locks()
        key = aio.name("busy")
        holder = await locks.acquire(key, 30)
        assert await locks.acquire(key, 30, wait=wait) is None
        with pytest.raises(LockNotAcquired):
            async with locks.lock(key, 30, wait=wait):
                pytest.fail("the block must not run")
        assert await holder.release() is True

    aio.run(main)


def test_fence_grows_with_every_grant_of_a_key(aio, raw):
    async def main():
        locks = aio.locks(window=WINDOW)
        key = aio.name("fenced")
        fences = []
        for _ in range(3):
            lease = await locks.acquire(key, 30, fence=True)
            assert await locks.acquire(key, 30, fence=True) is None
            fences.append(lease.fence)
            assert await lease.release() is True
        async with locks.lock(key, 30, fence=True) as lease:
            fences.append(lease.fence)
        assert fences == sorted(set(fences))  # strictly increasing
        batch = await locks.acquire_many(aio.names(20), 30, fence=True)
        assert all(lease.fence >= 1 for lease in batch)
        deduped = await locks.dedupe("J", [(1,), (1,), (2,)], 30, fence=True)
        first, duplicate, second = deduped  # numbers from their slots' counters
        assert duplicate is None and first.fence >= 1 and second.fence >= 1
        assert await locks.release_many(batch + deduped) == [True] * 21 + [False, True]

    aio.run(main)
    assert stored(raw, aio) == []


# -- batches across windows ----------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, WINDOW, WINDOW + 1, 3 * WINDOW + 2])
def test_batches_keep_the_order_across_windows(aio, raw, n):
    async def main():
        locks = aio.locks(window=WINDOW)
        keys = aio.names(n)
        leases = await locks.acquire_many((k for k in keys), 30)
        assert [lease.key for lease in leases] == keys
        assert_held_in_redis(raw, leases)
        for lease in leases:
            assert 29_000 < raw.pttl(lease.key) <= 30_000
        assert await locks.extend_many(iter(leases), 60) == [True] * n
        assert await locks.release_many(lease for lease in leases) == [True] * n
        assert all(lease.held is False for lease in leases)

    aio.run(main)
    assert stored(raw, aio) == []


def test_acquire_many_gives_none_where_someone_else_holds_the_key(aio, raw):
    async def main():
        locks, other = aio.locks(window=WINDOW), aio.locks()
        keys = aio.names(40)
        held = await other.acquire_many(keys[::3], 30)
        leases = await locks.acquire_many(keys, 30)
        assert [lease is None for lease in leases] == [i % 3 == 0 for i in range(40)]
        assert_held_in_redis(raw, held + leases)
        assert (await locks.release_many(leases)).count(True) == 26
        assert await other.release_many(held) == [True] * 14

    aio.run(main)
    assert stored(raw, aio) == []


@pytest.mark.parametrize("gap", [1, WINDOW, 3 * WINDOW + 2])
def test_the_same_key_twice_in_one_call_first_wins(aio, raw, gap):
    async def main():
        locks = aio.locks(window=WINDOW)
        keys = aio.names(gap)
        leases = await locks.acquire_many([*keys, keys[0]], 30)
        assert leases[-1] is None
        assert raw.get(keys[0]) == leases[0].token
        assert await locks.release_many(leases) == [True] * gap + [False]

    aio.run(main)
    assert stored(raw, aio) == []


def test_dedupe_gives_none_for_duplicates_and_builds_the_keys_of_locks_key(aio, raw):
    async def main():
        locks = aio.locks(window=WINDOW)
        other = aio.locks()
        held = await other.acquire(locks.key("ProductSalesJob", 3), 30)
        tuples = [(i % 10,) for i in range(40)]
        leases = await locks.dedupe("ProductSalesJob", (t for t in tuples), 30)
        assert [lease is not None for lease in leases] == [i < 10 and i != 3 for i in range(40)]
        for lease, args in zip(leases, tuples):
            if lease is not None:
                assert lease.key == locks.key("ProductSalesJob", *args)
        assert_held_in_redis(raw, leases)
        assert (await locks.release_many(leases)).count(True) == 9
        assert await held.release() is True

    aio.run(main)
    assert stored(raw, aio) == []


def test_release_many_skips_none_and_extend_many_tells_what_is_still_ours(aio, raw):
    async def main():
        locks = aio.locks(window=WINDOW)
        keys = aio.names(30)
        short = await locks.acquire_many(keys[:15], 0.1)
        long = await locks.acquire_many(keys[15:], 1)
        await asyncio.sleep(0.25)
        taken = await aio.locks().acquire(keys[0], 30)  # an expired one, taken: never deleted
        assert await locks.extend_many([*short, None, *long], 60) == [False] * 16 + [True] * 15
        assert [lease.held for lease in short + long] == [False] * 15 + [True] * 15
        assert all(raw.pttl(lease.key) > 50_000 for lease in long)
        mixed = list(itertools.chain.from_iterable((lease, None) for lease in short + long))
        assert await locks.release_many(mixed) == [False] * 30 + [True, False] * 15
        assert raw.get(keys[0]) == taken.token
        assert await taken.release() is True

    aio.run(main)
    assert stored(raw, aio) == []


def test_an_error_reply_mid_batch_raises_batch_error_and_releases_the_grants(aio, raw):
    async def main():
        locks = aio.locks(window=WINDOW)
        keys = aio.names(40)
        raw.rpush(keys[20], "not a lock")  # the fenced script's GET fails with WRONGTYPE
        with pytest.raises(joblock.BatchError) as info:
            await locks.acquire_many(keys, 30, fence=True)
        # 0-27 as in test_batches, and 28-34 when they went out while the WRONGTYPE was probed.
        assert info.value.granted in (27, 34)
        assert info.value.unreleased == 0
        assert type(info.value.__cause__) is joblock.WrongTypeError
        assert stored(raw, aio) == [keys[20].encode()]
        raw.delete(keys[20])

    aio.run(main)


# -- bad input ------------------------------------------------------------------------------

BAD_INPUT = [
    # (key, ttl, wait, error, argument named in the message)
    ("k", "5", None, TypeError, "ttl"),
    ("k", True, None, TypeError, "ttl"),
    ("k", math.nan, None, ValueError, "ttl"),
    ("k", 0, None, ValueError, "ttl"),
    ("k", -1, None, ValueError, "ttl"),
    ("k", 1e12, None, ValueError, "ttl"),
    ("k", 5, -1, ValueError, "wait"),
    ("k", 5, "x", TypeError, "wait"),
    (5, 5, None, TypeError, "key"),
    (b"", 5, None, ValueError, "key"),
    ("\ud800", 5, None, ValueError, "key"),
]


@pytest.mark.parametrize(("key", "ttl", "wait", "error", "argument"), BAD_INPUT)
def test_bad_input_raises_naming_the_argument_and_writes_nothing(aio, raw, key, ttl, wait, error, argument):
    async def main():
        locks = aio.locks()
        k = aio.name("bad") if key == "k" else key
        for fence in (False, True):
            with pytest.raises(error, match=argument):
                await locks.acquire(k, ttl, wait=wait, fence=fence)
            with pytest.raises(error, match=argument):
                async with locks.lock(k, ttl, wait=wait, fence=fence):
                    pytest.fail("the block must not run")
        if argument != "wait":
            keys = [aio.name("ok"), k]
            with pytest.raises(error, match=argument):
                await locks.acquire_many(keys if argument == "key" else keys[:1], ttl)

    aio.run(main)
    assert stored(raw, aio) == []


def test_bad_input_mid_batch_raises_and_leaves_no_lock(aio, raw):
    async def main():
        locks = aio.locks(window=WINDOW)
        with pytest.raises(TypeError, match=r"keys\[25\]"):
            await locks.acquire_many(iter([*aio.names(25), None, *aio.names(3, "after")]), 30)
        with pytest.raises(TypeError, match=r"arg_tuples\[25\]"):
            await locks.dedupe("J", iter([*((i,) for i in range(25)), 5]), 30)
        with pytest.raises(TypeError, match="job"):
            await locks.dedupe(5, [(1,)], 30)

        def failing():
            yield from aio.names(25)
            raise RuntimeError("the scheduler broke")

        with pytest.raises(RuntimeError, match="scheduler"):
            await locks.acquire_many(failing(), 30, fence=True)
        assert stored(raw, aio) == []

        leases = await locks.acquire_many(aio.names(30), 30)
        with pytest.raises(TypeError, match=r"leases\[25\]"):
            await locks.release_many([*leases[:25], "not a lease", *leases[25:]])
        for lease in leases:
            assert lease.held == (raw.get(lease.key) == lease.token)
        with pytest.raises(TypeError, match=r"leases\[0\]"):
            await locks.extend_many([object()], 30)
        with pytest.raises(ValueError, match="ttl"):
            await locks.extend_many(leases, 0)
        with pytest.raises(TypeError, match="ttl"):
            await leases[0].extend("5")
        await locks.release_many(leases)

    aio.run(main)
    assert stored(raw, aio) == []


# -- scripts ---------------------------------------------------------------------------------


def test_scripts_are_reloaded_after_script_flush(aio, raw):
    async def main():
        locks = aio.locks(window=WINDOW)
        lease = await locks.acquire(aio.name("flush"), 5)
        raw.script_flush()
        assert await lease.extend(30) is True
        raw.script_flush()
        assert await lease.remaining() > 20
        raw.script_flush()
        fenced = await locks.acquire(aio.name("flush-fenced"), 5, fence=True)
        assert fenced.fence >= 1
        raw.script_flush()
        assert await lease.release() is True
        raw.script_flush()
        batch = await locks.acquire_many(aio.names(20), 30, fence=True)
        assert all(b.fence >= 1 for b in batch)
        raw.script_flush()
        assert await locks.extend_many(batch, 60) == [True] * 20
        raw.script_flush()
        assert await locks.release_many([fenced, *batch]) == [True] * 21

    aio.run(main)
    assert stored(raw, aio) == []


# -- faults: dropped, refused and silent connections ------------------------------------------


@pytest.fixture
def cutting_proxy(redis_server):
    made = []

    def make(after, cuts=1):
        made.append(FaultProxy(redis_server.port, after, cuts))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()


@pytest.mark.parametrize("fence", [False, True])
def test_a_lost_reply_to_a_single_acquire_is_recognised_as_ours(aio, raw, cutting_proxy, fence):
    async def main():
        proxy = cutting_proxy(after=0)  # the SET runs, its reply is lost whole
        locks = aio.locks(proxy.url)
        lease = await locks.acquire(aio.name("lost-reply"), 30, fence=fence)
        assert proxy.cut == 1
        assert raw.get(lease.key) == lease.token
        assert (lease.fence is not None) == fence and (lease.fence or 1) >= 1
        assert await lease.release() is True

    aio.run(main)
    assert stored(raw, aio) == []


@pytest.mark.parametrize("fence", [False, True])
def test_a_dropped_connection_mid_batch_grants_each_lock_exactly_once(aio, raw, cutting_proxy, loop, fence):
    n = 3000

    async def main():
        proxy = cutting_proxy(after=4001, cuts=2)  # about 800 replies into each connection
        locks = aio.locks(proxy.url, window=100)
        keys = aio.names(n)
        other = aio.locks()
        held = await other.acquire_many(keys[::10], 60)
        leases = await locks.acquire_many([*keys, *keys[:500]], 60, fence=fence)
        assert proxy.cut == 2
        expected = [i < n and i % 10 != 0 for i in range(n + 500)]
        assert [lease is not None for lease in leases] == expected
        assert_held_in_redis(raw, leases)
        if fence:  # no grant counted twice
            assert_counted_once([lease for lease in leases if lease is not None])
        assert await locks.release_many(leases) == expected
        assert await other.release_many(held) == [True] * len(held)

    aio.run(main, loop)
    assert stored(raw, aio) == []


@pytest.mark.parametrize("operation", ["release_many", "extend_many"])
def test_a_dropped_connection_mid_release_or_extend_is_retried(aio, raw, cutting_proxy, operation):
    n = 3000

    async def main():
        proxy = cutting_proxy(after=None)
        locks = aio.locks(proxy.url, window=100)
        leases = await locks.acquire_many(aio.names(n), 30)
        proxy.cut_after(4 * 600 + 1)  # the script's replies are 4 bytes: 600 replies into the batch
        if operation == "release_many":
            assert await locks.release_many(leases) == [True] * n
            assert not any(lease.held for lease in leases)
        else:
            assert await locks.extend_many(leases, 60) == [True] * n
            assert all(lease.held for lease in leases)
            assert_held_in_redis(raw, leases)
        assert proxy.cut == 1
        await locks.release_many(leases)

    aio.run(main)
    assert stored(raw, aio) == []


def test_when_retries_run_out_the_batch_error_releases_what_was_granted(aio, raw, cutting_proxy):
    async def main():
        proxy = cutting_proxy(after=None)
        locks = aio.locks(proxy.url, window=10)  # windows that complete between cuts, in both dialects
        await (await locks.acquire_many(aio.names(1), 60))[0].release()  # what the server speaks is known
        proxy.cut_after(1001, cuts=4)  # one cut more than the 3 retries
        with pytest.raises(joblock.BatchConnectionError) as info:
            await locks.acquire_many(aio.names(3000), 60)
        assert info.value.unreleased == 0
        assert info.value.granted > 0
        # Only the two windows in flight at the last cut may be left, until their ttl.
        assert len(stored(raw, aio)) <= 2 * 10
        raw.delete(*stored(raw, aio) or [aio.name("none")])

    aio.run(main)


def test_unreachable_or_silent_redis_raises_connection_errors(aio):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    closed = socket.create_server(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()

    async def main():
        refused = aio.locks(f"redis://127.0.0.1:{refused_port}/0", retries=1)
        with pytest.raises(joblock.ConnectionError, match="could not connect"):
            await refused.acquire(aio.name("x"), 5)
        quiet = aio.locks(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", socket_timeout=0.1, retries=0)
        with pytest.raises(joblock.TimeoutError, match="did not answer"):
            await quiet.acquire(aio.name("x"), 5)
        with pytest.raises(joblock.BatchConnectionError):
            await quiet.acquire_many(aio.names(3), 5)

    try:
        aio.run(main)
    finally:
        silent.close()


# -- many tasks: the pool, and one key contended ---------------------------------------------


def opened(raw):
    """How many connections the server has accepted so far."""
    return raw.info("stats")["total_connections_received"]


async def connected(raw, at_most, timeout=3.0):
    """The server's client count once it is ``at_most`` (closed sockets go in a loop turn)."""
    deadline = time.monotonic() + timeout
    while (count := raw.info("clients")["connected_clients"]) > at_most and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return count


def test_many_concurrent_tasks_share_one_connection(aio, raw, loop):
    """200 tasks at once: one connection carries them all, and each gets its own reply."""
    tasks = 200
    peak = Counter()

    async def main():
        locks = aio.locks()
        clients_before = raw.info("clients")["connected_clients"]
        opened_before = opened(raw)
        keys = aio.names(tasks)

        async def watch():
            while True:
                peak["clients"] = max(peak["clients"], raw.info("clients")["connected_clients"])
                await asyncio.sleep(0)

        async def acquire_release(key):
            lease = await locks.acquire(key, 30)
            await asyncio.sleep(0)
            return lease.token == raw.get(key), await lease.release()

        watcher = asyncio.ensure_future(watch())
        leases = await asyncio.gather(*(locks.acquire(key, 30) for key in keys))
        assert [lease.key for lease in leases] == keys
        assert_held_in_redis(raw, leases)
        assert await asyncio.gather(*(lease.release() for lease in leases)) == [True] * tasks
        assert await asyncio.gather(*map(acquire_release, keys)) == [(True, True)] * tasks
        watcher.cancel()
        assert peak["clients"] - clients_before == 1
        assert opened(raw) - opened_before == 1
        await locks.close()
        assert await connected(raw, clients_before) <= clients_before

    aio.run(main, loop)
    assert stored(raw, aio) == []


def test_tasks_woken_by_one_read_each_go_on_in_their_own_task_and_context(aio, raw, loop):
    """The tasks a read wakes run their next steps right after it (no loop turn each):
    each still in its own task, with its own context variables."""
    mine: contextvars.ContextVar[int] = contextvars.ContextVar("mine")

    async def main():
        locks = aio.locks()

        async def pairs(i):
            mine.set(i)
            me = asyncio.current_task()
            for round in range(5):
                lease = await locks.acquire(aio.name(f"{i}:{round}"), 30)
                assert (mine.get(), asyncio.current_task()) == (i, me)
                assert await lease.release() is True
                assert (mine.get(), asyncio.current_task()) == (i, me)
            return i

        assert await asyncio.gather(*map(pairs, range(50))) == list(range(50))

    aio.run(main, loop)
    assert stored(raw, aio) == []


def acquired_together(locks, keys, loop, then):
    """Tasks acquire ``keys`` at once (their replies come in one read, or a few), then
    each calls ``then(i, lease)``. Runs ``loop`` until they are done, again if something
    left it (at most twice). Returns the tasks and how many times the loop was left."""

    async def acquire(i, key):
        return then(i, await locks.acquire(key, 30))

    async def start():
        return [asyncio.ensure_future(acquire(i, key)) for i, key in enumerate(keys)]

    async def until_done(tasks):
        await asyncio.wait(tasks, timeout=5)

    tasks = loop.run_until_complete(start())
    stops = 0
    while stops < 2:
        try:
            loop.run_until_complete(until_done(tasks))
            break
        except (SystemExit, KeyboardInterrupt):
            stops += 1
    return tasks, stops


def release_and_close(locks, tasks, loop):
    leases = [task.result() for task in tasks if task.done() and task.exception() is None]

    async def main():
        assert await asyncio.gather(*(lease.release() for lease in leases)) == [True] * len(leases)
        await locks.close()

    loop.run_until_complete(main())


def test_a_task_that_stops_the_loop_from_its_wake_up_strands_none_woken_with_it(aio, raw, loop):
    """SystemExit raised by one of the tasks a read woke leaves the loop, as asyncio and
    uvloop let it from a callback; the others that read woke go on."""

    def then(i, lease):
        if i == 3:
            raise SystemExit("stop")
        return lease

    event_loop = LOOPS[loop]()
    try:
        locks = aio.locks()
        tasks, stops = acquired_together(locks, aio.names(20), event_loop, then)
        assert stops == 1
        assert [task.done() for task in tasks] == [True] * 20
        assert isinstance(tasks[3].exception(), SystemExit)
        assert [tasks[i].result().key for i in range(20) if i != 3] == [
            aio.name(f"k{i}") for i in range(20) if i != 3
        ]
        release_and_close(locks, tasks, event_loop)
    finally:
        event_loop.close()
    assert stored(raw, aio) == [aio.name("k3").encode()]  # granted before its task stopped


def test_a_task_whose_wake_up_fails_is_reported_and_strands_none_woken_with_it(aio, raw):
    """A woken task's step that raises (here a Task whose wake-up does) reaches the loop's
    exception handler, as a failing callback's would; the others go on."""

    class Unwakeable(asyncio.tasks._PyTask):  # asyncio's Task in Python: its wake-up can be replaced
        def _Task__wakeup(self, future):
            raise RuntimeError("cannot wake")

    reported = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context.get("exception")))
    keys = aio.names(20)
    unwakeable = keys[3]

    async def start_unwakeable():
        return Unwakeable(locks.acquire(unwakeable, 30), loop=loop)

    try:
        locks = aio.locks()
        stuck = loop.run_until_complete(start_unwakeable())
        tasks, stops = acquired_together(locks, keys[:3] + keys[4:], loop, lambda i, lease: lease)
        assert stops == 0
        assert [task.done() for task in tasks] == [True] * 19
        assert not stuck.done()
        assert any(isinstance(e, RuntimeError) and str(e) == "cannot wake" for e in reported)
        release_and_close(locks, tasks, loop)
        stuck.get_coro().close()  # (it can never be woken: its call is given up here)
    finally:
        loop.close()
    assert stored(raw, aio) == [unwakeable.encode()]


def test_a_woken_task_may_run_the_loop_inside_itself_under_nest_asyncio(aio, raw):
    """nest_asyncio (as in Jupyter) lets a task's step run its loop again; a woken task
    that does so, to take another lock, finds the others woken with it going on. (In a
    forked child: nest_asyncio swaps asyncio's Task and Future for the whole process.)"""
    pytest.importorskip("nest_asyncio")
    inner = aio.name("inner")

    def child():
        import nest_asyncio

        loop = asyncio.new_event_loop()
        nest_asyncio.apply(loop)
        reported = []
        loop.set_exception_handler(lambda _, context: reported.append(context))

        def then(i, lease):
            if i == 0:
                assert loop.run_until_complete(locks.acquire(inner, 30)).key == inner
            return lease

        try:
            locks = aio.locks()
            warm = loop.run_until_complete(locks.acquire(aio.name("warm"), 30))  # the connection is open
            loop.run_until_complete(warm.release())
            tasks, stops = acquired_together(locks, aio.names(5), loop, then)
            assert stops == 0
            assert [task.result().key for task in tasks] == aio.names(5)
            release_and_close(locks, tasks, loop)
        finally:
            loop.close()
        assert reported == []  # (no connection lost on the way, its calls sent again)

    code, report = run_in_child(child)
    assert code == 0, report
    assert stored(raw, aio) == [inner.encode()]


def test_many_tasks_contending_on_one_key_hold_it_one_at_a_time(aio, raw, loop):
    contenders = 50
    witness = Counter()

    async def main():
        key = aio.name("contended")
        instances = [aio.locks() for _ in range(5)]  # as several workers would have
        checker = redis.asyncio.Redis.from_url(aio.url)

        async def contender(i):
            async with instances[i % len(instances)].lock(key, 10, wait=30) as lease:
                witness["inside"] += 1
                witness["most"] = max(witness["most"], witness["inside"])
                # its token, marked when others queue for it (their turns come by its release)
                assert await checker.get(key) in (lease.token, lease.token + MARK)
                await asyncio.sleep(0)
                assert await lease.extend(10) is True  # a round trip while holding it
                witness["inside"] -= 1
                witness["runs"] += 1

        try:
            await asyncio.gather(*map(contender, range(contenders)))
        finally:
            await checker.aclose()

    aio.run(main, loop)
    assert witness == Counter(most=1, runs=contenders, inside=0)
    assert stored(raw, aio) == []


def test_from_redis_reuses_a_redis_asyncio_clients_settings(aio, redis_server):
    async def main():
        client = redis.asyncio.Redis(port=redis_server.port, db=2, socket_timeout=2.5)
        try:
            locks = aio.cls.from_redis(client, prefix=aio.prefix)
            assert (locks.settings.db, locks.settings.socket_timeout) == (2, 2.5)
            lease = await locks.acquire(aio.name("from-redis"), 5)
            assert await client.get(lease.key) == lease.token
            assert await lease.release() is True
            await locks.close()
        finally:
            await client.aclose()

    aio.run(main)


# -- cancellation at every await point --------------------------------------------------------


def suspended_at(task):
    """The chain of coroutines a task is suspended in, outermost first."""
    coro = task.get_coro()
    if not hasattr(coro, "cr_code"):  # compiled without a code object, as uvloop's own coroutines
        return (type(coro).__name__,)
    # (Compiled coroutines, joblock's own in its compiled build, show their code and what
    # they await, but not their state: suspended, a coroutine awaits something.)
    if coro.cr_await is None and not coro.cr_running:
        return ("not started",)
    chain = []
    while coro is not None and hasattr(coro, "cr_code"):
        chain.append(coro.cr_code.co_name)
        coro = coro.cr_await
    return tuple(chain)


CANCELLED = object()


async def sweep(start, check, enough=2, limit=3000, at_cancel=None):
    """Cancels the call ``start(k)`` returns after k event-loop iterations, k = 0, 1, ...

    ``check(k, result)`` looks at each outcome (``CANCELLED`` or what the call returned);
    ``at_cancel(k)``, if given, looks at the moment of cancellation, before the loop turns.
    The sweep ends once the call finished before its cancellation ``enough`` times in a
    row. Returns where every task was suspended at the moments of cancellation.
    """
    stages: Counter[tuple[str, ...]] = Counter()
    finished = 0
    for k in range(limit):
        task = asyncio.ensure_future(await start(k))
        for _ in range(k):
            await asyncio.sleep(0)
        me = asyncio.current_task()
        stages.update(suspended_at(t) for t in asyncio.all_tasks() if t is not me)
        cancelled = task.cancel()
        if at_cancel is not None and cancelled:
            at_cancel(k)
        try:
            result = await task
        except asyncio.CancelledError:
            assert cancelled, "a call that had finished raised CancelledError"
            result = CANCELLED
        else:
            assert not cancelled, "a cancelled call returned a result"
        await check(k, result)
        finished = 0 if cancelled else finished + 1
        if finished == enough:
            return stages
    pytest.fail(f"the call never finished within {limit} loop iterations")


def waited_for_a_reply(stages):
    # The driver's run() awaits its operation's future from the moment the command is
    # written until its reply is parsed: a cancellation there came while the command
    # was on the wire, the moment a lost reply would leak a lock. (The tests' `undone`
    # and `in_flight` show that some came after Redis had acted.)
    return any(chain[-1:] == ("run",) for chain in stages)


def undone(caplog):
    """The locks given back because they were granted to a call cancelled meanwhile."""
    return [r for r in caplog.records if r.name == "joblock" and "stopped waiting" in r.getMessage()]


@pytest.mark.parametrize(("fresh", "fence"), [(True, False), (False, False), (False, True)])
def test_a_cancelled_acquire_leaves_no_lock_and_returns_no_lease(aio, raw, loop, fresh, fence, caplog):
    """``fresh``: each attempt opens its connection, so cancellation hits its awaits too."""
    caplog.set_level(logging.DEBUG, logger="joblock")

    async def main():
        locks = aio.locks()

        async def start(k):
            nonlocal locks
            if fresh:
                locks = aio.locks()
            else:  # a connection waits in the pool
                await (await locks.acquire(aio.name("warm"), 5)).release()
            return locks.acquire(aio.name(k), 30, fence=fence)

        async def check(k, lease):
            key = aio.name(k)
            await locks.close()
            if lease is CANCELLED:
                assert raw.get(key) is None
            else:
                assert raw.get(key) == lease.token
                assert await lease.release() is True

        return await sweep(start, check)

    stages = aio.run(main, loop)
    assert ("not started",) in stages
    assert waited_for_a_reply(stages)
    if fresh:
        assert any(chain[:1] == ("connect",) for chain in stages)  # the driver opening the connection
    assert undone(caplog)  # some cancellations came after Redis had granted the lock
    assert stored(raw, aio) == []


def test_a_cancelled_acquire_waiting_on_a_busy_lock_leaves_no_lock(aio, raw):
    async def main():
        locks, other = aio.locks(), aio.locks()
        releases = []

        async def start(k):
            key = aio.name(k)
            holder = await other.acquire(key, 30)

            # The task sweep() cancels (ensure_future gives it back as it is).
            waiter = asyncio.ensure_future(locks.acquire(key, 30, wait=5))

            async def release_soon():
                # Once the waiter has queued and parked (or was cancelled before it could),
                # and not after a fixed 2 ms, which a loaded machine may spend before its
                # first attempt's reply: the release then hands it the lock. A parked
                # waiter stays parked 2 ms more, many loop turns even under the
                # sanitizers, so that some of the sweep's cancellations find it there (a
                # release at once left it parked for a round trip's few turns, which a
                # sweep could step over).
                deadline = time.monotonic() + 10
                while not (waiter.done() or "park" in suspended_at(waiter)) and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)
                if not waiter.done():
                    await asyncio.sleep(0.002)
                return await holder.release()

            releases.append(asyncio.ensure_future(release_soon()))
            return waiter

        async def check(k, lease):
            key = aio.name(k)
            assert await releases[k] is True
            await locks.close()
            if lease is CANCELLED:
                assert raw.get(key) is None
            else:
                assert lease is not None
                assert raw.get(key) == lease.token
                assert await lease.release() is True

        return await sweep(start, check)

    stages = aio.run(main)
    assert any("park" in chain for chain in stages)  # queued, waiting for the hand-over
    assert waited_for_a_reply(stages)
    assert stored(raw, aio) == []


@pytest.mark.parametrize("operation", ["acquire_many", "dedupe"])
def test_a_cancelled_batch_acquire_leaves_no_lock(aio, raw, operation, caplog):
    n = 3 * WINDOW - 2  # three windows, two in flight at once
    caplog.set_level(logging.DEBUG, logger="joblock")

    async def main():
        locks = aio.locks(window=WINDOW)

        async def start(k):
            await (await locks.acquire(aio.name("warm"), 5)).release()
            if operation == "dedupe":
                return locks.dedupe(f"J{k}", [(i,) for i in range(n)], 30)
            return locks.acquire_many(aio.names(n, f"b{k}-"), 30)

        async def check(k, leases):
            await locks.close()
            if leases is CANCELLED:
                assert stored(raw, aio) == []
            else:
                assert len(leases) == n
                assert_held_in_redis(raw, leases)
                assert await locks.release_many(leases) == [True] * n

        return await sweep(start, check)

    stages = aio.run(main)
    assert waited_for_a_reply(stages)
    assert undone(caplog)
    assert stored(raw, aio) == []


@pytest.mark.parametrize("operation", ["release", "release_many"])
@pytest.mark.parametrize("taken", [False, True], ids=["ours", "taken"])
def test_a_cancelled_release_leaves_the_lease_truthful(aio, raw, operation, taken):
    in_flight = []

    async def main():
        locks, other = aio.locks(), aio.locks()
        leases, theirs = [], []

        async def start(k):
            lease = await locks.acquire(aio.name(k), 30)
            leases.append(lease)
            if taken:  # an operator's DEL, then another holder
                raw.delete(lease.key)
                theirs.append(await other.acquire(lease.key, 30))
            return lease.release() if operation == "release" else locks.release_many([lease])

        def at_cancel(k):
            lease = leases[k]
            ours = raw.get(lease.key) == lease.token
            if not lease.held:
                assert not ours
            elif not ours and not taken:
                in_flight.append(k)  # done in Redis, its reply not read yet

        async def check(k, result):
            lease = leases[k]
            if result is not CANCELLED:
                expected = not taken
                assert result == (expected if operation == "release" else [expected])
            await locks.close()
            if k == 0:  # cancelled before it began: nothing was sent, nothing learnt
                assert lease.held is True
                assert await lease.release() is not taken
            else:  # once begun, carried out, and the lease says what Redis did
                assert lease.held is False
                assert raw.get(lease.key) != lease.token
            if taken:
                assert raw.get(lease.key) == theirs[k].token
                assert await theirs[k].release() is True
            assert raw.exists(lease.key) == 0

        return await sweep(start, check, at_cancel=at_cancel)

    stages = aio.run(main)
    assert waited_for_a_reply(stages)
    assert in_flight or taken
    assert stored(raw, aio) == []


@pytest.mark.parametrize("operation", ["extend", "extend_many"])
@pytest.mark.parametrize("gone", [False, True], ids=["ours", "gone"])
def test_a_cancelled_extend_leaves_the_lease_truthful(aio, raw, operation, gone):
    async def main():
        locks = aio.locks()
        leases = []

        async def start(k):
            lease = await locks.acquire(aio.name(k), 30)
            leases.append(lease)
            if gone:
                raw.delete(lease.key)
            return lease.extend(60) if operation == "extend" else locks.extend_many([lease], 60)

        async def check(k, result):
            lease = leases[k]
            if result is not CANCELLED:
                assert result == (not gone if operation == "extend" else [not gone])
            await locks.close()
            if k == 0:  # cancelled before it began: nothing was sent, nothing learnt
                assert lease.held is True
                if not gone:
                    assert raw.pttl(lease.key) <= 30_000
            else:  # once begun, carried out, and the lease says what Redis did
                assert lease.held == (raw.get(lease.key) == lease.token)
                assert lease.held is not gone
                if not gone:
                    assert raw.pttl(lease.key) > 30_000
            if not gone:
                assert await lease.release() is True

        return await sweep(start, check)

    stages = aio.run(main)
    assert waited_for_a_reply(stages)
    assert stored(raw, aio) == []


def test_timed_out_waiters_leave_no_lock_and_one_takes_it(aio, raw):
    """``asyncio.wait_for`` around waiting acquires: each timeout is a cancellation."""

    async def main():
        locks, other = aio.locks(), aio.locks()
        key = aio.name("timeouts")
        holder = await other.acquire(key, 30)

        async def waiter(timeout):
            try:
                return await asyncio.wait_for(locks.acquire(key, 30, wait=10), timeout)
            except asyncio.TimeoutError:
                return None

        async def release_soon():
            await asyncio.sleep(0.15)
            return await holder.release()

        released, *leases = await asyncio.gather(release_soon(), *(waiter(0.05 * i) for i in range(1, 11)))
        assert released is True
        got = [lease for lease in leases if lease is not None]
        assert len(got) == 1  # the others timed out, before the release or behind the winner
        await locks.close()
        assert raw.get(key) == got[0].token
        assert await got[0].release() is True

    aio.run(main)
    assert stored(raw, aio) == []


# -- the job decorator on async def --------------------------------------------------------


def job_messages(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.name == "joblock" and r.levelno == level]


def test_async_jobs_lock_per_argument_set(aio, raw):
    async def main():
        locks = aio.locks()
        seen = []

        @locks.job(ttl=5, name="ProductSalesJob")
        async def fetch(product_id, currency="EUR"):
            lease = current_lease()
            seen.append(lease)
            assert raw.get(lease.key) == lease.token
            await asyncio.sleep(0)
            return product_id

        assert fetch.lock_key(7) == locks.key("ProductSalesJob", 7, "EUR")
        assert await fetch(7) == 7
        assert seen[0].key == fetch.lock_key(7)
        assert seen[0].held is False
        assert raw.exists(seen[0].key) == 0

        @locks.job(ttl=5)
        async def failing(x):
            raise ValueError(x)

        with pytest.raises(ValueError):
            await failing(1)
        assert raw.exists(failing.lock_key(1)) == 0

    aio.run(main)
    assert stored(raw, aio) == []


def test_async_job_on_locked_skip_raise_and_callables(aio, caplog):
    caplog.set_level(logging.INFO, logger="joblock")

    async def main():
        locks = aio.locks()
        calls = []

        def busy_sync(x, flag=False):
            calls.append(("sync", x, flag))
            return "busy"

        async def busy_async(x, flag=False):
            await asyncio.sleep(0)
            calls.append(("async", x, flag))
            return "requeued"

        results = {}
        for mode in ("skip", "raise", busy_sync, busy_async):

            @locks.job(ttl=5, name="J", on_locked=mode)
            async def job(x, flag=False):
                return "ran"

            holder = await locks.acquire(job.lock_key(1, flag=True), 5)
            try:
                if mode == "raise":
                    with pytest.raises(LockNotAcquired):
                        await job(1, flag=True)
                else:
                    results[getattr(mode, "__name__", mode)] = await job(1, flag=True)
                assert await job(2) == "ran"
            finally:
                await holder.release()
        assert results == {"skip": None, "busy_sync": "busy", "busy_async": "requeued"}
        assert calls == [("sync", 1, True), ("async", 1, True)]

    aio.run(main)
    assert job_messages(caplog) == ["Job already running: J with 1, flag=True"]


def test_async_job_with_wait_runs_once_the_holder_releases(aio):
    async def main():
        locks = aio.locks()

        @locks.job(ttl=5, wait=5)
        async def patient(x):
            return "ran"

        holder = await locks.acquire(patient.lock_key(1), 5)
        waiting = asyncio.ensure_future(patient(1))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await holder.release()
        assert await waiting == "ran"

    aio.run(main)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_async_job_on_expired(aio, raw, flavour):
    expired = []

    def on_expired_sync(x):
        expired.append(x)

    async def on_expired_async(x):
        await asyncio.sleep(0)
        expired.append(x)

    async def main():
        locks = aio.locks()
        hook = on_expired_sync if flavour == "sync" else on_expired_async

        @locks.job(ttl=0.1, on_expired=hook)
        async def slow(x):
            await asyncio.sleep(0.25)
            return "done"

        @locks.job(ttl=5, on_expired=hook)
        async def quick(x):
            return "done"

        assert await slow(1) == "done"
        assert await quick(2) == "done"

    aio.run(main)
    assert expired == [1]


def renewer_tasks():
    return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "AsyncRenewer._run"]


def test_auto_renew_keeps_locks_alive_past_their_ttl_from_one_task(aio, raw, loop):
    jobs = 5
    samples = []
    expired = []

    async def main():
        locks = aio.locks()
        started = asyncio.Event()
        finish = asyncio.Event()
        running = []

        # A ttl of 0.9 s, renewed every 0.3 s: at 0.3 s a loaded machine's stalls of a
        # few tenths of a second lost the locks.
        @locks.job(ttl=0.9, auto_renew=True, on_expired=expired.append)
        async def long_job(i):
            running.append(current_lease())
            if len(running) == jobs:
                started.set()
            await finish.wait()
            return current_lease()

        tasks = [asyncio.ensure_future(long_job(i)) for i in range(jobs)]
        await started.wait()
        end = time.monotonic() + 3.0  # over three ttls
        # At least 11 samples however slow a loaded machine runs them.
        while time.monotonic() < end or len(samples) <= 10:
            # redis-py blocks: in a thread, not on the loop whose renewer must run meanwhile
            # (ten blocking round trips on a loaded machine outlasted a renewal's 0.1 s).
            held = await asyncio.to_thread(
                lambda: [raw.get(lease.key) == lease.token and raw.pttl(lease.key) > 0 for lease in running]
            )
            samples.append((all(held), len(renewer_tasks())))
            await asyncio.sleep(0.05)
        finish.set()
        leases = await asyncio.gather(*tasks)
        assert all(lease.held is False for lease in leases)
        for _ in range(100):  # with nothing left to renew, the task ends
            if not renewer_tasks():
                break
            await asyncio.sleep(0.01)
        assert renewer_tasks() == []

    aio.run(main, loop)
    assert set(samples) == {(True, 1)}
    assert expired == []
    assert stored(raw, aio) == []


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_on_lost_when_the_key_is_deleted(aio, raw, caplog, flavour):
    lost_args = []
    expired = []

    async def main():
        locks = aio.locks()
        lost = asyncio.Event()

        def on_lost_sync(*args, **kwargs):
            lost_args.append((args, kwargs))
            lost.set()

        async def on_lost_async(*args, **kwargs):
            await asyncio.sleep(0)
            on_lost_sync(*args, **kwargs)

        # A ttl long enough for a renewal to find the key gone before the lease's
        # deadline passes on a busy machine: lost by its deadline, it would still say held.
        @locks.job(
            ttl=1.5,
            auto_renew=True,
            on_lost=on_lost_sync if flavour == "sync" else on_lost_async,
            on_expired=lambda *a, **k: expired.append(a),
        )
        async def long_job(x, flag=False):
            lease = current_lease()
            raw.delete(lease.key)  # `joblock release`, or an operator's DEL
            await asyncio.wait_for(lost.wait(), 3)
            assert lease.held is False
            return "finished"

        assert await long_job(4, flag=True) == "finished"

    aio.run(main)
    assert lost_args == [((4,), {"flag": True})]
    assert expired == [(4,)]
    assert len([m for m in job_messages(caplog, logging.WARNING) if "lost the lock" in m]) == 1


def test_a_slow_failing_async_on_lost_holds_up_no_other_renewal(aio, raw, caplog):
    async def main():
        locks = aio.locks()
        lost = asyncio.Event()

        async def on_lost(x):
            lost.set()
            await asyncio.sleep(3)  # two ttls of the other lock
            raise RuntimeError("the alerting hook broke")

        # ttls of 1.5 s, renewed every 0.5 s: at 0.9 s (every 0.3 s) a machine loaded by
        # other processes stalled the pure build's loop past its lease.
        @locks.job(ttl=1.5, auto_renew=True, on_lost=on_lost)
        async def doomed(x):
            raw.delete(current_lease().key)
            await asyncio.wait_for(lost.wait(), 5)

        @locks.job(ttl=1.5, auto_renew=True)
        async def survivor(x):
            lease = current_lease()
            await doomed(1)
            await asyncio.sleep(4)  # over two ttls, the hook's failure among them
            return raw.get(lease.key) == lease.token

        assert await survivor(2) is True

    aio.run(main)
    assert stored(raw, aio) == []
    assert "on_lost callback failed" in caplog.text


def test_current_lease_belongs_to_each_task(aio):
    async def main():
        locks = aio.locks()
        assert current_lease() is None

        @locks.job(ttl=5, name="Inner")
        async def inner():
            return current_lease().key

        @locks.job(ttl=5)
        async def job(x):
            mine = current_lease()
            assert mine.key == job.lock_key(x)
            for _ in range(3):
                await asyncio.sleep(0)  # the other tasks run in between
                assert current_lease() is mine
            if x == 0:
                assert await inner() == locks.key("Inner")
            assert current_lease() is mine
            return mine

        leases = await asyncio.gather(*(job(x) for x in range(5)))
        assert [lease.key for lease in leases] == [job.lock_key(x) for x in range(5)]
        assert current_lease() is None

    aio.run(main)


def test_job_cancelled_while_running_releases_its_lock(aio, raw):
    async def main():
        locks = aio.locks()
        inside = asyncio.Event()

        @locks.job(ttl=30, auto_renew=True)
        async def long_job(x):
            inside.set()
            await asyncio.sleep(30)

        task = asyncio.ensure_future(long_job(1))
        await inside.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await locks.close()
        assert raw.exists(long_job.lock_key(1)) == 0

    aio.run(main)


def test_locks_made_at_import_serve_one_asyncio_run_after_another(aio, raw, loop):
    """A worker that runs each async job with asyncio.run, its AsyncLocks made at import."""
    locks = aio.cls(aio.url, prefix=aio.prefix, socket_timeout=10)
    renewed = []

    # A ttl of 1 s, renewed every 1/3 s: at 0.5 s, a machine loaded by other processes
    # stalled a new loop's first connections past its first renewal and lost the lock.
    @locks.job(ttl=1, auto_renew=True)
    async def job(i):
        lease = current_lease()
        await asyncio.gather(*(locks.acquire(aio.name(f"{i}-{j}"), 30) for j in range(4)))
        await asyncio.sleep(1.1)  # over a ttl: renewed on this loop's renewer task
        renewed.append(raw.get(lease.key) == lease.token)
        return i

    async def run(i):
        started = time.monotonic()
        assert await asyncio.wait_for(job(i), 20) == i
        return time.monotonic() - started

    for i in range(3):
        assert run_on(run(i), LOOPS[loop]) < 10  # no stale connection waited out (10 s)
    assert renewed == [True] * 3
    assert len(stored(raw, aio)) == 12  # the jobs' inner locks, never released
    raw.delete(*stored(raw, aio))
    run_on(locks.close(), LOOPS[loop])


def test_the_decorator_matches_functions_to_their_locks(aio, core, redis_server):
    locks = aio.cls(redis_server.url, prefix=aio.prefix)  # made outside a loop: no I/O here
    with pytest.raises(TypeError, match="AsyncLocks"):
        locks_class(core)(redis_server.url).job(ttl=5)(_async_job)
    with pytest.raises(TypeError, match="Locks for plain"):
        locks.job(ttl=5)(_plain_job)
    with pytest.raises(TypeError, match="generators"):
        locks.job(ttl=5)(_async_generator_job)
    with pytest.raises(ValueError, match="ttl"):
        locks.job(ttl=0)
    with pytest.raises(ValueError, match="on_locked"):
        locks.job(ttl=5, on_locked="retry")


async def _async_job():
    pass


def _plain_job():
    pass


async def _async_generator_job():
    yield
