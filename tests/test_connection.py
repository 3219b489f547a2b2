"""Reaching Redis: URLs, passwords and ACL users, unix sockets, TLS, timeouts, forks, restarts.

Servers with special configuration (a password, TLS, one to pause or restart) are real
redis-server processes of their own, started here.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from urllib.parse import quote

import pytest
import redis

import joblock
from conftest import locks_class
from helpers import command, make_certs, tls_server
from joblock._tools.servers import RedisServer, free_port
from joblock.settings import Settings, parse_url

PASSWORD = "hunter2-Secret/x?y#z"  # '/', '?' and '#' must be percent-encoded in a URL
DEFAULT_PASSWORD = "default-Pw-42"
ENCODED = quote(PASSWORD, safe="")


def name(locks, suffix):
    return f"{locks.prefix}:{suffix}"


def round_trip(locks, n=20):
    """Acquire, extend and release one lock and a batch: the server answers correctly."""
    lease = locks.acquire(name(locks, "one"), 5, fence=True)
    assert lease is not None
    assert lease.extend(10) is True
    assert lease.release() is True
    leases = locks.acquire_many([name(locks, f"many{i}") for i in range(n)], 5)
    assert all(lease is not None for lease in leases)
    assert locks.release_many(leases) == [True] * n


# -- parse_url --------------------------------------------------------------------------

PARSED = [
    ("redis://localhost", {"host": "localhost", "port": 6379, "db": 0, "tls": False, "password": None}),
    ("redis://h:7000/3", {"host": "h", "port": 7000, "db": 3}),
    ("redis://h/", {"db": 0}),
    ("rediss://h/1", {"tls": True, "db": 1, "ssl_cert_reqs": "required", "ssl_check_hostname": True}),
    ("redis://alice:s3cret@h:1/2", {"username": "alice", "password": "s3cret", "port": 1, "db": 2}),
    ("redis://:s3cret@h", {"username": None, "password": "s3cret"}),
    ("redis://al%40ice:p%40ss%2Fw%3F%23@h", {"username": "al@ice", "password": "p@ss/w?#"}),
    ("redis://[::1]:6380/0", {"host": "::1", "port": 6380}),
    ("unix:///tmp/redis.sock", {"path": "/tmp/redis.sock", "db": 0, "tls": False}),
    ("unix:///tmp/redis.sock?db=4", {"path": "/tmp/redis.sock", "db": 4}),
    ("unix://bob:pw@/tmp/r.sock", {"path": "/tmp/r.sock", "username": "bob", "password": "pw"}),
    (
        "redis://h/0?socket_timeout=0.5&connect_timeout=2&retries=5&client_name=w1&keepalive=no",
        {
            "socket_timeout": 0.5,
            "connect_timeout": 2.0,
            "retries": 5,
            "client_name": "w1",
            "keepalive": False,
        },
    ),
    (
        "redis://h?socket_connect_timeout=1.5&socket_keepalive=true",
        {"connect_timeout": 1.5, "keepalive": True},
    ),
    (
        "rediss://h/0?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
        "&ssl_cert_reqs=none&ssl_check_hostname=false",
        {
            "tls": True,
            "ssl_ca_certs": "/ca.pem",
            "ssl_certfile": "/c.pem",
            "ssl_keyfile": "/k.pem",
            "ssl_cert_reqs": "none",
            "ssl_check_hostname": False,
        },
    ),
    ("rediss://h?ssl_cert_reqs=CERT_OPTIONAL", {"ssl_cert_reqs": "optional"}),
    ("redis://h?ssl=true", {"tls": True}),
]


@pytest.mark.parametrize(("url", "expected"), PARSED)
def test_parse_url(url, expected):
    settings = parse_url(url)
    assert {field: getattr(settings, field) for field in expected} == expected


def test_keyword_options_override_the_url():
    settings = parse_url("redis://u:pw@h:1/1?socket_timeout=1", db=2, password="other", socket_timeout=3)
    assert (settings.db, settings.password, settings.socket_timeout, settings.username) == (
        2,
        "other",
        3.0,
        "u",
    )


BAD_URLS = [
    ("http://h", ValueError, "scheme"),
    ("redis://h:notaport", ValueError, "not a valid Redis URL"),
    ("redis://h:99999", ValueError, "not a valid Redis URL"),
    ("redis://[::1", ValueError, "not a valid Redis URL"),
    ("redis://h/abc", ValueError, "db"),
    ("redis://h/-1", ValueError, "db"),
    ("redis://h/0?db=x", ValueError, "db"),
    ("redis://h/0?socket_timeout=abc", ValueError, "socket_timeout"),
    ("redis://h/0?socket_timeout=0", ValueError, "socket_timeout"),
    ("redis://h/0?connect_timeout=inf", ValueError, "connect_timeout"),
    ("redis://h/0?retries=-1", ValueError, "retries"),
    ("redis://h/0?keepalive=maybe", ValueError, "keepalive"),
    ("rediss://h/0?ssl_cert_reqs=sometimes", ValueError, "ssl_cert_reqs"),
    ("redis://h/0?bogus=1", TypeError, "bogus"),
    ("redis://h/0?password=x", ValueError, "password"),
    ("unix://", ValueError, "path"),
    (5, TypeError, "url"),
    (b"redis://h", TypeError, "url"),
]


@pytest.mark.parametrize(("url", "error", "match"), BAD_URLS)
def test_bad_urls_are_refused(url, error, match):
    with pytest.raises(error, match=match):
        parse_url(url)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"socket_timeout": "1"}, TypeError, "socket_timeout"),
        ({"socket_timeout": -1}, ValueError, "socket_timeout"),
        ({"db": -1}, ValueError, "db"),
        ({"db": True}, TypeError, "db"),
        ({"port": 0}, ValueError, "port"),
        ({"password": 5}, TypeError, "password"),
        ({"tls": "yes"}, TypeError, "tls"),
        ({"colour": "blue"}, TypeError, "colour"),
    ],
)
def test_bad_keyword_options_are_refused(options, error, match):
    with pytest.raises(error, match=match):
        parse_url("redis://h", **options)


SECRET = "hunter2secret"
LEAKY_URLS = [
    # well-formed credentials, something else wrong
    f"http://user:{SECRET}@h",
    f"redis://user:{SECRET}@h:port",
    f"redis://user:{SECRET}@h:99999",
    f"redis://user:{SECRET}@h/x",
    f"redis://user:{SECRET}@h/0?bogus=1",
    f"redis://user:{SECRET}@h/0?password={SECRET}",
    f"redis://user:{SECRET}@[::1/0",
    # a '/', '?' or '#' left unescaped in the password spills it out of the host part
    f"redis://:{SECRET}/x@h",
    f"redis://:{SECRET}#x@h",
    f"redis://user:/{SECRET}@h",
    f"redis://user:?{SECRET}@h",
    f"redis://user:12/{SECRET}@h",
    f"redis://user:x?socket_timeout={SECRET}@h",
    # a character that NFKC turns into '@' makes Python's urlsplit quote the host part
    f"redis://user:{SECRET}\uff20x@h",
]


@pytest.mark.parametrize("url", LEAKY_URLS)
def test_errors_about_a_url_never_show_its_password(url):
    with pytest.raises((TypeError, ValueError)) as info:
        parse_url(url)
    assert SECRET not in str(info.value)
    assert SECRET[:7] not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        f"redis://user:{SECRET}@h:1/2",
        f"redis://:{SECRET}@h",
        f"rediss://user:{quote(PASSWORD, safe='')}@h/0?ssl_cert_reqs=none",
        f"unix://user:{SECRET}@/tmp/r.sock?db=3",
    ],
)
def test_repr_of_settings_and_locks_never_shows_the_password(core, url):
    settings = parse_url(url)
    assert settings.password is not None
    locks = locks_class(core)(url)
    keyword = locks_class(core)("redis://h", password=SECRET)
    for text in (repr(settings), str(settings), settings.url(), repr(locks), str(locks), repr(keyword)):
        assert SECRET not in text
        assert PASSWORD not in text
        assert "***" in text


def test_settings_url_round_trips_without_the_password():
    settings = parse_url("rediss://alice:pw@[::1]:7000/5")
    assert settings.url() == "rediss://alice:***@[::1]:7000/5"
    assert repr(settings) == "Settings('rediss://alice:***@[::1]:7000/5')"
    assert Settings().url() == "redis://127.0.0.1:6379/0"


# -- passwords and ACL users ------------------------------------------------------------


@pytest.fixture(scope="module")
def acl_server():
    with RedisServer(
        "--requirepass", DEFAULT_PASSWORD, "--user", "alice", "on", f">{PASSWORD}", "~*", "&*", "+@all"
    ) as server:
        yield server


def acl_url(server, user="alice", password=ENCODED):
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


@pytest.mark.parametrize(
    "url",
    [
        acl_url,
        lambda s: acl_url(s, user="", password=DEFAULT_PASSWORD),
        lambda s: acl_url(s, user="default", password=DEFAULT_PASSWORD),
        lambda s: f"unix://alice:{ENCODED}@{s.unixsocket}?db=1",
    ],
    ids=["alice", "default-user", "default-by-name", "unix-socket"],
)
def test_correct_credentials_work(make_locks, acl_server, url):
    round_trip(make_locks(url(acl_server)))


def test_credentials_as_keyword_options(make_locks, acl_server):
    round_trip(make_locks(acl_server.url, username="alice", password=PASSWORD))


@pytest.mark.parametrize(
    ("user", "password"),
    [("alice", "wrong-password"), ("", "wrong-password"), ("nobody", ENCODED), ("alice", DEFAULT_PASSWORD)],
)
def test_wrong_credentials_raise_authentication_error(make_locks, acl_server, user, password):
    locks = make_locks(acl_url(acl_server, user, password))
    with pytest.raises(joblock.AuthenticationError) as info:
        locks.acquire(name(locks, "auth"), 5)
    assert isinstance(info.value, joblock.ConnectionError)
    for secret in (password, PASSWORD, DEFAULT_PASSWORD, "wrong-password"):
        assert secret not in str(info.value)
    with pytest.raises(joblock.BatchConnectionError) as info:
        locks.acquire_many([name(locks, "auth")], 5)
    assert isinstance(info.value, joblock.ConnectionError)  # caught like any unreachable Redis
    assert isinstance(info.value.__cause__, joblock.AuthenticationError)
    assert info.value.granted == 0


def test_no_password_is_an_error_not_a_busy_lock(make_locks, acl_server):
    locks = make_locks(acl_server.url)
    with pytest.raises(joblock.JoblockError, match="NOAUTH"):
        locks.acquire(name(locks, "noauth"), 5)


def test_from_redis_reuses_credentials(core, acl_server):
    client = redis.Redis(host="127.0.0.1", port=acl_server.port, username="alice", password=PASSWORD, db=2)
    with locks_class(core).from_redis(client, prefix="from-redis-acl") as locks:
        assert (locks.settings.username, locks.settings.password, locks.settings.db) == ("alice", PASSWORD, 2)
        assert PASSWORD not in repr(locks)
        lease = locks.acquire(locks.key("J", 1), 5)
        assert client.get(lease.key) == lease.token
        assert lease.release() is True
    client.close()


def test_from_redis_reuses_a_credential_provider(core, acl_server):
    provider = redis.UsernamePasswordCredentialProvider("alice", PASSWORD)
    client = redis.Redis(host="127.0.0.1", port=acl_server.port, credential_provider=provider)
    with locks_class(core).from_redis(client, prefix="from-redis-provider") as locks:
        round_trip(locks)
    client.close()


def test_from_redis_reuses_a_unix_socket(core, redis_server):
    client = redis.Redis(unix_socket_path=redis_server.unixsocket, db=5)
    with locks_class(core).from_redis(client, prefix="from-redis-unix") as locks:
        assert locks.settings.path == redis_server.unixsocket
        lease = locks.acquire(locks.key("J", 1), 5)
        assert client.get(lease.key) == lease.token
        assert lease.release() is True
    client.close()


# -- unix sockets -----------------------------------------------------------------------


def test_unix_socket_url(make_locks, redis_server):
    round_trip(make_locks(f"unix://{redis_server.unixsocket}"))


def test_unix_socket_url_with_a_db(make_locks, redis_server):
    locks = make_locks(f"unix://{redis_server.unixsocket}?db=6")
    lease = locks.acquire(name(locks, "db6"), 5)
    client = redis.Redis(unix_socket_path=redis_server.unixsocket, db=6)
    assert client.get(lease.key) == lease.token
    assert lease.release() is True
    client.close()


def test_a_missing_unix_socket_raises_connection_error(make_locks, tmp_path):
    locks = make_locks(f"unix://{tmp_path}/missing.sock", retries=0)
    with pytest.raises(joblock.ConnectionError, match=r"missing\.sock"):
        locks.acquire("k", 5)


# -- TLS --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate it signed for 127.0.0.1, and an unrelated CA."""
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_port(certs):
    """A port speaking TLS to a real Redis: Redis' own TLS where the binary has it."""
    with tls_server(certs) as port:
        yield port


def test_tls_with_the_right_ca(make_locks, certs, tls_port):
    locks = make_locks(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={certs['ca']}")
    round_trip(locks, n=300)
    lease = locks.acquire(name(locks, "remaining"), 10)
    assert lease.remaining() > 5
    assert lease.release() is True


def test_tls_without_verification(make_locks, tls_port):
    round_trip(make_locks(f"rediss://127.0.0.1:{tls_port}/0?ssl_cert_reqs=none"))


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("rediss://127.0.0.1:{port}/0?ssl_ca_certs={other_ca}", "TLS"),
        ("rediss://localhost:{port}/0?ssl_ca_certs={ca}", "TLS|connect"),  # cert is for 127.0.0.1 only
    ],
    ids=["wrong-ca", "wrong-hostname"],
)
def test_tls_refuses_a_server_it_cannot_verify(make_locks, certs, tls_port, url, match):
    locks = make_locks(url.format(port=tls_port, **certs), retries=0)
    with pytest.raises(joblock.ConnectionError, match=match):
        locks.acquire(name(locks, "tls"), 5)


def test_tls_hostname_check_can_be_turned_off(make_locks, certs, tls_port):
    url = f"rediss://localhost:{tls_port}/0?ssl_ca_certs={certs['ca']}&ssl_check_hostname=false"
    round_trip(make_locks(url))


def test_from_redis_reuses_tls_settings(core, certs, tls_port):
    client = redis.Redis(host="127.0.0.1", port=tls_port, ssl=True, ssl_ca_certs=certs["ca"])
    with locks_class(core).from_redis(client, prefix="from-redis-tls") as locks:
        assert (locks.settings.tls, locks.settings.ssl_ca_certs) == (True, certs["ca"])
        lease = locks.acquire(locks.key("J", 1), 5)
        assert client.get(lease.key) == lease.token
        assert lease.release() is True
    client.close()


# -- unreachable, unresponsive, restarted -----------------------------------------------


def test_a_closed_port_raises_connection_error_without_hanging(make_locks):
    locks = make_locks(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=1)
    started = time.monotonic()
    with pytest.raises(joblock.ConnectionError, match="could not connect"):
        locks.acquire("k", 5)
    with pytest.raises(joblock.ConnectionError) as info:
        locks.acquire_many(["k"], 5)
    assert isinstance(info.value, joblock.BatchError)
    assert isinstance(info.value.__cause__, joblock.ConnectionError)
    assert info.value.granted == 0
    assert time.monotonic() - started < 10  # a guard against hanging, not a speed check


@pytest.fixture
def own_server():
    with RedisServer() as server:
        yield server


def test_a_server_that_stops_answering_raises_timeout_error(make_locks, own_server):
    locks = make_locks(own_server.url, socket_timeout=0.5, retries=1)
    round_trip(locks)
    pid = own_server.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(joblock.TimeoutError, match=r"did not answer within 0\.5 s") as info:
            locks.acquire(name(locks, "paused"), 5)
        assert isinstance(info.value, joblock.ConnectionError)
        assert isinstance(info.value, TimeoutError)
    finally:
        os.kill(pid, signal.SIGCONT)
    round_trip(locks)


def test_operations_work_again_after_the_server_restarts(make_locks, own_server):
    locks = make_locks(own_server.url)
    lease = locks.acquire(name(locks, "before"), 30)
    own_server.stop()
    own_server.start()
    # The first command meets the pooled connection the old server closed, and the new
    # server's empty script cache: both are dealt with.
    fenced = locks.acquire(name(locks, "after"), 30, fence=True)
    assert fenced.fence >= 1
    assert lease.release() is False  # the lock died with the old server
    assert fenced.release() is True
    round_trip(locks)


def test_a_server_that_stays_down_raises_after_bounded_retries(make_locks, own_server):
    locks = make_locks(own_server.url, retries=2)
    lease = locks.acquire(name(locks, "down"), 30)
    own_server.stop()
    with pytest.raises(joblock.ConnectionError):
        lease.release()
    with pytest.raises(joblock.ConnectionError):
        locks.acquire(name(locks, "down2"), 30)
    own_server.start()
    round_trip(locks)


def test_release_on_a_connection_the_server_closed_still_reports_expiry(make_locks, own_server):
    locks = make_locks(own_server.url)
    client = redis.Redis.from_url(own_server.url)
    round_trip(locks)  # the scripts are loaded, the connection is pooled
    lease = locks.acquire(name(locks, "stale"), 0.1)
    held = locks.acquire(name(locks, "stale-held"), 30)
    time.sleep(0.25)
    assert client.client_kill_filter(_type="normal", skipme=True) >= 1
    assert lease.release() is False  # expired: the stale socket must not make it look released
    assert client.client_kill_filter(_type="normal", skipme=True) >= 1
    assert held.release() is True
    client.close()


# -- fork safety ------------------------------------------------------------------------


def client_id(locks):
    """The server's id of the connection the Locks uses."""
    return command(locks, "CLIENT", "ID")


def child_work(locks, parent_key):
    assert locks.acquire(parent_key, 5) is None  # the parent holds it
    for i in range(100):
        lease = locks.acquire(name(locks, f"child{i}"), 5)
        assert lease.token.endswith(b":%d" % os.getpid())
        assert lease.release() is True
    leases = locks.acquire_many([name(locks, f"child-many{i}") for i in range(500)], 5)
    assert locks.release_many(leases) == [True] * 500
    return client_id(locks)


def run_in_child(work, *args):
    """Runs ``work`` in a forked child; returns its exit code and what it wrote back."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(read_end)
            os.write(write_end, str(work(*args)).encode())
            code = 0
        except BaseException:
            os.write(write_end, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), report


def test_a_forked_child_never_uses_its_parents_connection(locks):
    parent_key = name(locks, "parent")
    lease = locks.acquire(parent_key, 30)
    parent_id = client_id(locks)
    code, report = run_in_child(child_work, locks, parent_key)
    assert code == 0, report
    assert int(report) != parent_id
    # The parent's socket is intact and in step: same connection, right replies.
    assert client_id(locks) == parent_id
    assert 20 < lease.remaining() <= 30
    assert lease.extend(60) is True
    assert locks.acquire(parent_key, 5) is None
    assert lease.release() is True
    round_trip(locks)
    assert client_id(locks) == parent_id


def test_a_forked_child_of_a_tls_client_opens_its_own_connection(make_locks, certs, tls_port):
    locks = make_locks(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={certs['ca']}")
    parent_key = name(locks, "parent")
    lease = locks.acquire(parent_key, 30)
    parent_id = client_id(locks)
    code, report = run_in_child(child_work, locks, parent_key)
    assert code == 0, report
    assert int(report) != parent_id
    assert client_id(locks) == parent_id
    assert lease.release() is True
