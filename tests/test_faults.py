"""Faults against real servers: a holder killed, Redis restarted mid-batch, replies lost to a
cut connection, a server that stops answering or is not Redis, and error replies.

Each fault must leave mutual exclusion intact and end in a clear outcome: a lease, None,
or a joblock exception that says what happened. Every test runs on each twin of the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import socket
import threading
import time

import pytest
import redis

import joblock
from helpers import (
    assert_counted_once,
    assert_held_in_redis,
    hold_until_killed,
    name,
    names,
    natively,
    stored,
    twin_name,
)
from joblock._scripts import SCRIPTS
from joblock._tools.servers import RedisServer
from joblock.aio import AsyncLocks
from rig.faults import FaultProxy

TTL = 30


@pytest.fixture
def own_server():
    with RedisServer() as server:
        yield server


def client_of(server):
    return redis.Redis(unix_socket_path=server.unixsocket)


def lock_keys(raw, locks):
    return stored(raw, locks)


# -- a holder killed with SIGKILL -----------------------------------------------------------


def test_a_killed_holders_locks_free_at_their_ttl_never_earlier(core, make_locks, raw, redis_server):
    locks = make_locks()
    key, batch = name(locks, "killed"), names(locks, 50, "killed-batch")
    ttl = 1.5
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    holder = context.Process(
        target=hold_until_killed, args=(twin_name(core), redis_server.url, key, batch, ttl, theirs)
    )
    holder.start()
    try:
        assert ours.poll(60), "the holder never reported its locks"
        started, tokens, fence = ours.recv()
    finally:
        holder.kill()  # SIGKILL: no release, no cleanup, as a crash or the OOM killer
        holder.join(10)
    assert holder.exitcode == -signal.SIGKILL
    assert fence >= 1
    keys = [key, *batch]
    # Until Redis expires them, every lock still holds the dead holder's token, and well
    # before then nobody else can take one.
    while True:
        values = raw.mget(keys)
        now = time.monotonic()
        if values != tokens:
            break
        if now < started + ttl - 0.3:
            assert locks.acquire(key, 5) is None
            assert locks.acquire_many(batch[:5], 5) == [None] * 5
        time.sleep(0.01)
    # ``now`` is after the first look that found a lock free: had any freed before its
    # ttl, this would be too (Redis set each expiry after ``started``).
    assert now >= started + ttl - 0.005, f"a lock freed {started + ttl - now:.3f} s before its ttl"
    # Once free, each lock is free for good: none held by anyone else in between.
    deadline = time.monotonic() + 10
    while any(value is not None for value in raw.mget(keys)):
        assert all(value in (token, None) for value, token in zip(raw.mget(keys), tokens))
        assert time.monotonic() < deadline, "the locks never expired"
        time.sleep(0.01)
    # The next holder's fencing number is higher: the dead holder's late writes can be refused.
    lease = locks.acquire(key, 5, fence=True)
    assert lease.fence > fence
    assert lease.release() is True
    taken = locks.acquire_many(batch, 5)
    assert all(each is not None for each in taken)
    assert locks.release_many(taken) == [True] * len(batch)


# -- Redis restarted mid-batch --------------------------------------------------------------


def restart(server, *, persist):
    """Restarts ``server`` on its port: shut down saving its data, or killed (data lost)."""
    if persist:
        # A bare socket: redis-py would retry the connection the shutdown closes.
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(server.unixsocket)
            sock.sendall(b"*2\r\n$8\r\nSHUTDOWN\r\n$4\r\nSAVE\r\n")
            assert sock.recv(100) == b""
        server.process.wait(10)
    else:
        server.kill()
    server.stop()
    server.start()


def restarting(keys, at, action):
    """The keys, with ``action`` run when the batch asks for key number ``at``: by then
    the windows before it are on the wire, some of them unanswered."""
    for i, key in enumerate(keys):
        if i == at:
            action()
        yield key


N = 6000
WINDOW = 250


def contested(locks, other):
    """N fresh keys, every tenth held by ``other``, then the first 500 again."""
    keys = names(locks, N)
    held = other.acquire_many(keys[::10], 60)
    return [*keys, *keys[:500]], held


@pytest.mark.parametrize("fence", [False, True])
def test_a_restart_mid_batch_grants_each_lock_exactly_once(make_locks, own_server, fence):
    """Redis shut down (saving) and back mid-batch: the batch goes on after reconnecting,
    windows in flight are retried and recognise the grants the old server made, the
    other holder's locks are never granted, and scripts are loaded again."""
    locks = make_locks(own_server.url, window=WINDOW)
    other = make_locks(own_server.url)
    keys, held = contested(locks, other)
    leases = locks.acquire_many(
        restarting(keys, N // 2 + 10, lambda: restart(own_server, persist=True)), TTL, fence=fence
    )
    raw = client_of(own_server)
    expected = [i < N and i % 10 != 0 for i in range(len(keys))]
    assert [lease is not None for lease in leases] == expected
    assert_held_in_redis(raw, leases)
    granted = [lease for lease in leases if lease is not None]
    assert len({lease.token for lease in granted}) == len(granted)
    if fence:
        assert_counted_once(granted, fresh=True)
    # Release and extend are scripts (but on a server with native commands, where a plain
    # lock's are its own): the new server loads them on NOSCRIPT.
    assert locks.extend_many(leases, 60) == expected
    if fence or not natively(own_server.url):
        assert raw.script_exists(*SCRIPTS) == [True] * len(SCRIPTS)
    assert locks.release_many(leases) == expected
    assert other.release_many(held) == [True] * len(held)
    assert lock_keys(raw, locks) == []
    raw.close()


def test_a_crash_and_restart_mid_batch_never_reports_a_lock_it_does_not_hold(make_locks, own_server):
    """Redis killed and back empty mid-batch: the locks granted before the crash are lost
    (as on a failover), but every lock Redis holds afterwards is a lease the call
    returned, and release tells the lost leases from the held ones."""
    locks = make_locks(own_server.url, window=WINDOW)
    keys = names(locks, N)
    leases = locks.acquire_many(
        restarting(keys, N // 2 + 10, lambda: restart(own_server, persist=False)), TTL
    )
    assert all(lease is not None for lease in leases)  # the new server is empty
    raw = client_of(own_server)
    in_redis = raw.mget(keys)
    held = [value == lease.token for value, lease in zip(in_redis, leases)]
    assert all(value is None or value == lease.token for value, lease in zip(in_redis, leases))
    assert 0 < held.count(True) < N
    assert all(held[N // 2 :])  # every window sent after the restart is held
    assert locks.release_many(leases) == held
    assert lock_keys(raw, locks) == []
    raw.close()


def test_a_server_down_mid_batch_raises_batch_connection_error(make_locks, own_server):
    """Redis killed mid-batch and not back within the retries: a clear BatchConnectionError
    counting the grants; once Redis is back, everything works again, scripts included."""
    locks = make_locks(own_server.url, window=WINDOW, retries=2)
    keys = names(locks, N)
    with pytest.raises(joblock.BatchConnectionError) as info:
        locks.acquire_many(restarting(keys, N // 2 + 10, own_server.kill), TTL, fence=True)
    error = info.value
    assert isinstance(error, joblock.ConnectionError)
    assert isinstance(error.__cause__, joblock.ConnectionError)
    # The batch reads its input a window ahead of the two in flight: those two were
    # unanswered when the server died.
    assert error.granted >= N // 2 - 2 * WINDOW
    assert error.unreleased == error.granted  # nobody to release them to: they expire at their ttl
    assert f"{error.granted} locks had been granted: 0 released, {error.granted} not" in str(error)
    assert "expires at its ttl" in str(error)
    own_server.stop()
    own_server.start()
    lease = locks.acquire(keys[0], TTL, fence=True)  # the new server's script cache is empty
    assert lease.fence >= 1
    assert lease.extend(60) is True
    assert lease.release() is True
    leases = locks.acquire_many(keys, TTL)
    assert locks.release_many(leases) == [True] * N


@contextlib.contextmanager
def restarted_loading(keys, seconds_per_key=0.0005):
    """A server restarted with an RDB file of ``keys`` keys, loading it at
    ``seconds_per_key`` a key (Redis' own test option: a small file, a load of a known
    length); yields it and a function that waits for the load's end, once it answers LOADING."""
    with RedisServer() as server:
        raw = client_of(server)
        pipe = raw.pipeline(transaction=False)
        for i in range(keys):
            pipe.set(f"loading:{i}", i)
        pipe.execute()
        raw.save()
        raw.close()
        server.stop()
        # Redis answers while it loads between chunks of this many bytes of the file
        # (about 50 keys, 25 ms; an AOF's load answers every 1024 commands instead).
        delay = str(round(seconds_per_key * 1e6))
        server.args += ["--key-load-delay", delay, "--loading-process-events-interval-bytes", "1024"]
        # start() returns once loaded; its usual 10 s for an answer are too few on a loaded
        # machine, where it then killed the server mid-load (the client saw a reset).
        starting = threading.Thread(target=server.start, kwargs={"timeout": 120})
        starting.start()
        try:
            loading_reply(server)
            yield server, starting.join
        finally:
            starting.join()


def test_a_call_made_while_redis_loads_its_dataset_waits_for_the_load(core, make_locks):
    """Redis restarted with persistence answers LOADING while it reads its dataset (found
    by the chaos run): nothing ran, so the call goes again on a new connection after a
    pause, growing from 50 ms to 1 s, for up to socket_timeout: a load of over a second that the
    calls' retries alone (3, at once) would have turned into ConnectionError. Threads and
    asyncio, one Locks and one AsyncLocks on the test's twin, each call made while loading."""
    aio_class = type("AsyncLocks", (AsyncLocks,), {"_core": core})
    with restarted_loading(2000) as (server, _):  # 1 s of loading, and more
        started = time.monotonic()
        with FaultProxy(server.port) as proxy:  # counts the connections
            locks = make_locks(proxy.url)
            key = name(locks, "loading")
            out = {}

            def in_asyncio():
                async def main():
                    alocks = aio_class(proxy.url, prefix=locks.prefix)
                    try:
                        lease = await alocks.acquire(key + ":aio", TTL, fence=True)
                        out["aio"] = (lease.fence, await lease.release())
                    finally:
                        await alocks.close()

                asyncio.run(main())

            task = threading.Thread(target=in_asyncio)
            task.start()
            lease = locks.acquire(key, TTL, fence=True)
            task.join()
            waited = time.monotonic() - started
            assert lease is not None and lease.fence >= 1 and lease.release() is True
            assert out["aio"] == (1, True)
            assert waited > 0.75, "the server was loaded before the calls found it loading"
            # Two clients, each a connection per pause: far fewer than a retry per 1 ms.
            assert 4 <= proxy.connections <= 2 * 10


def test_a_load_longer_than_socket_timeout_raises_connection_error(core, make_locks):
    """The wait for a loading server is bounded: past socket_timeout from its first
    LOADING, the calls spend their retries and raise ConnectionError, never the LOADING
    reply; once loaded, the same client takes the lock."""
    with restarted_loading(3000) as (server, loaded):  # 1.5 s of loading, and more
        locks = make_locks(server.url, socket_timeout=0.5, retries=2)
        key = name(locks, "loading")
        started = time.monotonic()
        with pytest.raises(joblock.ConnectionError, match=r"127\.0\.0\.1:\d+ is loading its dataset"):
            locks.acquire(key, TTL)
        assert time.monotonic() - started < 1.5  # about socket_timeout, not the whole load
        loaded()
        lease = locks.acquire(key, TTL)
        assert lease is not None and lease.release() is True


def loading_reply(server):
    """Waits until ``server`` listens and answers PING with LOADING."""
    while True:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock,
        ):
            sock.sendall(b"PING\r\n")
            reply = sock.recv(100)
            assert reply != b"+PONG\r\n", "the server was loaded before it was seen loading"
            if reply.startswith(b"-LOADING "):
                return
        time.sleep(0.01)


# -- the connection cut after a command was sent, before its reply -------------------------


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


@pytest.fixture
def scripts_loaded(raw):
    for body in SCRIPTS.values():
        raw.script_load(body)


@pytest.mark.parametrize("after", [0, 1, 3])  # the reply lost whole, or cut after 1 or 3 bytes
@pytest.mark.parametrize("fence", [False, True])
@pytest.mark.parametrize("limit", [1, 3])  # a plain lock, a counting lock
def test_a_lost_acquire_reply_is_retried_and_recognises_its_own_lock(
    make_locks, proxy_to, raw, scripts_loaded, after, fence, limit
):
    proxy = proxy_to(after)
    locks = make_locks(proxy.url)
    key = name(locks, "lost-reply")
    lease = locks.acquire(key, TTL, fence=fence, limit=limit)
    assert (proxy.cut, proxy.connections) == (1, 2)  # the SET ran; its reply never arrived
    assert lease is not None
    if limit == 1:
        assert raw.get(key) == lease.token
    else:  # one slot taken, not two
        assert raw.zrange(key, 0, -1) == [b"limit", lease.token]
    assert TTL * 1000 - 2000 < raw.pttl(key) <= TTL * 1000
    if fence:
        assert lease.fence >= 1
        assert int(raw.get(locks._core.fence_key(key.encode()))) == lease.fence  # counted once
    # Exactly one of the limit's slots is taken: the others are still free.
    others = [locks.acquire(key, TTL, limit=limit) for _ in range(limit)]
    assert [other is not None for other in others] == [True] * (limit - 1) + [False]
    assert locks.release_many([lease, *others]) == [True] * limit + [False]
    assert lock_keys(raw, locks) == []


@pytest.mark.parametrize("fence", [False, True])
def test_a_lost_acquire_reply_never_takes_another_holders_lock(
    make_locks, proxy_to, raw, scripts_loaded, fence
):
    other = make_locks()
    key = name(other, "someone-elses")
    held = other.acquire(key, TTL)
    proxy = proxy_to(0)
    locks = make_locks(proxy.url)
    assert locks.acquire(key, TTL, fence=fence) is None
    assert proxy.cut == 1
    assert raw.get(key) == held.token
    assert held.release() is True


# Reply bytes: "+OK\r\n" for the acquire, then the cut 1 or 2 bytes into the next reply.
@pytest.mark.parametrize("after", [6, 7])
@pytest.mark.parametrize("operation", ["release", "extend", "remaining"])
@pytest.mark.parametrize("limit", [1, 3])
def test_a_lost_release_extend_or_remaining_reply_is_retried(
    make_locks, proxy_to, raw, scripts_loaded, after, operation, limit
):
    proxy = proxy_to(after)
    locks = make_locks(proxy.url)
    key = name(locks, "lost-script-reply")
    lease = locks.acquire(key, 10, limit=limit)
    if operation == "release":
        assert lease.release() is True  # the retry finds its own DEL done
        assert raw.exists(key) == 0
    elif operation == "extend":
        assert lease.extend(60) is True
        assert raw.pttl(key) > 50_000
        assert lease.release() is True
    else:
        assert 5 < lease.remaining() <= 10
        assert lease.release() is True
    assert proxy.cut == 1


def test_a_lost_release_reply_never_counts_someone_elses_lock_as_released(make_locks, proxy_to, raw):
    # Our lock expires while the release's reply is lost and another holder takes it:
    # the retried release must say False and leave the new holder's lock alone.
    proxy = proxy_to(6)
    locks = make_locks(proxy.url)
    key = name(locks, "expired-then-taken")
    lease = locks.acquire(key, 0.1)
    time.sleep(0.25)
    newcomer = make_locks().acquire(key, TTL)
    assert lease.release() is False
    assert proxy.cut == 1
    assert raw.get(key) == newcomer.token
    assert newcomer.release() is True


# -- a server that stops answering ----------------------------------------------------------


TIMEOUT = 0.2


@pytest.fixture(scope="module")
def pausable_server():
    with RedisServer() as server:
        yield server


OPERATIONS = {
    "acquire": lambda locks, lease: locks.acquire(name(locks, "paused"), 5),
    "acquire-fenced": lambda locks, lease: locks.acquire(name(locks, "paused"), 5, fence=True),
    "acquire-wait": lambda locks, lease: locks.acquire(name(locks, "paused"), 5, wait=2),
    "lock": lambda locks, lease: locks.lock(name(locks, "paused"), 5).__enter__(),
    "acquire_many": lambda locks, lease: locks.acquire_many(names(locks, 100, "paused"), 5),
    "dedupe": lambda locks, lease: locks.dedupe("PausedJob", [(i,) for i in range(100)], 5),
    "release": lambda locks, lease: lease.release(),
    "extend": lambda locks, lease: lease.extend(5),
    "remaining": lambda locks, lease: lease.remaining(),
    "release_many": lambda locks, lease: locks.release_many([lease]),
    "extend_many": lambda locks, lease: locks.extend_many([lease], 5),
}


@pytest.mark.parametrize(
    ("operation", "retries"),
    [*((operation, 0) for operation in OPERATIONS), ("acquire", 1), ("acquire_many", 1), ("release", 2)],
)
def test_a_server_that_stops_answering_gives_a_timeout_error(make_locks, pausable_server, operation, retries):
    locks = make_locks(pausable_server.url, socket_timeout=TIMEOUT, retries=retries)
    lease = locks.acquire(name(locks, "held"), 5)
    pid = pausable_server.process.pid
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(joblock.ConnectionError) as info:
            OPERATIONS[operation](locks, lease)
        elapsed = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    error = info.value
    if isinstance(error, joblock.BatchConnectionError):
        assert error.granted == 0
        error = error.__cause__
    assert isinstance(error, joblock.TimeoutError)
    assert isinstance(error, TimeoutError)  # the builtin too
    assert f"did not answer within {TIMEOUT} s" in str(error)
    assert f"127.0.0.1:{pausable_server.port}" in str(error)
    assert elapsed >= TIMEOUT
    assert elapsed < (retries + 1) * TIMEOUT + 5  # each attempt waits one socket timeout: no hang
    # Once the server runs again it carries out what was sent: every lock has its ttl.
    raw = client_of(pausable_server)
    for key in lock_keys(raw, locks):
        assert 0 < raw.pttl(key) <= 5000
    assert locks.acquire(name(locks, "after"), 5).release() is True
    raw.close()


# -- a peer that is not Redis, or breaks off mid-reply ---------------------------------------


class FakeServer:
    """A loopback TCP server answering every read with ``reply``, then closing if ``close``."""

    def __init__(self, reply: bytes, close: bool) -> None:
        self.reply = reply
        self.close_after = close
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.open.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while client.recv(65536):
                client.sendall(self.reply)
                if self.close_after:
                    client.close()
                    return

    def close(self) -> None:
        self.listener.close()
        for sock in self.open:
            with contextlib.suppress(OSError):
                sock.close()


PEERS = [
    # (what the peer answers, whether it then hangs up, the error)
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", True, joblock.ProtocolError),
    (b"SSH-2.0-OpenSSH_9.2\r\n", False, joblock.ProtocolError),
    (b":12x\r\n", False, joblock.ProtocolError),
    (b"$5\r\nab", True, joblock.ConnectionError),  # a reply cut short by a hang-up
    (b"+O", False, joblock.TimeoutError),  # a reply cut short, then silence
]


@pytest.mark.parametrize(("reply", "close", "error"), PEERS)
@pytest.mark.parametrize("operation", ["acquire", "acquire_many", "with-password"])
def test_a_peer_that_is_not_redis_gives_a_clear_error(make_locks, reply, close, error, operation):
    peer = FakeServer(reply, close)
    try:
        locks = make_locks(peer.url, socket_timeout=TIMEOUT, retries=1)
        with pytest.raises(joblock.JoblockError) as info:
            if operation == "acquire":
                locks.acquire("k", 5)
            elif operation == "acquire_many":
                locks.acquire_many(["k1", "k2"], 5)
            else:
                make_locks(peer.url, password="pw", socket_timeout=TIMEOUT, retries=1).acquire("k", 5)
        got = info.value
        if isinstance(got, joblock.BatchConnectionError):
            assert got.granted == 0
            got = got.__cause__
        assert isinstance(got, error)
        if error is joblock.ProtocolError:
            assert str(got)  # worded by the parser (hiredis or joblock's own)
        else:
            assert f"127.0.0.1:{peer.port}" in str(got)
    finally:
        peer.close()


# -- error replies ------------------------------------------------------------------------------


def assert_names(error, kind, command, key):
    """The error is of its specific kind and names the command and key it came from."""
    assert type(error) is kind
    assert isinstance(error, joblock.ReplyError)
    assert error.command == command
    assert error.key == (key.encode() if isinstance(key, str) else key)
    assert command in str(error)
    if key is not None:
        assert repr(error.key) in str(error)


def test_wrongtype_when_the_key_holds_a_list(locks, raw):
    key = name(locks, "a-list")
    raw.rpush(key, "not a lock")
    # A key that holds no lock is an error, not a busy lock: SET NX GET and the fenced
    # script both meet WRONGTYPE.
    with pytest.raises(joblock.WrongTypeError) as info:
        locks.acquire(key, 5)
    assert_names(info.value, joblock.WrongTypeError, "SET", key)
    with pytest.raises(joblock.WrongTypeError) as info:
        locks.acquire(key, 5, fence=True)
    assert_names(info.value, joblock.WrongTypeError, "EVALSHA", key)
    assert "WRONGTYPE" in str(info.value)
    # A lease whose key was overwritten with a list by someone else.
    other = name(locks, "overwritten")
    lease = locks.acquire(other, 5)
    raw.delete(other)
    raw.rpush(other, "x")
    for operation in (lambda: lease.extend(5), lease.remaining, lease.release):
        with pytest.raises(joblock.WrongTypeError) as info:
            operation()
        assert_names(info.value, joblock.WrongTypeError, "EVALSHA", other)
    with pytest.raises(joblock.WrongTypeError) as info:
        locks.release_many([lease])
    assert_names(info.value, joblock.WrongTypeError, "EVALSHA", other)
    assert raw.lrange(other, 0, -1) == [b"x"]  # never touched
    assert raw.lrange(key, 0, -1) == [b"not a lock"]


def info_replication(client):
    return client.info("replication")


def wait_for(check, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def failed_over():
    """A primary that became a replica, as after a failover, holding a lease per twin.

    Server A takes the locks; B replicates them, is promoted, and A is made B's replica:
    A now has the locks (and the leases' tokens) but refuses writes.
    """
    from conftest import TWINS, locks_class

    sync = ("--repl-diskless-sync-delay", "0")
    with RedisServer(*sync) as a, RedisServer(*sync) as b:
        client_a, client_b = client_of(a), client_of(b)
        client_b.replicaof("127.0.0.1", a.port)
        wait_for(lambda: info_replication(client_b)["master_link_status"] == "up", "B's sync with A")
        made = {twin: locks_class(core)(a.url, prefix=f"ro-{twin}") for twin, core in TWINS.items()}
        leases = {twin: locks.acquire(name(locks, "held"), 300) for twin, locks in made.items()}
        assert client_a.wait(1, 10_000) == 1
        client_b.replicaof("no", "one")
        client_a.replicaof("127.0.0.1", b.port)
        wait_for(lambda: info_replication(client_a)["master_link_status"] == "up", "A's sync with B")
        wait_for(
            lambda: client_a.exists(*[lease.key for lease in leases.values()]) == len(leases), "A's copy"
        )
        yield a, made, leases
        for locks in made.values():
            locks.close()
        client_a.close()
        client_b.close()


def test_readonly_from_a_replica(core, failed_over):
    replica, made, leases = failed_over
    locks, lease = made[twin_name(core)], leases[twin_name(core)]
    key = name(locks, "new")
    with pytest.raises(joblock.ReadOnlyError) as info:
        locks.acquire(key, 5)
    assert_names(info.value, joblock.ReadOnlyError, "SET", key)
    with pytest.raises(joblock.ReadOnlyError) as info:
        locks.acquire(key, 5, fence=True)
    assert_names(info.value, joblock.ReadOnlyError, "EVALSHA", key)
    for batch in (
        lambda: locks.acquire_many([key, name(locks, "new2")], 5),
        lambda: locks.dedupe("J", [(1,), (2,)], 5),
    ):
        with pytest.raises(joblock.BatchError) as info:
            batch()
        assert info.value.granted == 0
        assert type(info.value.__cause__) is joblock.ReadOnlyError
    # The lease's lock is on the replica, but it cannot be released or extended there.
    with pytest.raises(joblock.ReadOnlyError) as info:
        lease.release()
    assert_names(info.value, joblock.ReadOnlyError, "EVALSHA", lease.key)
    with pytest.raises(joblock.ReadOnlyError):
        lease.extend(60)
    with pytest.raises(joblock.ReadOnlyError):
        locks.release_many([lease])
    assert 200 < lease.remaining() <= 300  # reading works
    client = client_of(replica)
    assert client.get(lease.key) == lease.token
    assert client.exists(key) == 0
    client.close()


ALLOWED = "allowed"


@pytest.fixture(scope="module")
def acl_server():
    # alice may use any command but EVALSHA, on keys under "allowed:" only.
    with RedisServer(
        "--user",
        "alice",
        "on",
        ">pw",
        f"~{ALLOWED}:*",
        f"~{{{ALLOWED}:*",
        "&*",
        "+@all",
        "-evalsha",
        "-select",
    ) as server:
        yield server


def test_noperm_from_an_acl(core, make_locks, acl_server):
    # Scripts only: a server's native release and extend need no EVALSHA (tests/test_native.py).
    url = f"redis://alice:pw@127.0.0.1:{acl_server.port}/0?native_commands=false"
    locks = make_locks(url, prefix=f"{ALLOWED}:{twin_name(core)}")
    key = name(locks, "k")
    lease = locks.acquire(key, 5)  # SET is allowed
    assert lease is not None
    with pytest.raises(joblock.NoPermissionError) as info:
        lease.release()
    assert_names(info.value, joblock.NoPermissionError, "EVALSHA", key)
    assert "evalsha" in str(info.value)
    with pytest.raises(joblock.NoPermissionError) as info:
        locks.acquire(name(locks, "fenced"), 5, fence=True)
    assert_names(info.value, joblock.NoPermissionError, "EVALSHA", name(locks, "fenced"))
    forbidden = "elsewhere:k"
    with pytest.raises(joblock.NoPermissionError) as info:
        locks.acquire(forbidden, 5)
    assert_names(info.value, joblock.NoPermissionError, "SET", forbidden)
    with pytest.raises(joblock.BatchError) as info:
        locks.acquire_many([name(locks, "a"), forbidden, name(locks, "b")], 5)
    assert type(info.value.__cause__) is joblock.NoPermissionError
    assert info.value.__cause__.key == forbidden.encode()
    # Without EVALSHA the two granted locks cannot go back: the error says so.
    assert (info.value.granted, info.value.unreleased) == (2, 2)
    assert "2 locks had been granted: 0 released, 2 not" in str(info.value)
    # A database the user may not SELECT fails at connect, naming SELECT.
    with pytest.raises(joblock.NoPermissionError) as info:
        make_locks(f"redis://alice:pw@127.0.0.1:{acl_server.port}/1").acquire(key, 5)
    assert info.value.command == "SELECT 1"
    client = client_of(acl_server)
    assert client.get(key) == lease.token
    assert client.exists(forbidden, name(locks, "fenced")) == 0
    client.delete(key, name(locks, "a"), name(locks, "b"))
    client.close()


@pytest.fixture(scope="module")
def oom_server():
    with RedisServer("--maxmemory", "1", "--maxmemory-policy", "noeviction") as server:
        yield server


def test_oom_when_redis_is_full(make_locks, oom_server):
    client = client_of(oom_server)
    locks = make_locks(oom_server.url)
    client.config_set("maxmemory", 0)
    lease = locks.acquire(name(locks, "held"), 5)
    client.config_set("maxmemory", 1)
    key = name(locks, "k")
    try:
        with pytest.raises(joblock.OutOfMemoryError) as info:
            locks.acquire(key, 5)
        assert_names(info.value, joblock.OutOfMemoryError, "SET", key)
        assert "OOM" in str(info.value)
        with pytest.raises(joblock.OutOfMemoryError) as info:
            locks.acquire(key, 5, fence=True)
        assert_names(info.value, joblock.OutOfMemoryError, "EVALSHA", key)
        with pytest.raises(joblock.BatchError) as info:
            locks.dedupe("J", [(1,), (2,)], 5)
        assert type(info.value.__cause__) is joblock.OutOfMemoryError
        # What frees memory or keeps it level still works when Redis is full.
        assert lease.extend(60) is True
        assert 50 < lease.remaining() <= 60
        assert lease.release() is True
    finally:
        client.config_set("maxmemory", 1)
    assert client.dbsize() == 0
    client.close()
