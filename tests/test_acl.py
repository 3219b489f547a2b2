"""Security: an ACL user allowed only the commands joblock needs, on keys under its prefix,
runs the whole API (over TCP and over rediss:// with a CA the tests make); each command
of that list is needed; and lock tokens look like the OS's CSPRNG output they are.

The least-privilege user, as the README gives it::

    ACL SETUSER joblock on >PASSWORD resetkeys ~joblock:* ~{joblock:* resetchannels &joblock:wake:*
        -@all +set +get +evalsha +script|load +del +pexpire +pttl +incr +type +time +lpop +rpush +lrem
        +lpos +lindex +pubsub|numsub +publish +subscribe

plus ``+select`` for a database other than 0, ``+client|setname`` with ``client_name``,
``+scan +info`` for ``joblock inspect`` and ``joblock release``, and what the scripts of
counting locks and of the debounce lifetime call (``COUNTING``, ``DEBOUNCING``).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import random
import sys
import threading
import time

import pytest
import redis

import joblock
from conftest import TWINS
from helpers import FORKS, draw_across_a_fork, make_certs, tls_server, twin_name
from joblock._tools import admin
from joblock._tools.servers import RedisServer
from joblock.compat import RedisLock
from joblock.frameworks import DEBOUNCE, Policy, Run, Ticket, admit
from rig.faults import FaultProxy

PASSWORD = "acl-Secret-1"
# What joblock itself sends (SET, GET, EVALSHA, SCRIPT LOAD, and SUBSCRIBE for waits) and
# what its scripts call (the list commands and PUBLISH: a lock's queue of waiters).
NEEDED = [
    "set", "get", "evalsha", "script|load", "del", "pexpire", "pttl", "incr", "type", "time", "lpop", "rpush",
    "lrem", "lpos", "lindex", "pubsub|numsub", "publish", "subscribe",
]  # fmt: skip
KEYS = ["resetkeys", "~joblock:*", "~{joblock:*", "resetchannels", "&joblock:wake:*"]
LEAST = ["on", f">{PASSWORD}", *KEYS, "-@all", *(f"+{command}" for command in NEEDED)]
# What the counting-lock scripts call besides (and what a plain acquire asks of a counting
# lock's key, ZSCORE, to name its limit); what the debounce lifetime's scripts call.
COUNTING = ["zscore", "zrange", "zremrangebyscore", "zcard", "zadd", "zrem", "pexpireat"]
DEBOUNCING = ["hget", "hset", "hdel", "exists"]
USERS = {
    "joblock": LEAST,
    "joblock-db": [*LEAST, "+select", "+client|setname"],
    "joblock-tools": [*LEAST, "+scan", "+info"],
    "joblock-wait": [*LEAST, "+wait"],
    **{f"without-{command}": [rule for rule in LEAST if rule != f"+{command}"] for command in NEEDED},
    **{
        f"{kind}-without-{command}": [*LEAST, *(f"+{c}" for c in commands if c != command)]
        for kind, commands in (("counting", COUNTING), ("debounce", DEBOUNCING))
        for command in [*commands, "nothing"]
    },
}
_namespaces = itertools.count()


@pytest.fixture(scope="module")
def acl_server():
    with RedisServer() as server:
        client = redis.Redis(unix_socket_path=server.unixsocket)
        for user, rules in USERS.items():
            client.execute_command("ACL", "SETUSER", user, *rules)
        client.close()
        yield server


@pytest.fixture
def admin_client(acl_server):
    client = redis.Redis(unix_socket_path=acl_server.unixsocket)
    yield client
    client.close()


def url_for(server, user, db=0, query=""):
    return f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/{db}{query}"


def exercise(core, locks, client, admin_client=None, proxy_url=None):
    """Every operation of the API once, on keys under ``locks.prefix``.

    ``client`` is a redis-py client logged in as the same user (for compat);
    ``admin_client`` flushes the script cache so that joblock must load its scripts;
    ``proxy_url`` reaches the same server through a proxy that cuts the first reply, so
    an acquire is retried and recognises the lock its lost reply granted.
    """
    p = locks.prefix
    if admin_client is not None:
        admin_client.script_flush()
    lease = locks.acquire(f"{p}:a", 30)
    assert locks.acquire(f"{p}:a", 30) is None
    assert lease.extend(60) is True
    assert 50 < lease.remaining() <= 60
    assert lease.release() is True
    fenced = locks.acquire(f"{p}:f", 30, fence=True)
    assert fenced.fence >= 1
    assert fenced.release() is True
    with locks.lock(f"{p}:with", 30) as held:
        assert held.held
    # Waits: the waiter queues (in a thread), the release hands it the lock.
    holder = locks.acquire(f"{p}:wait", 30)
    waiter = Waiter(locks, f"{p}:wait", admin_client)
    assert holder.release() is True
    assert waiter.lease().release() is True
    holder = locks.acquire(f"{p}:wait", 30)
    assert locks.acquire(f"{p}:wait", 30, wait=0.05) is None  # leaves the queue at its end
    # The first waiter looks again when the lock would expire: here it was extended, so
    # the waiter queues on until the release hands the lock over.
    assert holder.extend(0.8) is True
    waiter = Waiter(locks, f"{p}:wait", admin_client)
    assert holder.extend(2) is True
    time.sleep(1)
    assert holder.release() is True
    assert waiter.lease().release() is True
    fair = locks.acquire(f"{p}:wait", 30, fair=True)
    assert fair.release() is True
    keys = [f"{p}:many{i}" for i in range(50)]
    leases = locks.acquire_many(keys, 30, fence=True)
    assert locks.extend_many(leases, 60) == [True] * 50
    assert locks.release_many(leases) == [True] * 50
    deduped = locks.dedupe("Job", [(i % 10,) for i in range(30)], 30)
    assert sum(lease is not None for lease in deduped) == 10
    assert locks.release_many(deduped).count(True) == 10

    @locks.job(ttl=30)
    def job(x):
        return x * 2

    assert job(21) == 42
    lock_class = type("RedisLock", (RedisLock,), {"_core": core})
    compat = client.lock(f"{p}:compat", timeout=30, lock_class=lock_class)
    assert compat.acquire(blocking=False)
    assert compat.locked() and compat.owned()
    compat.extend(30)
    compat.reacquire()
    compat.release()
    if proxy_url is not None:
        retried = type(locks)(proxy_url, prefix=p)
        lease = retried.acquire(f"{p}:retried", 30)
        assert lease is not None
        assert lease.release() is True
        retried.close()
    return [f"{p}:{name}" for name in ("a", "f", "with", "wait", "compat", "retried")] + keys


class Waiter:
    """``locks.acquire(key, 30, wait=10)`` in a thread, queued once the constructor returns."""

    def __init__(self, locks, key, admin_client):
        self._got = []
        self._thread = threading.Thread(target=self._wait, args=(locks, key))
        self._thread.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and self._thread.is_alive():
            if admin_client is None:
                time.sleep(0.2)
                break
            if admin_client.llen("{" + key + "}:waiters"):
                break
            time.sleep(0.005)

    def _wait(self, locks, key):
        try:
            self._got.append(locks.acquire(key, 30, wait=10))
        except Exception as e:
            self._got.append(e)

    def lease(self):
        self._thread.join()
        if isinstance(self._got[0], Exception):
            raise self._got[0]
        return self._got[0]


def leftovers(admin_client, prefix):
    return list(admin_client.scan_iter(match=f"{prefix}:*"))


def test_the_least_privileged_user_runs_the_whole_api(core, make_locks, acl_server, admin_client):
    prefix = f"joblock:acl{next(_namespaces)}"
    proxy = FaultProxy(acl_server.port, after=0)
    client = redis.Redis(host="127.0.0.1", port=acl_server.port, username="joblock", password=PASSWORD)
    try:
        locks = make_locks(url_for(acl_server, "joblock"), prefix=prefix)
        proxy_url = proxy.url.replace("redis://", f"redis://joblock:{PASSWORD}@")
        exercise(core, locks, client, admin_client, proxy_url)
        assert proxy.cut == 1
    finally:
        proxy.close()
        client.close()
    assert leftovers(admin_client, prefix) == []


def test_keys_outside_the_users_pattern_are_refused(make_locks, acl_server, admin_client):
    locks = make_locks(url_for(acl_server, "joblock"), prefix="elsewhere")
    with pytest.raises(joblock.NoPermissionError) as info:
        locks.acquire("elsewhere:k", 30)
    assert info.value.key == b"elsewhere:k"
    assert admin_client.exists("elsewhere:k") == 0


def test_a_database_and_a_client_name_need_select_and_client_setname(core, make_locks, acl_server):
    prefix = f"joblock:acl{next(_namespaces)}"
    query = "?client_name=worker-1"
    for user, error in (("joblock", joblock.NoPermissionError), ("joblock-db", None)):
        locks = make_locks(url_for(acl_server, user, db=3, query=query), prefix=prefix)
        if error is not None:
            with pytest.raises(error, match="select"):
                locks.acquire(f"{prefix}:k", 30)
            continue
        client = redis.Redis(host="127.0.0.1", port=acl_server.port, db=3, username=user, password=PASSWORD)
        exercise(core, locks, client)
        client.close()


def test_min_replicas_needs_wait(core, make_locks, acl_server, admin_client):
    """A refused WAIT is raised as it is (the grant given up first); with WAIT allowed,
    a server without replicas confirms nothing."""
    prefix = f"joblock:acl{next(_namespaces)}"
    without = make_locks(url_for(acl_server, "joblock"), prefix=prefix, min_replicas=1)
    with pytest.raises(joblock.NoPermissionError, match="wait"):
        without.acquire(f"{prefix}:k", 30)
    allowed = make_locks(
        url_for(acl_server, "joblock-wait"), prefix=prefix, min_replicas=1, replica_timeout=0.05
    )
    with pytest.raises(joblock.ReplicationError):
        allowed.acquire(f"{prefix}:k", 30)
    assert admin_client.exists(f"{prefix}:k") == 0


def test_the_tools_need_scan_and_info_too(acl_server, admin_client, capsys):
    prefix = f"joblock:acl{next(_namespaces)}"
    locks = joblock.Locks(url_for(acl_server, "joblock-tools"), prefix=prefix)
    lease = locks.acquire(f"{prefix}:Job:1", 30, fence=True)
    assert admin.inspect(url_for(acl_server, "joblock-tools"), prefix, "*") == 0
    assert f"{prefix}:Job:1" in capsys.readouterr().out
    assert admin.release(url_for(acl_server, "joblock-tools"), f"{prefix}:Job:1") == 0
    assert lease.release() is False
    with pytest.raises(joblock.NoPermissionError, match=r"info|scan"):
        admin.inspect(url_for(acl_server, "joblock"), prefix, "*")
    locks.close()


@pytest.mark.parametrize("command", NEEDED)
def test_every_command_of_the_list_is_needed(core, make_locks, acl_server, admin_client, command):
    prefix = f"joblock:acl{next(_namespaces)}"
    user = f"without-{command}"
    proxy = FaultProxy(acl_server.port, after=0)
    client = redis.Redis(host="127.0.0.1", port=acl_server.port, username=user, password=PASSWORD)
    try:
        locks = make_locks(url_for(acl_server, user), prefix=prefix)
        proxy_url = proxy.url.replace("redis://", f"redis://{user}:{PASSWORD}@")
        with pytest.raises(Exception) as info:
            exercise(core, locks, client, admin_client, proxy_url)
    finally:
        proxy.close()
        client.close()
    error = info.value
    while not isinstance(error, joblock.NoPermissionError) and error.__cause__ is not None:
        error = error.__cause__  # through BatchError, or redis-py's error in compat
    assert isinstance(error, joblock.NoPermissionError), repr(info.value)
    if command in ("set", "evalsha", "script|load"):  # sent by joblock itself: named
        assert command.split("|")[0] in str(error)
    admin_client.delete(*admin_client.scan_iter(match=f"{prefix}:*"), f"{prefix}:_")


def count(locks):
    """Counting locks' API once, and a plain acquire of a counting lock's key."""
    p = locks.prefix
    leases = [locks.acquire(f"{p}:count", 30, limit=2) for _ in range(3)]
    assert leases[2] is None
    assert leases[0].extend(60) is True
    assert 50 < leases[0].remaining() <= 60
    with pytest.raises(joblock.LimitMismatchError, match="limit=2, not a plain lock"):
        locks.acquire(f"{p}:count", 30)
    batch = locks.acquire_many([f"{p}:batch"] * 3, 30, limit=2, fence=True)
    assert locks.release_many([*leases[:2], *batch]) == [True, True, True, True, False]


def debounce(locks):
    """Two enqueues of a debounced job and their messages at the worker (the last one runs),
    then an enqueue whose message could not be sent, which undoes what it wrote."""
    policy = Policy(locks, name="Reindex", lifetime=DEBOUNCE, identifier=lambda doc: doc, ttl=10, debounce=30)
    admissions = [admit(policy, ("doc",), {}) for _ in range(2)]
    runs = [
        Run(policy, Ticket.load(a.ticket.dump()), ("doc",), {}, job_id=str(i))
        for i, a in enumerate(admissions)
    ]
    assert runs[0].begin() is not None  # superseded
    assert runs[1].begin() is None
    with runs[1]:
        pass
    admit(policy, ("unsent",), {}).abandon()  # logs what it could not undo


def denied(error, records):
    """Whether a NoPermissionError is behind ``error`` (through BatchError), or was logged."""
    while error is not None and not isinstance(error, joblock.NoPermissionError):
        error = error.__cause__
    logged = [arg for record in records for arg in record.args or ()]
    return error is not None or any(isinstance(arg, joblock.NoPermissionError) for arg in logged)


@pytest.mark.parametrize(
    ("kind", "exercise_kind", "commands"), [("counting", count, COUNTING), ("debounce", debounce, DEBOUNCING)]
)
def test_counting_locks_and_debounce_need_their_scripts_commands(
    make_locks, acl_server, admin_client, caplog, kind, exercise_kind, commands
):
    prefix = f"joblock:acl{next(_namespaces)}"
    with caplog.at_level(logging.WARNING, logger="joblock"):
        exercise_kind(make_locks(url_for(acl_server, f"{kind}-without-nothing"), prefix=prefix))
    assert caplog.text == ""
    for command in commands:
        admin_client.delete(*admin_client.scan_iter(match=f"{prefix}:*"), f"{prefix}:_")
        caplog.clear()
        locks = make_locks(url_for(acl_server, f"{kind}-without-{command}"), prefix=prefix)
        error = None
        with caplog.at_level(logging.WARNING, logger="joblock"):
            try:
                exercise_kind(locks)
            except joblock.JoblockError as e:
                error = e
        assert denied(error, caplog.records), command


# -- TLS with a CA the tests make, and the least-privileged user --------------------------------


@pytest.fixture(scope="module")
def tls_acl_port(tmp_path_factory):
    certs = make_certs(tmp_path_factory.mktemp("acl-tls"))
    with tls_server(certs, "--user", "joblock", *LEAST) as port:
        yield port, certs


def test_the_whole_api_over_tls_as_the_least_privileged_user(core, make_locks, tls_acl_port):
    port, certs = tls_acl_port
    prefix = f"joblock:acl{next(_namespaces)}"
    url = f"rediss://joblock:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={certs['ca']}"
    locks = make_locks(url, prefix=prefix)
    assert locks.settings.tls is True
    client = redis.Redis(
        host="127.0.0.1", port=port, username="joblock", password=PASSWORD, ssl=True, ssl_ca_certs=certs["ca"]
    )
    used = exercise(core, locks, client)
    assert [client.get(key) for key in used] == [None] * len(used)  # every lock went back
    client.close()
    untrusted = make_locks(url.replace(certs["ca"], certs["other_ca"]), prefix=prefix, retries=0)
    with pytest.raises(joblock.ConnectionError, match="TLS"):
        untrusted.acquire(f"{prefix}:k", 30)


# -- tokens ---------------------------------------------------------------------------------------

N = 20_000


def bits(token: bytes) -> int:
    return int(token[:32], 16)


def test_tokens_are_distinct_uniform_128_bit_hex(core):
    tokens = core.new_values(N, b"@h:1")
    assert len(set(tokens)) == N
    hexdigits = set(b"0123456789abcdef")
    assert all(len(t) == 36 and t.endswith(b"@h:1") and set(t[:32]) <= hexdigits for t in tokens)
    numbers = [bits(t) for t in tokens]
    # Each of the 128 bits is set in about half the tokens (6 standard deviations).
    sigma = (N / 4) ** 0.5
    for bit in range(128):
        ones = sum((n >> bit) & 1 for n in numbers)
        assert abs(ones - N / 2) < 6 * sigma, f"bit {bit} set in {ones} of {N} tokens"
    # The 16 hex digits are equally common (chi-square, 15 degrees of freedom).
    digits = b"".join(t[:32] for t in tokens)
    expected = len(digits) / 16
    chi2 = sum((digits.count(d) - expected) ** 2 / expected for d in b"0123456789abcdef")
    assert chi2 < 60, chi2
    # Consecutive tokens share no more bits than chance: 64 of 128 differ on average.
    flips = [bin(a ^ b).count("1") for a, b in itertools.pairwise(numbers)]
    assert abs(sum(flips) / len(flips) - 64) < 6 * (32 / len(flips)) ** 0.5


def test_tokens_do_not_come_from_the_random_module(core):
    # Seeded alike, Python's Mersenne Twister repeats itself; the OS's CSPRNG does not.
    random.seed(42)
    state = random.getstate()
    first = core.new_values(8, b"")
    assert random.getstate() == state  # the random module was not drawn from
    random.seed(42)
    assert set(core.new_values(8, b"")).isdisjoint(first)


@pytest.mark.parametrize("per_draw", [1, 1000], ids=["single-from-the-pool", "batch"])
@pytest.mark.parametrize("fork", list(FORKS))
def test_a_forked_child_draws_tokens_of_its_own(core, fork, per_draw):
    # The fork happens in a spawned process of one thread (helpers.draw_across_a_fork).
    context = multiprocessing.get_context("spawn")
    report = context.Queue()
    process = context.Process(target=draw_across_a_fork, args=(twin_name(core), fork, per_draw, report))
    process.start()
    theirs, ours = report.get(timeout=120)
    process.join(30)
    assert process.exitcode == 0
    assert len(theirs) == len(ours) == 1000
    assert ours.isdisjoint(theirs)


def test_a_negative_number_of_tokens_is_refused(core):
    with pytest.raises(ValueError, match="n must not be negative, not -1"):
        core.new_values(-1, b"")
    first, second = core.new_values(1, b""), core.new_values(1, b"")
    assert first != second


def test_threads_drawing_at_once_never_draw_the_same_token(core):
    drawn: list[list[bytes]] = [[] for _ in range(16)]
    start = threading.Barrier(len(drawn))

    def draw(mine: list[bytes]) -> None:
        start.wait()
        for i in range(1500):
            mine.extend(core.new_values(1 + i % 3, b""))

    threads = [threading.Thread(target=draw, args=(mine,)) for mine in drawn]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns as often as CPython lets them
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    tokens = [token for mine in drawn for token in mine]
    assert len(tokens) == 16 * 500 * (1 + 2 + 3)
    assert len(set(tokens)) == len(tokens)


def test_the_twins_draw_independently():
    drawn = [token for core in TWINS.values() for token in core.new_values(1000, b"")]
    assert len(set(drawn)) == len(drawn)
    assert twin_name(TWINS["python"]) == "python"
