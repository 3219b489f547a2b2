"""The single-lock API: acquire, lock(), release, extend, remaining, fencing, tokens, keys.

Every test runs once per core twin (the ``core`` fixture behind ``locks``/``make_locks``)
against the session's real redis-server.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
from datetime import timedelta

import pytest
import redis
from redis.crc import key_slot

import joblock
from conftest import locks_class
from helpers import wait_expired

# 128 random bits as 32 lowercase hex digits, then "@host:pid".
TOKEN = re.compile(rb"([0-9a-f]{32})@([^:@]+):(\d+)")


@pytest.fixture
def raw(redis_server):
    """A redis-py client on the same server, to look at what joblock wrote."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def name(locks, suffix):
    """A lock key under this test's prefix."""
    return f"{locks.prefix}:{suffix}"


def stored(raw, locks):
    """Every key in Redis under this test's prefix (fence counters included)."""
    return sorted(raw.scan_iter(match=f"*{locks.prefix}:*"))


# -- acquire and release ----------------------------------------------------------------


def test_acquire_returns_a_lease_then_none_while_held(locks, lease_type):
    key = name(locks, "a")
    lease = locks.acquire(key, 5)
    assert type(lease) is lease_type
    assert lease.key == key
    assert lease.held is True
    assert lease.fence is None
    assert locks.acquire(key, 5) is None
    assert lease.release() is True
    assert lease.held is False
    again = locks.acquire(key, 5)
    assert again is not None
    assert again.release() is True


def test_bytes_key_is_kept_as_given(locks, raw):
    key = name(locks, "bytes\xff").encode("latin-1")
    lease = locks.acquire(key, 5)
    assert lease.key == key
    assert raw.get(key) == lease.token
    assert lease.release() is True


def test_lock_context_manager_holds_the_lock_for_the_block(locks, raw):
    key = name(locks, "with")
    with locks.lock(key, 5) as lease:
        assert raw.get(key) == lease.token
        assert locks.acquire(key, 5) is None
    assert lease.held is False
    assert raw.exists(key) == 0


def test_lock_raises_lock_not_acquired_when_busy(locks):
    key = name(locks, "busy")
    holder = locks.acquire(key, 5)
    with pytest.raises(joblock.LockNotAcquired) as info, locks.lock(key, 5):
        pytest.fail("the block must not run")
    assert info.value.key == key
    assert isinstance(info.value, joblock.JoblockError)
    assert holder.release() is True


def test_lock_releases_when_the_block_raises(locks, raw):
    key = name(locks, "raises")
    with pytest.raises(RuntimeError), locks.lock(key, 5):
        raise RuntimeError("job failed")
    assert raw.exists(key) == 0


def test_lock_logs_a_warning_when_the_lock_expired_inside_the_block(locks, raw, caplog):
    key = name(locks, "expired-inside")
    with caplog.at_level(logging.WARNING, logger="joblock"), locks.lock(key, 0.05):
        wait_expired(raw, key)
    assert "expired or was taken" in caplog.text


def test_release_returns_false_after_expiry(locks, raw):
    lease = locks.acquire(name(locks, "expiry"), 0.1)
    wait_expired(raw, lease.key)
    assert lease.release() is False
    assert lease.held is False


def test_release_twice_returns_false_the_second_time(locks):
    lease = locks.acquire(name(locks, "twice"), 5)
    assert lease.release() is True
    assert lease.release() is False


def test_release_never_deletes_another_holders_lock(locks, make_locks, raw):
    key = name(locks, "taken")
    first = locks.acquire(key, 0.1)
    wait_expired(raw, key)
    second = make_locks().acquire(key, 5)
    assert second is not None
    assert first.release() is False
    assert first.extend(5) is False
    assert raw.get(key) == second.token
    assert second.release() is True


# -- extend and remaining -------------------------------------------------------------


def test_extend_resets_the_ttl_while_the_lock_is_ours(locks, raw):
    key = name(locks, "extend")
    lease = locks.acquire(key, 1)
    assert lease.extend(30) is True
    assert 20_000 < raw.pttl(key) <= 30_000
    assert lease.held is True
    assert lease.release() is True


def test_extend_returns_false_after_expiry(locks, raw):
    key = name(locks, "extend-late")
    lease = locks.acquire(key, 0.1)
    wait_expired(raw, key)
    assert lease.extend(5) is False
    assert lease.held is False
    assert raw.exists(key) == 0


def test_remaining_is_the_ttl_left_while_ours_else_none(locks, raw):
    lease = locks.acquire(name(locks, "remaining"), 10)
    left = lease.remaining()
    assert isinstance(left, float)
    assert 5 < left <= 10
    assert lease.release() is True
    assert lease.remaining() is None
    short = locks.acquire(name(locks, "remaining-short"), 0.1)
    wait_expired(raw, short.key)
    assert short.remaining() is None


# -- fencing ----------------------------------------------------------------------------


def test_fence_grows_with_every_grant_of_a_key(locks, raw):
    key = name(locks, "fenced")
    fences = []
    for _ in range(3):
        lease = locks.acquire(key, 5, fence=True)
        fences.append(lease.fence)
        assert lease.release() is True
    expiring = locks.acquire(key, 0.1, fence=True)
    fences.append(expiring.fence)
    wait_expired(raw, key)
    fences.append(locks.acquire(key, 5, fence=True).fence)
    assert fences == sorted(set(fences))  # strictly increasing (the slot's other keys count too)


def test_fenced_acquire_returns_none_while_held(locks):
    key = name(locks, "fenced-busy")
    holder = locks.acquire(key, 5, fence=True)
    assert locks.acquire(key, 5, fence=True) is None
    assert locks.acquire(key, 5) is None
    assert holder.release() is True
    assert locks.acquire(key, 5, fence=True).fence > holder.fence


@pytest.mark.parametrize("suffix", ["plain", "{user:7}:job"])  # the whole key hashed, or its tag
def test_fence_counter_is_the_lock_keys_hash_slots(locks, raw, suffix):
    key = name(locks, suffix)
    lease = locks.acquire(key, 5, fence=True)
    counter = locks._core.fence_key(key.encode())
    assert counter.startswith(b"joblock:fences:{")
    assert int(raw.get(counter)) >= lease.fence
    assert key_slot(counter) == key_slot(key.encode())
    assert raw.get(key) == lease.token and lease.token.endswith(b"#%d" % lease.fence)
    assert stored(raw, locks) == [key.encode()]  # no key of its own besides the lock


def test_fence_needs_a_key_without_an_unmatched_brace(locks, raw):
    with pytest.raises(ValueError, match="fence"):
        locks.acquire(name(locks, "bad}"), 5, fence=True)
    assert stored(raw, locks) == []


# -- waiting ----------------------------------------------------------------------------


def test_wait_gets_the_lock_once_the_holder_releases(locks):
    key = name(locks, "wait")
    holder = locks.acquire(key, 30)
    timer = threading.Timer(0.2, holder.release)
    timer.start()
    try:
        lease = locks.acquire(key, 5, wait=10)
    finally:
        timer.join()
    assert lease is not None
    assert holder.held is False
    assert lease.token != holder.token
    assert lease.release() is True


def test_wait_gets_the_lock_once_it_expires(locks):
    key = name(locks, "wait-expiry")
    locks.acquire(key, 0.2)
    lease = locks.acquire(key, 5, wait=10, fence=True)
    assert lease is not None
    assert lease.fence >= 1
    assert lease.release() is True


@pytest.mark.parametrize("wait", [0, 0.0, timedelta(0), 0.2])
def test_wait_gives_up_with_none(locks, wait):
    key = name(locks, "wait-none")
    holder = locks.acquire(key, 30)
    assert locks.acquire(key, 5, wait=wait) is None
    assert holder.release() is True


# -- tokens and what lands in Redis -----------------------------------------------------


def test_tokens_are_fresh_128_bit_values_naming_the_holder(locks):
    key = name(locks, "token")
    tokens = []
    for _ in range(20):
        lease = locks.acquire(key, 5)
        tokens.append(lease.token)
        assert lease.release() is True
    tokens += [locks.acquire(name(locks, f"token{i}"), 5).token for i in range(20)]
    assert len(set(tokens)) == len(tokens)
    for token in tokens:
        match = TOKEN.fullmatch(token)
        assert match, token
        assert match[2] == socket.gethostname().encode("ascii", "replace").replace(b" ", b"_")
        assert int(match[3]) == os.getpid()
    # 40 draws of 128 bits: every hex digit shows up in some token.
    assert set(b"".join(TOKEN.fullmatch(t)[1] for t in tokens)) == set(b"0123456789abcdef")


@pytest.mark.parametrize(
    ("ttl", "ms"),
    [
        (5, 5000),
        (2.5, 2500),
        (timedelta(seconds=3), 3000),
        (timedelta(minutes=2), 120_000),
        (86_400, 86_400_000),
    ],
)
def test_redis_holds_the_token_with_the_ttl_in_milliseconds(locks, raw, ttl, ms):
    key = name(locks, "value")
    lease = locks.acquire(key, ttl)
    assert raw.get(key) == lease.token
    assert ms - 1000 < raw.pttl(key) <= ms
    assert lease.release() is True


def test_lease_repr(locks):
    key = name(locks, "repr")
    lease = locks.acquire(key, 5)
    assert repr(lease) == f"<Lease {key!r} held>"
    lease.release()
    assert repr(lease) == f"<Lease {key!r} released>"
    fenced = locks.acquire(key, 5, fence=True)
    assert fenced.fence >= 1 and repr(fenced) == f"<Lease {key!r} held fence={fenced.fence}>"
    fenced.release()


def test_leases_cannot_be_constructed_directly(lease_type):
    with pytest.raises(TypeError):
        lease_type()
    with pytest.raises(TypeError):
        lease_type(b"key", b"token")


def test_lease_methods_check_their_arguments(locks):
    lease = locks.acquire(name(locks, "lease-args"), 5)
    with pytest.raises(ValueError, match="ttl"):
        lease.extend(0)
    with pytest.raises(TypeError, match="ttl"):
        lease.extend("5")
    assert lease.release() is True


# -- bad input --------------------------------------------------------------------------

TTL_OK = 5
BAD_INPUT = [
    # (key, ttl, wait, error, argument named in the message)
    ("k", "5", None, TypeError, "ttl"),
    ("k", None, None, TypeError, "ttl"),
    ("k", True, None, TypeError, "ttl"),
    ("k", math.nan, None, ValueError, "ttl"),
    ("k", math.inf, None, ValueError, "ttl"),
    ("k", -math.inf, None, ValueError, "ttl"),
    ("k", -1, None, ValueError, "ttl"),
    ("k", 0, None, ValueError, "ttl"),
    ("k", 0.0, None, ValueError, "ttl"),
    ("k", timedelta(0), None, ValueError, "ttl"),
    ("k", timedelta(seconds=-1), None, ValueError, "ttl"),
    ("k", 1e12, None, ValueError, "ttl"),
    ("k", TTL_OK, -1, ValueError, "wait"),
    ("k", TTL_OK, math.nan, ValueError, "wait"),
    ("k", TTL_OK, math.inf, ValueError, "wait"),
    ("k", TTL_OK, "x", TypeError, "wait"),
    ("k", TTL_OK, True, TypeError, "wait"),
    (5, TTL_OK, None, TypeError, "key"),
    (None, TTL_OK, None, TypeError, "key"),
    (bytearray(b"k"), TTL_OK, None, TypeError, "key"),
    (b"", TTL_OK, None, ValueError, "key"),
    ("", TTL_OK, None, ValueError, "key"),
    ("\ud800", TTL_OK, None, ValueError, "key"),
    ("x" * 65537, TTL_OK, None, ValueError, "key"),
]


@pytest.mark.parametrize(("key", "ttl", "wait", "error", "argument"), BAD_INPUT)
@pytest.mark.parametrize("fence", [False, True])
def test_bad_input_raises_and_writes_nothing(locks, raw, key, ttl, wait, error, argument, fence):
    if key == "k":
        key = name(locks, "bad-input")
    with pytest.raises(error, match=argument):
        locks.acquire(key, ttl, wait=wait, fence=fence)
    with pytest.raises(error, match=argument), locks.lock(key, ttl, wait=wait, fence=fence):
        pytest.fail("the block must not run")
    assert stored(raw, locks) == []


@pytest.mark.parametrize("ttl", [timedelta(seconds=5), 0.0005, 1e9, 7])
def test_good_ttls_are_accepted(locks, raw, ttl):
    key = name(locks, "good-ttl")
    lease = locks.acquire(key, ttl)
    assert lease is not None
    assert raw.pttl(key) != -1  # never a lock without expiry (0.0005 s rounds up to 1 ms)
    lease.release()


# -- scripts ----------------------------------------------------------------------------


def test_scripts_are_reloaded_after_script_flush(locks, raw):
    lease = locks.acquire(name(locks, "flush"), 5)
    raw.script_flush()
    assert lease.extend(30) is True
    raw.script_flush()
    assert lease.remaining() > 20
    raw.script_flush()
    fenced = locks.acquire(name(locks, "flush-fenced"), 5, fence=True)
    assert fenced.fence >= 1
    raw.script_flush()
    assert lease.release() is True
    raw.script_flush()
    assert fenced.release() is True
    assert stored(raw, locks) == []


# -- from_redis ---------------------------------------------------------------------------


def test_from_redis_reuses_the_clients_server_db_and_timeouts(core, redis_server, raw):
    client = redis.Redis(
        host="127.0.0.1", port=redis_server.port, db=3, socket_timeout=2.5, socket_connect_timeout=1.5
    )
    with locks_class(core).from_redis(client, prefix="from-redis") as locks:
        settings = locks.settings
        assert (settings.host, settings.port, settings.db) == ("127.0.0.1", redis_server.port, 3)
        assert (settings.socket_timeout, settings.connect_timeout) == (2.5, 1.5)
        assert (settings.username, settings.password, settings.tls) == (None, None, False)
        key = locks.key("FromRedis", 1)
        lease = locks.acquire(key, 5)
        assert client.get(key) == lease.token
        assert raw.exists(key) == 0  # db 0 does not see it
        assert lease.release() is True
    client.close()


# -- keys -------------------------------------------------------------------------------

KEY_EXAMPLES = [
    (("ProductSalesJob", 42), {}, "joblock:ProductSalesJob:42"),
    (("CleanupDataJob",), {}, "joblock:CleanupDataJob"),
    (("J", "a", "b"), {}, "joblock:J:a-b"),
    (("J", "a-b"), {}, "joblock:J:a%2Db"),
    (("J", "42"), {}, "joblock:J:'42'"),
    (("J", "None"), {}, "joblock:J:'None'"),
    (("J", ""), {}, "joblock:J:''"),
    (("J", None, True, 1.5, b"x\xff"), {}, "joblock:J:None-True-1.5-b'x%FF'"),
    (("J",), {"b": 2, "a": 1}, "joblock:J:a=1-b=2"),
    (("J", [1, (2, 3)], {"k": "v"}), {}, "joblock:J:[1,[2,3]]-(k=v)"),
    (("J", "a:b{c}"), {}, "joblock:J:a%3Ab%7Bc%7D"),
    (("J", "héllo"), {}, "joblock:J:héllo"),
    (("J", "x" * 300), {}, "joblock:J:#c2f093e41879e412280bfcc0ed6533e4"),
]


@pytest.mark.parametrize(("args", "kwargs", "expected"), KEY_EXAMPLES)
def test_key_examples(make_locks, args, kwargs, expected):
    assert make_locks(prefix="joblock").key(*args, **kwargs) == expected


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (("J", "a-b"), ("J", "a", "b")),
        (("J", "42"), ("J", 42)),
        (("J", 1), ("J", 1.0)),
        (("J", 1), ("J", True)),
        (("J", "None"), ("J", None)),
        (("J", b"a"), ("J", "a")),
        (("J", [1, 2]), ("J", 1, 2)),
        (("J", "a=1"), ("J",)),
        (("J", "x" * 300), ("J", "x" * 301)),
        (("J:a",), ("J", "a")),
    ],
)
def test_different_arguments_never_share_a_key(locks, one, other):
    assert locks.key(*one) != locks.key(*other)


def test_keyword_order_does_not_change_the_key(locks):
    assert locks.key("J", a=1, b=[2, {"y": 1, "x": 2}]) == locks.key("J", b=[2, {"x": 2, "y": 1}], a=1)


@pytest.mark.parametrize(
    ("job", "args", "error"), [("J", (object(),), TypeError), (5, (), TypeError), ("", (), ValueError)]
)
def test_key_rejects_what_it_cannot_render_stably(locks, job, args, error):
    with pytest.raises(error):
        locks.key(job, *args)


def test_key_can_be_locked_directly(locks, raw):
    key = locks.key("ProductSalesJob", 42)
    assert key == f"{locks.prefix}:ProductSalesJob:42"
    with locks.lock(key, 5) as lease:
        assert raw.get(key) == lease.token
