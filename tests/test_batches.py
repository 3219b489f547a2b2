"""Batches: acquire_many, dedupe, release_many and extend_many, pipelined in windows.

Small windows (``window=7``) make a few dozen keys cross many window boundaries. A
loopback proxy that cuts the connection after so many reply bytes shows that a retried
window neither grants a lock twice nor leaks one.
"""

from __future__ import annotations

import gc
import itertools
import time
import tracemalloc

import pytest
import redis

import joblock
from helpers import assert_counted_once, wait_expired
from joblock._tools.servers import RedisServer
from rig.faults import FaultProxy

WINDOW = 7


@pytest.fixture
def small(make_locks):
    """Locks whose batches go out 7 commands to a window."""
    return make_locks(window=WINDOW)


def name(locks, suffix):
    return f"{locks.prefix}:{suffix}"


def names(locks, n, tag="k"):
    return [name(locks, f"{tag}{i}") for i in range(n)]


def stored(raw, locks):
    return sorted(raw.scan_iter(match=f"*{locks.prefix}:*", count=1000))


def is_compiled(core):
    return core.__name__.endswith("_core_c")


def assert_held_in_redis(raw, leases):
    """Every lease's key holds exactly its token (one MGET per 1000 keys)."""
    leases = [lease for lease in leases if lease is not None]
    for start in range(0, len(leases), 1000):
        chunk = leases[start : start + 1000]
        assert raw.mget([lease.key for lease in chunk]) == [lease.token for lease in chunk]


# -- acquire_many ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW, 2 * WINDOW + 1, 100])
def test_acquire_many_keeps_the_order_across_windows(small, raw, n):
    keys = names(small, n)
    leases = small.acquire_many(iter(keys), 30)
    assert [lease.key for lease in leases] == keys
    assert_held_in_redis(raw, leases)
    assert small.release_many(leases) == [True] * n
    assert stored(raw, small) == []


def test_acquire_many_gives_none_where_someone_else_holds_the_key(small, make_locks):
    keys = names(small, 60)
    other = make_locks()
    held = other.acquire_many(keys[::3], 30)
    leases = small.acquire_many(keys, 30)
    assert [lease is None for lease in leases] == [i % 3 == 0 for i in range(60)]
    assert other.release_many(held) == [True] * 20
    assert small.release_many(leases) == [i % 3 != 0 for i in range(60)]


@pytest.mark.parametrize("gap", [1, WINDOW - 1, WINDOW, 3 * WINDOW + 2])
def test_the_same_key_twice_in_one_call_first_wins(small, raw, gap):
    keys = names(small, gap)
    keys.append(keys[0])
    leases = small.acquire_many(keys, 30)
    assert leases[0] is not None
    assert leases[-1] is None
    assert raw.get(keys[0]) == leases[0].token
    small.release_many(leases)


def test_acquire_many_keeps_str_and_bytes_keys_as_given(small, raw):
    keys = [name(small, "s"), name(small, "b").encode(), name(small, "é")]
    leases = small.acquire_many(keys, 30)
    assert [lease.key for lease in leases] == keys
    assert_held_in_redis(raw, leases)
    small.release_many(leases)


def test_a_generator_of_20k_keys_with_the_default_window(locks, raw):
    n = 20_000
    leases = locks.acquire_many((name(locks, f"big{i}") for i in range(n)), 60)
    assert len(leases) == n
    assert all(lease is not None for lease in leases)
    assert len({lease.token for lease in leases}) == n
    assert raw.dbsize() >= n
    assert locks.acquire_many([name(locks, "big0"), name(locks, f"big{n - 1}")], 60) == [None, None]
    assert locks.release_many(iter(leases)) == [True] * n
    assert stored(raw, locks) == []


@pytest.mark.parametrize("fence", [False, True])
def test_acquire_many_writes_the_tokens_with_the_ttl(small, raw, fence):
    leases = small.acquire_many(names(small, 20), 4, fence=fence)
    assert_held_in_redis(raw, leases)
    for lease in leases:
        assert 3000 < raw.pttl(lease.key) <= 4000
    small.release_many(leases)


# -- fencing in batches -----------------------------------------------------------------


def test_acquire_many_with_fence_numbers_each_grant(small, raw):
    keys = names(small, 30)
    first = small.acquire_many(keys, 30, fence=True)
    assert all(lease.fence >= 1 for lease in first)
    assert small.release_many(first[::2]) == [True] * 15
    second = small.acquire_many(keys, 30, fence=True)
    assert [lease is None for lease in second] == [False, True] * 15
    assert all(again.fence > before.fence for before, again in zip(first[::2], second[::2]))
    assert raw.mget(keys[::2]) == [lease.token for lease in second[::2]]
    small.release_many(first + second)


def test_dedupe_with_fence_numbers_each_grant(small):
    tuples = [(i,) for i in range(20)]
    first = small.dedupe("FencedJob", tuples, 30, fence=True)
    assert_counted_once(first)
    small.release_many(first)
    second = small.dedupe("FencedJob", tuples, 30, fence=True)
    assert all(again.fence > before.fence for before, again in zip(first, second))
    small.release_many(second)


# -- dedupe ---------------------------------------------------------------------------


def test_dedupe_keys_are_the_keys_of_locks_key(small, raw):
    tuples = [(1,), ("a-b",), ("a", "b"), (None, 2.5), ([1, 2], {"k": "v"}), (b"\x00",), (), ("x" * 300,)]
    leases = small.dedupe("ProductSalesJob", tuples, 30)
    assert [lease.key for lease in leases] == [small.key("ProductSalesJob", *args) for args in tuples]
    assert_held_in_redis(raw, leases)
    small.release_many(leases)


def test_dedupe_gives_none_for_duplicates_in_order(small, make_locks):
    other = make_locks()
    held = other.acquire(small.key("ProductSalesJob", 3), 30)
    tuples = [(i % 10,) for i in range(40)]  # 0..9 four times
    leases = small.dedupe("ProductSalesJob", iter(tuples), 30)
    assert [lease is not None for lease in leases] == [i < 10 and i != 3 for i in range(40)]
    assert small.release_many(leases).count(True) == 9
    assert held.release() is True


@pytest.mark.parametrize(("job", "tuples", "error", "where"), [
    (5, [(1,)], TypeError, "job"),
    ("", [(1,)], ValueError, "job"),
    ("J", [5], TypeError, r"arg_tuples\[0\]"),
    ("J", [(1,), (object(),)], TypeError, r"arg_tuples\[1\]"),
])  # fmt: skip
def test_dedupe_rejects_bad_input_before_sending_it(small, raw, job, tuples, error, where):
    with pytest.raises(error, match=where):
        small.dedupe(job, tuples, 30)
    assert stored(raw, small) == []


# -- bad input mid-batch ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [5, None, b"", "\ud800"])
def test_a_bad_key_after_some_windows_raises_and_leaves_no_lock(small, raw, bad):
    keys = [*names(small, 25), bad, *names(small, 4, "after")]
    with pytest.raises((TypeError, ValueError), match=r"keys\[25\]"):
        small.acquire_many(iter(keys), 30)
    assert stored(raw, small) == []


def test_a_bad_tuple_after_some_windows_raises_and_leaves_no_lock(small, raw):
    tuples = [*((i,) for i in range(25)), 5, (26,)]
    with pytest.raises(TypeError, match=r"arg_tuples\[25\]"):
        small.dedupe("J", iter(tuples), 30)
    assert stored(raw, small) == []


def test_a_failing_generator_raises_and_leaves_no_lock(small, raw):
    def keys():
        yield from names(small, 25)
        raise RuntimeError("the scheduler broke")

    with pytest.raises(RuntimeError, match="scheduler"):
        small.acquire_many(keys(), 30, fence=True)
    assert stored(raw, small) == []


def test_a_bad_lease_after_some_windows_leaves_held_in_step_with_redis(small, raw):
    leases = small.acquire_many(names(small, 30), 30)
    with pytest.raises(TypeError, match=r"leases\[25\]"):
        small.release_many([*leases[:25], "not a lease", *leases[25:]])
    for lease in leases:
        assert lease.held == (raw.get(lease.key) == lease.token)
    small.release_many(leases)
    assert stored(raw, small) == []


@pytest.mark.parametrize(("ttl", "error"), [(0, ValueError), ("5", TypeError), (float("nan"), ValueError)])
def test_batch_ttl_is_checked_before_anything_is_sent(small, raw, ttl, error):
    with pytest.raises(error, match="ttl"):
        small.acquire_many(names(small, 3), ttl)
    with pytest.raises(error, match="ttl"):
        small.dedupe("J", [(1,)], ttl)
    leases = small.acquire_many(names(small, 3), 30)
    with pytest.raises(error, match="ttl"):
        small.extend_many(leases, ttl)
    assert small.release_many(leases) == [True] * 3


# -- release_many and extend_many -----------------------------------------------------


def test_release_many_skips_none_entries(small, raw):
    leases = small.acquire_many(names(small, 20), 30)
    mixed = list(itertools.chain.from_iterable((lease, None) for lease in leases))
    assert small.release_many(iter(mixed)) == [True, False] * 20
    assert all(lease.held is False for lease in leases)
    assert small.release_many(mixed) == [False] * 40
    assert stored(raw, small) == []


def test_release_many_gives_false_for_locks_that_expired(small, raw):
    keys = names(small, 30)
    short = small.acquire_many(keys[::2], 0.1)
    long = small.acquire_many(keys[1::2], 30)
    wait_expired(raw, *keys[::2])
    taken = small.acquire(keys[0], 30)  # someone took an expired one: never deleted
    interleaved = list(itertools.chain.from_iterable(zip(short, long)))
    assert small.release_many(interleaved) == [False, True] * 15
    assert raw.get(keys[0]) == taken.token
    assert taken.release() is True
    assert stored(raw, small) == []


def test_extend_many_resets_the_ttl_of_what_is_still_ours(small, raw):
    keys = names(small, 30)
    short = small.acquire_many(keys[:15], 0.1)
    long = small.acquire_many(keys[15:], 1)
    wait_expired(raw, *keys[:15])
    assert small.extend_many([*short, None, *long], 60) == [False] * 16 + [True] * 15
    assert [lease.held for lease in short + long] == [False] * 15 + [True] * 15
    for lease in long:
        assert raw.pttl(lease.key) > 50_000
    assert small.release_many(long) == [True] * 15


def test_release_many_rejects_what_is_not_a_lease(small):
    with pytest.raises(TypeError, match=r"leases\[1\]"):
        small.release_many([None, "lease"])
    with pytest.raises(TypeError, match=r"leases\[0\]"):
        small.extend_many([object()], 30)


# -- scripts flushed between batches ------------------------------------------------------


def test_batches_reload_scripts_after_script_flush(small, raw):
    keys = names(small, 40)
    raw.script_flush()
    fenced = small.acquire_many(keys[:20], 30, fence=True)
    assert all(lease.fence >= 1 for lease in fenced)
    plain = small.acquire_many(keys[20:], 30)
    raw.script_flush()
    assert small.extend_many(plain, 60) == [True] * 20
    raw.script_flush()
    assert small.release_many(fenced + plain) == [True] * 40
    assert stored(raw, small) == []


# -- error replies mid-batch ------------------------------------------------------------


def test_an_error_reply_mid_batch_raises_batch_error_and_releases_the_grants(small, raw):
    keys = names(small, 40)
    raw.rpush(keys[20], "not a lock")  # the fenced script's GET fails with WRONGTYPE
    with pytest.raises(joblock.BatchError) as info:
        small.acquire_many(keys, 30, fence=True)
    # Windows of 7: 0-19 granted, 20 failed, 21-27 were in flight and granted too; and
    # 28-34 when the caller had them ready while the WRONGTYPE was probed (a counting
    # lock's key would have been a LimitMismatchError).
    error = info.value
    assert error.granted in (27, 34)
    assert error.unreleased == 0
    assert f"{error.granted} locks had been granted: {error.granted} released, 0 not" in str(error)
    assert type(error.__cause__) is joblock.WrongTypeError
    assert "WRONGTYPE" in error.__cause__.message
    assert error.__cause__.key == keys[20].encode()
    left = stored(raw, small)
    assert left == [keys[20].encode()]


@pytest.fixture(scope="module")
def oom_server():
    with RedisServer("--maxmemory-policy", "noeviction") as server:
        yield server


@pytest.mark.parametrize("fence", [False, True])
def test_out_of_memory_mid_batch_raises_batch_error_and_releases_the_grants(make_locks, oom_server, fence):
    locks = make_locks(oom_server.url, window=WINDOW)
    client = redis.Redis.from_url(oom_server.url)
    keys = names(locks, 60)

    def keys_then_oom():
        for i, key in enumerate(keys):
            if i == 3 * WINDOW:
                # Windows 0-2 are on the wire; once Redis has run them, it runs out of memory.
                deadline = time.monotonic() + 10
                while not client.exists(keys[i - 1]):
                    assert time.monotonic() < deadline, "window 2 never ran"
                    time.sleep(0.001)
                client.config_set("maxmemory", 1)
            yield key

    try:
        with pytest.raises(joblock.BatchError) as info:
            locks.acquire_many(keys_then_oom(), 30, fence=fence)
    finally:
        client.config_set("maxmemory", 0)
    assert (info.value.granted, info.value.unreleased) == (3 * WINDOW, 0)
    assert f"{3 * WINDOW} locks had been granted" in str(info.value)
    assert "OOM" in str(info.value.__cause__)
    assert client.exists(*keys) == 0
    assert locks.release_many([]) == []
    client.close()


# -- dropped connections ----------------------------------------------------------------


@pytest.fixture
def proxy_to(redis_server):
    made = []

    def make(after, cuts=1):
        proxy = FaultProxy(redis_server.port, after, cuts)
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.close()


N = 3000


def contested_keys(locks, other):
    """3000 fresh keys, every tenth held by ``other``, then the first 500 again."""
    keys = names(locks, N)
    held = other.acquire_many(keys[::10], 60)
    return [*keys, *keys[:500]], held


@pytest.mark.parametrize("cuts", [1, 3])
@pytest.mark.parametrize("fence", [False, True])
def test_a_dropped_connection_mid_batch_grants_each_lock_exactly_once(make_locks, proxy_to, raw, cuts, fence):
    proxy = proxy_to(after=4001, cuts=cuts)  # about 800 replies into each connection
    locks = make_locks(proxy.url, window=100)
    other = make_locks()
    keys, held = contested_keys(locks, other)
    leases = locks.acquire_many(keys, 60, fence=fence)
    assert proxy.cut == cuts
    expected = [i < N and i % 10 != 0 for i in range(len(keys))]
    assert [lease is not None for lease in leases] == expected
    assert_held_in_redis(raw, leases)
    if fence:
        granted = [lease for lease in leases if lease is not None]
        assert_counted_once(granted)
    assert locks.release_many(leases) == expected
    assert other.release_many(held) == [True] * len(held)
    assert stored(raw, locks) == []


def test_a_dropped_connection_mid_dedupe_grants_each_lock_exactly_once(make_locks, proxy_to, raw):
    proxy = proxy_to(after=2501)
    locks = make_locks(proxy.url, window=50)
    tuples = [(i % 1000,) for i in range(1500)]
    leases = locks.dedupe("J", tuples, 60)
    assert proxy.cut == 1
    assert [lease is not None for lease in leases] == [i < 1000 for i in range(1500)]
    assert_held_in_redis(raw, leases)
    assert locks.release_many(leases).count(True) == 1000
    assert stored(raw, locks) == []


@pytest.mark.parametrize("operation", ["release_many", "extend_many"])
def test_a_dropped_connection_mid_release_or_extend_is_retried(make_locks, proxy_to, raw, operation):
    proxy = proxy_to(after=None)
    locks = make_locks(proxy.url, window=100)
    leases = locks.acquire_many(names(locks, N), 30)
    proxy.cut_after(4 * 600 + 1)  # the script's replies are 4 bytes: 600 replies into the batch
    if operation == "release_many":
        assert locks.release_many(leases) == [True] * N
        assert stored(raw, locks) == []
    else:
        assert locks.extend_many(leases, 60) == [True] * N
        assert_held_in_redis(raw, leases)
        assert all(raw.pttl(lease.key) > 50_000 for lease in leases[::100])
        assert locks.release_many(leases) == [True] * N
    assert proxy.cut == 1


def test_when_retries_run_out_the_batch_error_releases_what_was_granted(make_locks, proxy_to, raw):
    proxy = proxy_to(after=None)
    locks = make_locks(proxy.url, window=10)  # windows that complete between cuts, in both dialects
    locks.acquire_many(names(locks, 1), 60)[0].release()  # what the server speaks is known
    proxy.cut_after(1001, cuts=4)  # one cut more than the 3 retries
    with pytest.raises(joblock.BatchConnectionError) as info:
        locks.acquire_many(names(locks, N), 60)
    error = info.value
    assert isinstance(error, joblock.ConnectionError)
    assert isinstance(error.__cause__, joblock.ConnectionError)
    assert error.unreleased == 0
    assert error.granted > 0
    assert f"{error.granted} locks had been granted" in str(error)
    # Only the two windows in flight at the last cut may be left; they expire at their ttl.
    assert len(stored(raw, locks)) <= 2 * 10


# -- memory -----------------------------------------------------------------------------


def test_bytes_per_held_lease(locks, core):
    n = 20_000
    keys = names(locks, n)
    locks.acquire_many(keys[:1], 60)[0].release()  # the connection exists before measuring
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        leases = locks.acquire_many(keys, 60)
        per_lease = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    print(f"\n{core.__name__}: {per_lease:.0f} bytes per held lease (token {len(leases[0].token)} bytes)")
    assert locks.release_many(leases) == [True] * n
    if is_compiled(core):
        assert per_lease < 400
