"""Bad input on every entry point, beyond the single-lock table of test_locks.py, the URL
tables of test_connection.py and the key-building tables of test_keys.py.

Each case must end in a TypeError, a ValueError or a joblock exception whose message
names what is wrong, before anything is written to Redis. Runs on each twin of the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import socket
import time
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction

import pytest
import redis
import redis.asyncio

import joblock
import joblock.aio
import joblock.compat
import joblock.testing
from helpers import name, names, stored
from joblock._tools.cli import USAGE as EXIT_USAGE
from joblock._tools.cli import main as cli
from joblock._tools.servers import RedisServer, free_port
from joblock.aio import AsyncLocks
from test_connection import BAD_URLS, LEAKY_URLS, SECRET


def shown(value: object) -> str:
    """A test id: the value's repr without a memory address, which differs between
    processes and would make pytest-xdist's workers collect different tests."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


# -- durations, on every entry that takes one -----------------------------------------------

BAD_DURATIONS = [
    (math.nan, ValueError),
    (math.inf, ValueError),
    (-math.inf, ValueError),
    (-1, ValueError),
    (-1e-9, ValueError),
    (0, ValueError),
    (0.0, ValueError),
    (-0.0, ValueError),
    (timedelta(0), ValueError),
    (timedelta(days=-1), ValueError),
    (1e12, ValueError),
    (10**30, ValueError),
    (timedelta(days=365 * 100), ValueError),
    ("5", TypeError),
    (b"5", TypeError),
    (None, TypeError),
    (True, TypeError),
    (Decimal("5"), TypeError),
    (Fraction(1, 2), TypeError),
    (5j, TypeError),
    ([5], TypeError),
]

TTL_ENTRIES = {
    "acquire_many": lambda locks, lease, ttl: locks.acquire_many([name(locks, "k")], ttl),
    "acquire_many-fenced": lambda locks, lease, ttl: locks.acquire_many([name(locks, "k")], ttl, fence=True),
    "dedupe": lambda locks, lease, ttl: locks.dedupe("J", [(1,)], ttl),
    "extend_many": lambda locks, lease, ttl: locks.extend_many([lease], ttl),
    "extend": lambda locks, lease, ttl: lease.extend(ttl),
    "job": lambda locks, lease, ttl: locks.job(ttl=ttl),
}


@pytest.mark.parametrize(("ttl", "error"), BAD_DURATIONS, ids=shown)
@pytest.mark.parametrize("entry", list(TTL_ENTRIES))
def test_bad_ttl_on_every_entry(locks, raw, entry, ttl, error):
    lease = locks.acquire(name(locks, "held"), 5)
    with pytest.raises(error, match="ttl"):
        TTL_ENTRIES[entry](locks, lease, ttl)
    assert stored(raw, locks) == [name(locks, "held").encode()]
    assert 4000 < raw.pttl(lease.key) <= 5000  # an extend refused is an extend not sent
    assert lease.release() is True


# None means no waiting and 0 a single attempt: both are good waits.
BAD_WAITS = [(v, e) for v, e in BAD_DURATIONS if v is not None and v != 0 and v != timedelta(0)]


@pytest.mark.parametrize(("wait", "error"), BAD_WAITS, ids=shown)
def test_bad_wait_on_the_job_decorator(locks, wait, error):
    with pytest.raises(error, match="wait"):
        locks.job(ttl=5, wait=wait)


# -- batch arguments ------------------------------------------------------------------------

NOT_A_BATCH = [5, None, 1.5, object(), "key", b"key"]


@pytest.mark.parametrize("given", NOT_A_BATCH, ids=shown)
def test_what_is_not_a_batch_is_refused_naming_the_argument(locks, raw, given):
    lease = locks.acquire(name(locks, "held"), 5)
    single = "a single " if isinstance(given, (str, bytes)) else ""
    kind = type(given).__name__
    with pytest.raises(TypeError, match=f"keys must be an iterable of str or bytes keys, not {single}{kind}"):
        locks.acquire_many(given, 5)
    with pytest.raises(
        TypeError, match=f"arg_tuples must be an iterable of argument tuples, not {single}{kind}"
    ):
        locks.dedupe("J", given, 5)
    for operation in (locks.release_many, lambda leases: locks.extend_many(leases, 5)):
        with pytest.raises(TypeError, match=r"leases must be an iterable of leases, not"):
            operation(given)
    with pytest.raises(TypeError, match="leases must be an iterable of leases, not Lease"):
        locks.release_many(lease)  # one lease, not a list of them
    assert stored(raw, locks) == [name(locks, "held").encode()]
    assert lease.release() is True


BAD_KEYS = [
    (5, TypeError),
    (1.5, TypeError),
    (None, TypeError),
    (bytearray(b"k"), TypeError),
    (memoryview(b"k"), TypeError),
    (("a", "b"), TypeError),
    ("", ValueError),
    (b"", ValueError),
    ("a\ud800", ValueError),
    ("\udcff", ValueError),
    ("x" * 65537, ValueError),
    (b"x" * 65537, ValueError),
    ("\u00e9" * 32769, ValueError),  # 65,538 bytes of UTF-8
]


@pytest.mark.parametrize(("bad", "error"), BAD_KEYS, ids=lambda v: shown(v)[:20])
@pytest.mark.parametrize("at", [0, 12])
@pytest.mark.parametrize("fence", [False, True])
def test_a_bad_key_anywhere_in_a_batch_writes_nothing(make_locks, raw, bad, error, at, fence):
    locks = make_locks(window=5)
    keys = names(locks, 20)
    keys.insert(at, bad)
    with pytest.raises(error, match=rf"keys\[{at}\]"):
        locks.acquire_many(iter(keys), 5, fence=fence)
    assert stored(raw, locks) == []


@pytest.mark.parametrize("at", [0, 12])
def test_an_unfenceable_key_in_a_fenced_batch_writes_nothing(make_locks, raw, at):
    locks = make_locks(window=5)
    keys = names(locks, 20)
    keys.insert(at, name(locks, "unmatched}"))
    with pytest.raises(ValueError, match="fence"):
        locks.acquire_many(keys, 5, fence=True)
    assert stored(raw, locks) == []
    assert locks.acquire_many(keys, 5) != []  # unfenced, the same keys are fine
    locks.release_many(locks.acquire_many(keys, 5))


class Opaque:
    pass


def recursive():
    value: list = []
    value.append(value)
    return value


def nested(depth):
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


UNSUPPORTED = [
    ({1, 2}, TypeError, "set"),
    (frozenset(), TypeError, "frozenset"),
    (1j, TypeError, "complex"),
    (bytearray(b"x"), TypeError, "bytearray"),
    (memoryview(b"x"), TypeError, "memoryview"),
    (object(), TypeError, "object"),
    (Opaque(), TypeError, "Opaque"),
    (Opaque, TypeError, "type"),
    (len, TypeError, "builtin_function_or_method"),
    (range(3), TypeError, "range"),
    (Decimal("1"), TypeError, "Decimal"),
    ([1, {2: object()}], TypeError, "object"),
    ({"k": {1}}, TypeError, "set"),
    ({(1, 2): "v"}, None, None),  # a tuple as a dict key renders: not bad input
    ("a\ud800", ValueError, "surrogates"),
    ({"\ud800": 1}, ValueError, "surrogates"),
    (nested(33), ValueError, "deeper than 32"),
    (recursive(), ValueError, "deeper than 32"),
]


@pytest.mark.parametrize(("value", "error", "what"), UNSUPPORTED, ids=lambda v: shown(v)[:20])
def test_unsupported_arguments_for_key_building_on_every_entry(make_locks, raw, value, error, what):
    locks = make_locks(window=5)

    @locks.job(ttl=5)
    def job(*args):
        return "ran"

    tuples = [(i,) for i in range(12)] + [(1, value)]
    if error is None:
        assert locks.key("J", value)
        assert job(value) == "ran"
        assert len(locks.dedupe("J", tuples, 5)) == 13
        return
    with pytest.raises(error, match=what):
        locks.key("J", value)
    with pytest.raises(error, match=r"args\[0\]"):
        locks.key("J", value)
    with pytest.raises(error, match=r"kwargs\['k'\]"):
        locks.key("J", k=value)
    with pytest.raises(error, match=r"arg_tuples\[12\]"):
        locks.dedupe("J", iter(tuples), 5)
    with pytest.raises(error, match=what):
        job(value)
    assert stored(raw, locks) == []


BAD_JOBS = [(5, TypeError), (None, TypeError), (b"J", TypeError), ("", ValueError), ("J\ud800", ValueError)]


@pytest.mark.parametrize(("job", "error"), BAD_JOBS, ids=shown)
def test_bad_job_names_are_refused_before_anything_is_sent(locks, raw, job, error):
    with pytest.raises(error, match="job"):
        locks.key(job, 1)
    with pytest.raises(error, match="job"):
        locks.dedupe(job, [(1,)], 5)
    with pytest.raises(error, match="job"):
        locks.dedupe(job, [], 5)  # even with nothing to lock
    assert stored(raw, locks) == []


# -- Locks itself ----------------------------------------------------------------------------

BAD_OPTIONS = [
    ({"prefix": b"joblock"}, TypeError, "prefix"),
    ({"prefix": None}, TypeError, "prefix"),
    ({"prefix": 5}, TypeError, "prefix"),
    ({"prefix": "\ud800"}, ValueError, "prefix"),
    ({"prefix": "x" * 65537}, ValueError, "prefix"),
    ({"window": 0}, ValueError, "window"),
    ({"window": 100_001}, ValueError, "window"),
    ({"window": -5}, ValueError, "window"),
    ({"window": 1.5}, TypeError, "window"),
    ({"window": "5"}, TypeError, "window"),
    ({"window": True}, TypeError, "window"),
    ({"retries": 1.5}, TypeError, "retries"),
    ({"retries": -1}, ValueError, "retries"),
    ({"connect_timeout": math.nan}, ValueError, "connect_timeout"),
    ({"socket_timeout": math.inf}, ValueError, "socket_timeout"),
    ({"socket_timeout": 0}, ValueError, "socket_timeout"),
    ({"username": 5}, TypeError, "username"),
    ({"ssl_cert_reqs": "maybe"}, ValueError, "ssl_cert_reqs"),
    ({"db": "0"}, TypeError, "db"),
    ({"port": 65536}, ValueError, "port"),
]


@pytest.mark.parametrize(("options", "error", "match"), BAD_OPTIONS, ids=shown)
def test_bad_locks_options_are_refused(core, redis_server, options, error, match):
    from conftest import locks_class

    with pytest.raises(error, match=match):
        locks_class(core)(redis_server.url, **options)


@pytest.mark.parametrize(("url", "error", "match"), BAD_URLS)
def test_malformed_urls_are_refused_by_locks_and_the_command(core, url, error, match, capsys):
    from conftest import locks_class

    with pytest.raises(error, match=match):
        locks_class(core)(url)
    if isinstance(url, str):
        for command in (["inspect"], ["release", "k"]):
            assert cli(["--url", url, *command]) == EXIT_USAGE
            assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("url", LEAKY_URLS)
def test_the_command_never_shows_the_password_of_a_malformed_url(url, capsys):
    assert cli(["--url", url, "inspect"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "url" in err.lower() and SECRET not in err


SENTINEL_BAD_URLS = [
    ("redis+sentinel://h:26379", ValueError, "service name"),
    ("redis+sentinel://h:26379/", ValueError, "service name"),
    ("redis+sentinel://h:x/m", ValueError, "a sentinel's address is malformed"),
    ("redis+sentinel://h:99999/m", ValueError, "a sentinel's address is malformed"),
    ("redis+sentinel://h1,,h2/m", ValueError, "a sentinel's address is malformed"),
    ("redis+sentinel://:1/m", ValueError, "a sentinel's address is malformed"),
    ("redis+sentinel://[::1/m", ValueError, "not a valid Redis URL"),
    ("redis+sentinel://h/m/x", ValueError, "db"),
    ("redis+sentinel://h/m?socket_timeout=0", ValueError, "socket_timeout"),
    ("redis+sentinel://h/m?service=n", TypeError, "unknown connection option 'service'"),
    ("redis+sentinel://h/m?sentinels=h2", TypeError, "unknown connection option 'sentinels'"),
    ("redis+sentinel://h/m?keepalive=maybe", ValueError, "keepalive must be true or false, not 'maybe'"),
    ("redis+sentinel://h/m?native_commands=on", ValueError, "native_commands must be true or false"),
    ("redis+sentinel://h/m?tls=2", ValueError, "tls must be true or false, not '2'"),
    (
        "redis+sentinel://h/m?socket_timeout=1&replica_timeout=1",
        ValueError,
        r"replica_timeout \(1\.0 s\) must be shorter than socket_timeout \(1\.0 s\)",
    ),
    ("sentinel://h/m", ValueError, "scheme"),
]


@pytest.mark.parametrize(("url", "error", "match"), SENTINEL_BAD_URLS)
def test_malformed_sentinel_urls_are_refused_by_both_clients_and_the_command(core, url, error, match, capsys):
    from conftest import locks_class

    with pytest.raises(error, match=match):
        locks_class(core)(url)
    with pytest.raises(error, match=match):
        type("AsyncLocks", (AsyncLocks,), {"_core": core})(url)
    assert cli(["--url", url, "inspect"]) == EXIT_USAGE
    assert re.search(match, capsys.readouterr().err)


SENTINEL_LEAKY_URLS = [
    f"redis+sentinel://user:{SECRET}@h:port/m",
    f"redis+sentinel://user:{SECRET}@h1,h2:99999/m",
    f"redis+sentinel://user:{SECRET}@h/m/x",
    f"redis+sentinel://user:{SECRET}@h/",
    f"redis+sentinel://user:{SECRET}@h/m?bogus=1",
    f"redis+sentinel://user:{SECRET}@h/m?password={SECRET}",
    f"redis+sentinel://h/m?sentinel_password={SECRET}&retries=x",
    f"redis+sentinel://user:{SECRET}@[::1/m",
    # an unescaped '/', '?' or '#' spills the password out of the host part
    f"redis+sentinel://:{SECRET}/x@h/m",
    f"redis+sentinel://:{SECRET}?x@h/m",
    f"redis+sentinel://user:/{SECRET}@h:26379/m/0",
]


@pytest.mark.parametrize("url", SENTINEL_LEAKY_URLS)
def test_a_malformed_sentinel_url_never_shows_a_password(core, url, capsys):
    from conftest import locks_class

    with pytest.raises((TypeError, ValueError)) as info:
        locks_class(core)(url)
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)
    assert cli(["--url", url, "inspect"]) == EXIT_USAGE
    assert SECRET not in capsys.readouterr().err


@pytest.mark.parametrize("client", [5, None, "redis://h", object()], ids=shown)
def test_from_redis_needs_a_redis_client(core, client):
    from conftest import locks_class

    with pytest.raises(TypeError, match="client must be a redis-py client"):
        locks_class(core).from_redis(client)


# -- unreachable hosts, on every entry -----------------------------------------------------------


@pytest.fixture(scope="module")
def unanswered_port():
    """A port whose listener never accepts and whose backlog is full: connects time out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(listener.getsockname())
        fillers.append(filler)
    time.sleep(0.05)
    yield listener.getsockname()[1]
    for sock in [*fillers, listener]:
        sock.close()


def unreachable(kind, tmp_path, unanswered_port):
    """(url, what the error must say, the error) for each way a host can be out of reach."""
    if kind == "closed-port":
        port = free_port()
        return f"redis://127.0.0.1:{port}/0", f"127.0.0.1:{port}", joblock.ConnectionError
    if kind == "unresolvable":
        return "redis://joblock-test.invalid:6379/0", "joblock-test.invalid", joblock.ConnectionError
    if kind == "connect-timeout":
        return f"redis://127.0.0.1:{unanswered_port}/0", "within 0.2 s", joblock.TimeoutError
    return f"unix://{tmp_path}/missing.sock", "missing.sock", joblock.ConnectionError


ENTRIES = {
    "acquire": lambda locks: locks.acquire("k", 5),
    "acquire-fenced-wait": lambda locks: locks.acquire("k", 5, wait=1, fence=True),
    "lock": lambda locks: locks.lock("k", 5).__enter__(),
    "acquire_many": lambda locks: locks.acquire_many(["k1", "k2"], 5),
    "dedupe": lambda locks: locks.dedupe("J", [(1,)], 5),
    "job": lambda locks: locks.job(ttl=5)(lambda x: x)(1),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("kind", ["closed-port", "unresolvable", "connect-timeout", "missing-socket"])
def test_an_unreachable_host_is_an_exception_on_every_entry(
    make_locks, tmp_path, unanswered_port, kind, entry
):
    url, says, error = unreachable(kind, tmp_path, unanswered_port)
    locks = make_locks(url, connect_timeout=0.2, retries=0)
    started = time.monotonic()
    with pytest.raises(joblock.ConnectionError) as info:
        ENTRIES[entry](locks)
    assert time.monotonic() - started < 10  # a guard against hanging, not a speed check
    got = info.value
    if isinstance(got, joblock.BatchConnectionError):
        assert got.granted == 0
        got = got.__cause__
    assert isinstance(got, error)
    assert says in str(got)
    assert "could not connect" in str(got)


# -- wrong passwords ---------------------------------------------------------------------------

PASSWORD = "right-password"


@pytest.fixture(scope="module")
def password_server():
    with RedisServer("--user", "worker", "on", f">{PASSWORD}", "~*", "&*", "+@all") as server:
        yield server


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_wrong_password_is_an_exception_on_every_entry(make_locks, password_server, entry):
    locks = make_locks(f"redis://worker:wrong@127.0.0.1:{password_server.port}/0")
    batch = entry in ("acquire_many", "dedupe")
    with pytest.raises(joblock.BatchConnectionError if batch else joblock.AuthenticationError) as info:
        ENTRIES[entry](locks)
    got = info.value.__cause__ if isinstance(info.value, joblock.BatchError) else info.value
    assert isinstance(got, joblock.AuthenticationError)
    assert "refused the password for user 'worker'" in str(got)
    assert "wrong" not in str(got)


def test_a_rotated_password_fails_release_loudly_not_as_expiry(make_locks, password_server):
    """The password changes while a lease is held: release must raise, not say False
    (False would claim the lock expired while it is still held)."""
    url = f"redis://worker:{PASSWORD}@127.0.0.1:{password_server.port}/0"
    locks = make_locks(url)
    lease = locks.acquire(name(locks, "rotated"), 30)
    admin = redis.Redis(unix_socket_path=password_server.unixsocket, username="worker", password=PASSWORD)
    admin.acl_setuser("worker", enabled=True, passwords=[f"-{PASSWORD}", "+rotated"])
    admin.close()
    admin = redis.Redis(unix_socket_path=password_server.unixsocket, username="worker", password="rotated")
    try:
        admin.client_kill_filter(_type="normal", skipme=True)
        with pytest.raises(joblock.AuthenticationError):
            lease.release()
        assert lease.held is True
        assert admin.get(lease.key) == lease.token
        with pytest.raises(joblock.AuthenticationError):
            lease.extend(60)
    finally:
        admin.acl_setuser("worker", enabled=True, passwords=["-rotated", f"+{PASSWORD}"])
        admin.close()
    assert lease.release() is True


# -- redis+sentinel:// --------------------------------------------------------------------------


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_unreachable_sentinels_are_an_exception_on_every_entry_that_hides_the_passwords(make_locks, entry):
    ports = [free_port(), free_port()]
    hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
    url = f"redis+sentinel://user:{SECRET}@{hosts}/mymaster/0?sentinel_password={SECRET}"
    locks = make_locks(url, connect_timeout=0.2)
    assert SECRET not in repr(locks) and SECRET not in repr(locks.settings)
    with pytest.raises(joblock.ConnectionError) as info:
        ENTRIES[entry](locks)
    got = info.value
    if isinstance(got, joblock.BatchConnectionError):
        assert got.granted == 0
        got = got.__cause__
    assert "no sentinel could say where the primary 'mymaster' is" in str(got)
    assert all(f"127.0.0.1:{port}" in str(got) for port in ports)
    assert SECRET not in str(got) and SECRET not in repr(got)


# -- flags: a bool or nothing, on every client, call and decorator -----------------------------

# Truthy and falsy alike: "no" or 0 taken as a flag would pass silently either way.
NOT_BOOLS = ["yes", "no", "", 1, 0, None, 1.0]

FLAG_ENTRIES = {
    "acquire-fence": ("fence", lambda locks, key, v: locks.acquire(key, 5, fence=v)),
    "acquire-fair": ("fair", lambda locks, key, v: locks.acquire(key, 5, fair=v)),
    "acquire-shared": ("shared", lambda locks, key, v: locks.acquire(key, 5, shared=v)),
    "acquire-wait-fair": ("fair", lambda locks, key, v: locks.acquire(key, 5, wait=1, fair=v)),
    "lock-shared": ("shared", lambda locks, key, v: locks.lock(key, 5, shared=v).__enter__()),
    "acquire_many-fence": ("fence", lambda locks, key, v: locks.acquire_many([key], 5, fence=v)),
    "dedupe-fence": ("fence", lambda locks, key, v: locks.dedupe("J", [(1,)], 5, fence=v)),
    "job-fence": ("fence", lambda locks, key, v: locks.job(ttl=5, fence=v)),
    "job-fair": ("fair", lambda locks, key, v: locks.job(ttl=5, fair=v)),
    "job-auto_renew": ("auto_renew", lambda locks, key, v: locks.job(ttl=5, auto_renew=v)),
    "hold-fence": ("fence", lambda locks, key, v: joblock.testing.hold(locks, key, fence=v)),
    "hold-shared": ("shared", lambda locks, key, v: joblock.testing.hold(locks, key, shared=v)),
}


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("entry", list(FLAG_ENTRIES))
def test_a_flag_that_is_not_a_bool_is_refused_naming_it(locks, raw, entry, value):
    flag, call = FLAG_ENTRIES[entry]
    with pytest.raises(TypeError, match=rf"^{flag} must be a bool, not {type(value).__name__}$"):
        call(locks, name(locks, "flag"), value)
    assert stored(raw, locks) == []


ASYNC_FLAG_ENTRIES = {
    "acquire-fence": ("fence", lambda locks, key, v: locks.acquire(key, 5, fence=v)),
    "acquire-fair": ("fair", lambda locks, key, v: locks.acquire(key, 5, fair=v)),
    "acquire-shared": ("shared", lambda locks, key, v: locks.acquire(key, 5, shared=v)),
    "acquire_many-fence": ("fence", lambda locks, key, v: locks.acquire_many([key], 5, fence=v)),
    "dedupe-fence": ("fence", lambda locks, key, v: locks.dedupe("J", [(1,)], 5, fence=v)),
}


@pytest.mark.parametrize("value", ["yes", "", 0, None], ids=repr)
def test_a_flag_that_is_not_a_bool_is_refused_by_async_locks(core, redis_server, raw, value):
    cls = type("AsyncLocks", (AsyncLocks,), {"_core": core})

    async def main():
        locks = cls(redis_server.url, prefix=f"async-flags-{core.__name__}")
        try:
            for flag, call in ASYNC_FLAG_ENTRIES.values():
                with pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
                    await call(locks, name(locks, "flag"), value)
            with pytest.raises(TypeError, match=r"^fair must be a bool"):
                async with locks.lock(name(locks, "flag"), 5, fair=value):
                    pass
            with pytest.raises(TypeError, match=r"^fair must be a bool"):
                locks.job(ttl=5, fair=value)
            assert stored(raw, locks) == []
        finally:
            await locks.close()

    asyncio.run(main())


CLUSTER_FLAG_ENTRIES = {
    **ASYNC_FLAG_ENTRIES,
    "acquire-wait-fair": ("fair", lambda locks, key, v: locks.acquire(key, 5, wait=1, fair=v)),
    "job-fence": ("fence", lambda locks, key, v: locks.job(ttl=5, fence=v)),
    "job-fair": ("fair", lambda locks, key, v: locks.job(ttl=5, fair=v)),
}


@pytest.mark.parametrize("value", ["yes", 0, None], ids=repr)
@pytest.mark.parametrize("cls", ["ClusterLocks", "AsyncClusterLocks"])
def test_a_flag_that_is_not_a_bool_is_refused_by_cluster_locks(cluster, cluster_raw, cls, value):
    make = joblock.ClusterLocks if cls == "ClusterLocks" else joblock.aio.AsyncClusterLocks

    async def main():
        locks = make(cluster.url, prefix="cluster-flags")
        try:
            for flag, call in CLUSTER_FLAG_ENTRIES.values():
                with pytest.raises(TypeError, match=rf"^{flag} must be a bool, not {type(value).__name__}$"):
                    result = call(locks, "cluster-flags:k", value)
                    if asyncio.iscoroutine(result):
                        await result
        finally:
            closed = locks.close()
            if asyncio.iscoroutine(closed):
                await closed

    asyncio.run(main())
    assert cluster_raw.keys("cluster-flags*") == []


BOOL_SETTINGS = ["tls", "ssl", "ssl_check_hostname", "keepalive", "socket_keepalive", "native_commands"]


@pytest.mark.parametrize("value", ["yes", 1, None], ids=repr)
@pytest.mark.parametrize("option", BOOL_SETTINGS)
def test_a_bool_setting_that_is_not_a_bool_is_refused_naming_it(core, redis_server, option, value):
    from conftest import locks_class

    for make in (
        lambda: locks_class(core)(redis_server.url, **{option: value}),
        lambda: AsyncLocks(redis_server.url, **{option: value}),
        lambda: joblock.Redlock([redis_server.url], **{option: value}),
    ):
        with pytest.raises(TypeError, match=rf"^{option} must be a bool, not {type(value).__name__}$"):
            make()


def test_a_bool_setting_in_a_url_takes_true_false_1_0_yes_no_only(core, redis_server):
    from conftest import locks_class

    url = redis_server.url
    for given, meant in [
        ("true", True),
        ("FALSE", False),
        ("1", True),
        ("0", False),
        ("yes", True),
        ("no", False),
    ]:
        assert locks_class(core)(f"{url}?keepalive={given}").settings.keepalive is meant
    for given in ["", "maybe", "on", "2", "tru"]:
        with pytest.raises(ValueError, match=rf"^keepalive must be true or false, not '{given}'$"):
            locks_class(core)(f"{url}?keepalive={given}")
        with pytest.raises(ValueError, match=rf"^native_commands must be true or false, not '{given}'$"):
            locks_class(core)(f"{url}?native_commands={given}")
        with pytest.raises(ValueError, match=r"^ssl_check_hostname must be true or false"):
            locks_class(core)(f"{url}?ssl_check_hostname={given}")


def test_replica_timeout_not_shorter_than_socket_timeout_is_refused_when_the_client_is_made(
    core, redis_server
):
    from conftest import locks_class

    url = redis_server.url
    says = r"^replica_timeout \(5\.0 s\) must be shorter than socket_timeout \(5\.0 s\)"
    for make in (
        lambda: locks_class(core)(url, replica_timeout=5),
        lambda: locks_class(core)(f"{url}?replica_timeout=5"),
        lambda: AsyncLocks(url, min_replicas=1, replica_timeout=5),
        lambda: joblock.Redlock([url], replica_timeout=5),
    ):
        with pytest.raises(ValueError, match=says):
            make()
    with pytest.raises(ValueError, match=r"^replica_timeout \(0\.5 s\) .* socket_timeout \(0\.3 s\)"):
        locks_class(core)(url, min_replicas=1, socket_timeout=0.3)  # the default replica_timeout
    with pytest.raises(ValueError, match=r"^replica_timeout \(2\.0 s\) .* socket_timeout \(1\.0 s\)"):
        locks_class(core)(f"{url}?socket_timeout=1&replica_timeout=2")
    # Asked for by neither: a short socket_timeout alone is fine (a call's min_replicas is checked then).
    assert locks_class(core)(url, socket_timeout=0.3).settings.socket_timeout == 0.3


COMPAT_FLAGS = {
    "blocking": lambda client, lock_class, key, v: client.lock(key, blocking=v, lock_class=lock_class),
    "thread_local": lambda client, lock_class, key, v: client.lock(
        key, thread_local=v, lock_class=lock_class
    ),
    "raise_on_release_error": lambda client, lock_class, key, v: client.lock(
        key, raise_on_release_error=v, lock_class=lock_class
    ),
    "blocking-positional": lambda client, lock_class, key, v: lock_class(client, key, None, 0.1, v),
}


@pytest.mark.parametrize("value", ["no", 1, 0], ids=repr)
def test_compat_locks_refuse_a_flag_that_is_not_a_bool(core, redis_server, raw, value):
    from joblock.compat import AsyncRedisLock, RedisLock

    key = f"compat-flags:{core.__name__}:{value!r}"
    client = redis.Redis.from_url(redis_server.url)
    async_client = redis.asyncio.Redis.from_url(redis_server.url)
    for base, on in ((RedisLock, client), (AsyncRedisLock, async_client)):
        lock_class = type(base.__name__, (base,), {"_core": core})
        for flag, make in COMPAT_FLAGS.items():
            with pytest.raises(TypeError, match=rf"^{flag.split('-')[0]} must be a bool"):
                make(on, lock_class, key, value)
    lock = client.lock(key, timeout=5, lock_class=type("RedisLock", (RedisLock,), {"_core": core}))
    with pytest.raises(TypeError, match=r"^blocking must be a bool"):
        lock.acquire(blocking=value)
    assert raw.exists(key) == 0
    assert lock.acquire(blocking=False) is True
    with pytest.raises(TypeError, match=r"^replace_ttl must be a bool"):
        lock.extend(60, replace_ttl=value)
    assert raw.pttl(key) <= 5000  # not extended
    lock.release()

    async def main():
        cls = type("AsyncRedisLock", (AsyncRedisLock,), {"_core": core})
        alock = async_client.lock(key, timeout=5, lock_class=cls)
        try:
            with pytest.raises(TypeError, match=r"^blocking must be a bool"):
                await alock.acquire(blocking=value)
            assert raw.exists(key) == 0
            assert await alock.acquire(blocking=False) is True
            with pytest.raises(TypeError, match=r"^replace_ttl must be a bool"):
                await alock.extend(60, replace_ttl=value)
            assert raw.pttl(key) <= 5000
            await alock.release()
        finally:
            await joblock.compat.aclose(async_client)
            await async_client.aclose()

    asyncio.run(main())
    client.close()
