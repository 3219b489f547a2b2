"""``joblock.compat.RedisLock`` against redis-py's own ``redis.lock.Lock``.

Every test here runs once with redis-py's Lock and once with RedisLock bound to each
twin of the core, all through ``client.lock(name, lock_class=...)``: the same test
passing on all of them is what "drop-in" means. The last test records one scripted
scenario per implementation and compares the transcripts.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import LockError, LockNotOwnedError
from redis.lock import Lock
from redis.retry import Retry

from conftest import API_TWINS, TWINS
from joblock._tools.servers import RedisServer
from joblock.compat import RedisLock

IMPLEMENTATIONS = ["redis-py", *API_TWINS]


def lock_class_for(implementation):
    if implementation == "redis-py":
        return Lock
    return type("RedisLock", (RedisLock,), {"_core": TWINS[implementation]})


@pytest.fixture(params=IMPLEMENTATIONS)
def lock_class(request):
    return lock_class_for(request.param)


@pytest.fixture(params=API_TWINS)
def ours(request):
    """RedisLock on each twin: for what joblock promises beyond redis-py's Lock."""
    return lock_class_for(request.param)


@pytest.fixture
def client(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def name():
    return f"compat:{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def secured():
    """A server that wants a password."""
    with RedisServer("--requirepass", "pw") as server:
        yield server


def gone(client, name, timeout=3.0):
    """Waits until Redis has expired the key; True when it has."""
    deadline = time.monotonic() + timeout
    while client.exists(name):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def in_thread(fn):
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return out


# -- construction --------------------------------------------------------------------------


def test_client_lock_accepts_the_class_and_it_is_a_redis_py_lock(client, lock_class, name):
    lock = client.lock(name, timeout=5, sleep=0.05, blocking=False, blocking_timeout=1, lock_class=lock_class)
    assert type(lock) is lock_class
    assert isinstance(lock, Lock)
    settings = (lock.name, lock.timeout, lock.sleep, lock.blocking, lock.blocking_timeout)
    assert settings == (name, 5, 0.05, False, 1)
    assert lock.redis is client
    assert lock.thread_local is True
    assert lock.local.token is None


def test_direct_construction_works_too(client, lock_class, name):
    lock = lock_class(client, name, timeout=5)
    assert lock.acquire() is True
    assert client.get(name) == lock.local.token
    lock.release()
    assert client.exists(name) == 0


# -- acquire -------------------------------------------------------------------------------


def test_acquire_and_release(client, lock_class, name):
    lock = client.lock(name, lock_class=lock_class)
    assert lock.locked() is False
    assert lock.owned() is False
    assert lock.acquire() is True
    token = lock.local.token
    assert isinstance(token, bytes)
    assert client.get(name) == token
    assert client.pttl(name) == -1  # no timeout: no ttl
    assert lock.locked() is True
    assert lock.owned() is True
    assert lock.release() is None
    assert lock.local.token is None
    assert lock.locked() is False
    assert lock.owned() is False
    assert client.exists(name) == 0


def test_each_acquire_gets_a_fresh_token(client, lock_class, name):
    lock = client.lock(name, lock_class=lock_class)
    lock.acquire()
    first = lock.local.token
    lock.release()
    lock.acquire()
    assert lock.local.token != first
    lock.release()


def test_timeout_sets_the_ttl(client, lock_class, name):
    lock = client.lock(name, timeout=1, lock_class=lock_class)
    assert lock.acquire() is True
    assert 0 < client.pttl(name) <= 1000
    lock.release()
    half = client.lock(name, timeout=0.5, lock_class=lock_class)
    assert half.acquire() is True
    assert 0 < client.pttl(name) <= 500
    half.release()


def test_non_blocking_acquire_fails_while_held(client, lock_class, name):
    holder = client.lock(name, timeout=5, lock_class=lock_class)
    assert holder.acquire() is True
    other = client.lock(name, timeout=5, lock_class=lock_class)
    assert other.acquire(blocking=False) is False
    assert other.local.token is None
    assert other.locked() is True
    assert other.owned() is False
    assert client.lock(name, blocking=False, lock_class=lock_class).acquire() is False
    holder.release()
    assert other.acquire(blocking=False) is True
    other.release()


def test_blocking_timeout_gives_up(client, lock_class, name):
    holder = client.lock(name, timeout=5, lock_class=lock_class)
    holder.acquire()
    other = client.lock(name, timeout=5, sleep=0.05, lock_class=lock_class)
    started = time.monotonic()
    assert other.acquire(blocking_timeout=0.3) is False
    assert time.monotonic() - started >= 0.2  # it did wait
    configured = client.lock(name, timeout=5, sleep=0.05, blocking_timeout=0.1, lock_class=lock_class)
    assert configured.acquire() is False
    holder.release()


def test_blocking_acquire_waits_for_the_release(client, lock_class, name):
    holder = client.lock(name, timeout=5, thread_local=False, lock_class=lock_class)
    holder.acquire()
    timer = threading.Timer(0.2, holder.release)
    timer.start()
    try:
        other = client.lock(name, timeout=5, sleep=0.02, lock_class=lock_class)
        assert other.acquire(blocking_timeout=5) is True
        assert other.owned() is True
        other.release()
    finally:
        timer.join()


def test_a_blocking_acquire_is_handed_the_lock_without_polling(ours, name):
    # A server of its own: the count below is server-wide, and a thread another test left
    # behind on the shared server (a renewal, a listener's reconnect) would be counted too.
    with RedisServer() as server, redis.Redis.from_url(server.url) as client:
        handed_over_without_polling(client, ours, name)


def handed_over_without_polling(client, ours, name):
    holder = client.lock(name, timeout=5, lock_class=ours)
    holder.acquire()
    other = client.lock(name, timeout=None, sleep=0.001, thread_local=False, lock_class=ours)
    got = []
    waiter = threading.Thread(target=lambda: got.append(other.acquire(blocking_timeout=10)))
    waiter.start()
    time.sleep(0.3)
    before = sum(v["calls"] for v in client.info("commandstats").values())
    time.sleep(0.5)  # waiting: with sleep=0.001, redis-py's Lock would poll 500 times
    during = sum(v["calls"] for v in client.info("commandstats").values()) - before
    holder.release()
    waiter.join()
    assert got == [True] and other.owned() is True
    assert during <= 2  # the INFO itself
    assert client.pttl(name) == -1  # no timeout: no expiry, as redis-py's Lock sets
    other.release()


def test_a_name_without_a_slot_for_a_queue_is_polled_as_redis_py_does(client, ours, name):
    odd = name + "}"  # a "}" but no hash tag: its waiters could have no queue in its slot
    holder = client.lock(odd, timeout=5, thread_local=False, lock_class=ours)
    holder.acquire()
    threading.Timer(0.2, holder.release).start()
    other = client.lock(odd, timeout=5, sleep=0.02, lock_class=ours)
    assert other.acquire(blocking_timeout=5) is True
    other.release()


def test_blocking_acquire_waits_for_the_expiry(client, lock_class, name):
    client.lock(name, timeout=0.2, lock_class=lock_class).acquire()
    other = client.lock(name, timeout=5, sleep=0.02, lock_class=lock_class)
    assert other.acquire() is True
    other.release()


@pytest.mark.parametrize("given", ["my-token", b"my-token", "t\u00f6ken"])
def test_acquire_with_a_given_token(client, lock_class, name, given):
    lock = client.lock(name, timeout=5, lock_class=lock_class)
    assert lock.acquire(token=given) is True
    expected = given.encode() if isinstance(given, str) else given
    assert lock.local.token == expected
    assert client.get(name) == expected
    assert lock.owned() is True
    lock.release()
    assert client.exists(name) == 0


def test_bytes_name(client, lock_class, name):
    key = name.encode() + b"\xff"
    lock = client.lock(key, timeout=5, lock_class=lock_class)
    assert lock.acquire() is True
    assert client.get(key) == lock.local.token
    assert lock.locked() is True
    lock.release()
    assert client.exists(key) == 0


# -- threads -------------------------------------------------------------------------------


def test_the_token_is_thread_local_by_default(client, lock_class, name):
    lock = client.lock(name, timeout=5, lock_class=lock_class)
    lock.acquire()
    # Another thread sees no token at all (redis-py never sets one there).
    assert in_thread(lambda: getattr(lock.local, "token", None)) == {"value": None}
    assert in_thread(lock.locked) == {"value": True}
    for method in (lock.release, lock.owned):
        assert type(in_thread(method)["error"]) is AttributeError
    assert client.get(name) == lock.local.token  # still held
    assert lock.owned() is True
    lock.release()


def test_another_thread_can_release_without_thread_local(client, lock_class, name):
    lock = client.lock(name, timeout=5, thread_local=False, lock_class=lock_class)
    lock.acquire()
    assert in_thread(lock.owned) == {"value": True}
    assert in_thread(lock.release) == {"value": None}
    assert client.exists(name) == 0
    assert lock.local.token is None


def test_threads_sharing_one_lock_object_exclude_each_other(client, lock_class, name):
    lock = client.lock(name, timeout=5, sleep=0.002, lock_class=lock_class)
    inside = []
    most = []
    runs = []
    guard = threading.Lock()

    def worker():
        for _ in range(8):
            with lock:
                with guard:
                    inside.append(1)
                    most.append(len(inside))
                time.sleep(0.001)
                with guard:
                    inside.pop()
                    runs.append(1)

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(most) == 1
    assert len(runs) == 40
    assert client.exists(name) == 0


# -- release -------------------------------------------------------------------------------


def test_release_twice_raises_lock_error(client, lock_class, name):
    lock = client.lock(name, timeout=5, lock_class=lock_class)
    lock.acquire()
    lock.release()
    with pytest.raises(LockError) as info:
        lock.release()
    assert type(info.value) is LockError
    assert info.value.lock_name == name


def test_release_without_acquire_raises_lock_error(client, lock_class, name):
    with pytest.raises(LockError) as info:
        client.lock(name, lock_class=lock_class).release()
    assert type(info.value) is LockError


def test_release_after_expiry_raises_lock_not_owned(client, lock_class, name):
    lock = client.lock(name, timeout=0.2, lock_class=lock_class)
    lock.acquire()
    assert gone(client, name)
    with pytest.raises(LockNotOwnedError) as info:
        lock.release()
    assert isinstance(info.value, LockError)
    assert info.value.lock_name == name
    assert "no longer owned" in str(info.value)
    assert lock.local.token is None


def test_release_never_deletes_the_next_holders_lock(client, lock_class, name):
    lock = client.lock(name, timeout=0.2, lock_class=lock_class)
    lock.acquire()
    assert gone(client, name)
    nxt = client.lock(name, timeout=5, lock_class=lock_class)
    assert nxt.acquire(blocking=False) is True
    with pytest.raises(LockNotOwnedError):
        lock.release()
    assert client.get(name) == nxt.local.token
    nxt.release()


# -- extend and reacquire ------------------------------------------------------------------


def test_extend_adds_time(client, lock_class, name):
    lock = client.lock(name, timeout=1, lock_class=lock_class)
    lock.acquire()
    assert lock.extend(2) is True
    assert 2000 < client.pttl(name) <= 3000
    assert lock.extend(0.5, replace_ttl=True) is True
    assert 0 < client.pttl(name) <= 500
    lock.release()


def test_extend_errors(client, lock_class, name):
    with pytest.raises(LockError, match="Cannot extend an unlocked lock"):
        client.lock(name, timeout=1, lock_class=lock_class).extend(1)
    forever = client.lock(name, lock_class=lock_class)
    forever.acquire()
    with pytest.raises(LockError, match="Cannot extend a lock with no timeout") as info:
        forever.extend(1)
    assert type(info.value) is LockError
    forever.release()
    short = client.lock(name, timeout=0.2, lock_class=lock_class)
    short.acquire()
    assert gone(client, name)
    with pytest.raises(LockNotOwnedError, match="Cannot extend a lock that's no longer owned"):
        short.extend(1)


def test_reacquire_resets_the_ttl(client, lock_class, name):
    lock = client.lock(name, timeout=1, lock_class=lock_class)
    lock.acquire()
    lock.extend(10)
    assert client.pttl(name) > 10000
    assert lock.reacquire() is True
    assert 0 < client.pttl(name) <= 1000
    lock.release()


def test_reacquire_errors(client, lock_class, name):
    with pytest.raises(LockError, match="Cannot reacquire an unlocked lock"):
        client.lock(name, timeout=1, lock_class=lock_class).reacquire()
    forever = client.lock(name, lock_class=lock_class)
    forever.acquire()
    with pytest.raises(LockError, match="Cannot reacquire a lock with no timeout"):
        forever.reacquire()
    forever.release()
    short = client.lock(name, timeout=0.2, lock_class=lock_class)
    short.acquire()
    assert gone(client, name)
    with pytest.raises(LockNotOwnedError, match="Cannot reacquire a lock that's no longer owned"):
        short.reacquire()


# -- context manager -----------------------------------------------------------------------


def test_context_manager_holds_the_lock_for_the_block(client, lock_class, name):
    with client.lock(name, timeout=5, lock_class=lock_class) as lock:
        assert type(lock) is lock_class
        assert lock.owned() is True
        assert client.get(name) == lock.local.token
    assert client.exists(name) == 0


def test_context_manager_raises_when_it_cannot_acquire(client, lock_class, name):
    holder = client.lock(name, timeout=5, lock_class=lock_class)
    holder.acquire()
    busy = client.lock(name, timeout=5, sleep=0.02, blocking_timeout=0.1, lock_class=lock_class)
    with pytest.raises(LockError) as info, busy:
        pytest.fail("entered a held lock")
    assert str(info.value) == "Unable to acquire lock within the time specified"
    assert info.value.lock_name == name
    holder.release()


def test_context_manager_raises_when_the_lock_expired_in_the_block(client, lock_class, name):
    with pytest.raises(LockNotOwnedError), client.lock(name, timeout=0.2, lock_class=lock_class):
        assert gone(client, name)


def test_raise_on_release_error_false_logs_instead(client, lock_class, name, caplog):
    with client.lock(name, timeout=0.2, raise_on_release_error=False, lock_class=lock_class):
        assert gone(client, name)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert messages == ["Lock was unlocked or no longer owned when exiting context manager."]


# -- clients -------------------------------------------------------------------------------


def test_a_client_with_decode_responses(redis_server, lock_class, name):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        lock = client.lock(name, timeout=5, lock_class=lock_class)
        assert lock.acquire(token="decoded") is True
        assert lock.local.token == b"decoded"
        assert client.get(name) == "decoded"
        assert lock.owned() is True
        assert lock.locked() is True
        assert lock.extend(1) is True
        lock.release()
        assert lock.locked() is False
        other = client.lock(name, timeout=5, lock_class=lock_class)
        assert other.acquire() is True
        assert other.owned() is True
        other.release()
    finally:
        client.close()


def test_a_client_on_another_database(redis_server, client, lock_class, name):
    other_db = redis.Redis(host="127.0.0.1", port=redis_server.port, db=3)
    try:
        lock = other_db.lock(name, timeout=5, lock_class=lock_class)
        assert lock.acquire() is True
        assert other_db.get(name) == lock.local.token
        assert client.exists(name) == 0  # not in db 0
        assert client.lock(name, lock_class=lock_class).acquire(blocking=False) is True
        client.delete(name)
        assert lock.extend(1) is True
        lock.release()
        assert other_db.exists(name) == 0
    finally:
        other_db.close()


@pytest.mark.parametrize("how", ["kwargs", "url"])
def test_a_client_with_a_password(secured, lock_class, name, how):
    if how == "url":
        client = redis.Redis.from_url(f"redis://:pw@127.0.0.1:{secured.port}/2")
    else:
        client = redis.Redis(host="127.0.0.1", port=secured.port, password="pw", db=2)
    try:
        lock = client.lock(name, timeout=5, lock_class=lock_class)
        assert lock.acquire() is True
        assert client.get(name) == lock.local.token
        assert lock.owned() is True
        assert lock.extend(1) is True
        assert lock.reacquire() is True
        lock.release()
        assert client.exists(name) == 0
    finally:
        client.close()


def test_a_client_on_a_unix_socket(redis_server, client, lock_class, name):
    local = redis.Redis(unix_socket_path=redis_server.unixsocket)
    try:
        lock = local.lock(name, timeout=5, lock_class=lock_class)
        assert lock.acquire() is True
        assert client.get(name) == lock.local.token
        lock.release()
        assert client.exists(name) == 0
    finally:
        local.close()


def test_script_flush_between_acquire_and_release(client, lock_class, name):
    lock = client.lock(name, timeout=5, lock_class=lock_class)
    lock.acquire()
    client.script_flush()
    assert lock.extend(1) is True
    client.script_flush()
    assert lock.reacquire() is True
    client.script_flush()
    lock.release()
    assert client.exists(name) == 0


def test_locks_of_two_clients_on_one_name(redis_server, lock_class, name):
    a = redis.Redis.from_url(redis_server.url)
    b = redis.Redis.from_url(redis_server.url)
    try:
        first = a.lock(name, timeout=5, lock_class=lock_class)
        second = b.lock(name, timeout=5, lock_class=lock_class)
        assert first.acquire(blocking=False) is True
        assert second.acquire(blocking=False) is False
        assert second.locked() is True and second.owned() is False
        first.release()
        assert second.acquire(blocking=False) is True
        second.release()
    finally:
        a.close()
        b.close()


# -- one scenario, one transcript per implementation ----------------------------------------


def transcript(client, lock_class, name):
    """Runs a fixed scenario and writes down every visible outcome."""
    out = []

    def step(label, fn):
        try:
            result = fn()
        except Exception as e:  # the outcome is the exception
            result = (type(e).__name__, str(e))
        out.append((label, result))

    def pttl_bucket():
        ms = client.pttl(name)
        return ms if ms < 0 else -(-ms // 1000)  # whole seconds, rounded up

    a = client.lock(name, timeout=2, sleep=0.01, lock_class=lock_class)
    b = client.lock(name, timeout=2, sleep=0.01, lock_class=lock_class)
    step("a.locked", a.locked)
    step("a.release", a.release)
    step("a.extend", lambda: a.extend(1))
    step("a.reacquire", a.reacquire)
    step("a.acquire", a.acquire)
    step("ttl", pttl_bucket)
    step("b.acquire nonblocking", lambda: b.acquire(blocking=False))
    step("b.acquire timeout", lambda: b.acquire(blocking_timeout=0.05))
    step("b.owned", b.owned)
    step("b.locked", b.locked)
    step("a.owned", a.owned)
    step("a.extend 3", lambda: a.extend(3))
    step("ttl", pttl_bucket)
    step("a.extend replace", lambda: a.extend(1, replace_ttl=True))
    step("ttl", pttl_bucket)
    step("a.reacquire", a.reacquire)
    step("ttl", pttl_bucket)
    step("delete", lambda: client.delete(name))
    step("a.extend gone", lambda: a.extend(1))
    step("a.reacquire gone", a.reacquire)
    step("b.acquire token", lambda: b.acquire(token="b-token"))
    step("value", lambda: client.get(name))
    step("a.release taken", a.release)
    step("a.release again", a.release)
    step("value", lambda: client.get(name))
    step("b.release", b.release)
    step("b.locked", b.locked)
    step("exists", lambda: client.exists(name))
    c = client.lock(name, lock_class=lock_class)
    step("c.acquire", c.acquire)
    step("ttl", pttl_bucket)
    step("c.extend", lambda: c.extend(1))
    step("c.reacquire", c.reacquire)
    step("c.release", c.release)
    return out


def test_same_transcript_as_redis_py(client, name):
    reference = transcript(client, Lock, name)
    not_owned = ("LockNotOwnedError", "Cannot release a lock that's no longer owned")
    assert ("a.release taken", not_owned) in reference
    for implementation in TWINS:
        assert transcript(client, lock_class_for(implementation), name) == reference, implementation


# -- errors are redis-py's -------------------------------------------------------------------


def test_an_unreachable_server_raises_redis_py_connection_error(lock_class, name):
    with RedisServer() as server:
        port = server.port
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    lock = client.lock(name, timeout=5, lock_class=lock_class)
    for method in (lock.acquire, lock.locked):
        with pytest.raises(redis.exceptions.ConnectionError):
            method()


def test_a_wrong_password_raises_redis_py_authentication_error(secured, lock_class, name):
    client = redis.Redis(host="127.0.0.1", port=secured.port, password="wrong", retry=Retry(NoBackoff(), 0))
    with pytest.raises(redis.exceptions.AuthenticationError):
        client.lock(name, timeout=5, lock_class=lock_class).acquire()


def test_a_key_of_another_type_raises_redis_py_response_error(client, lock_class, name):
    client.rpush(name, "job")
    lock = client.lock(name, timeout=5, lock_class=lock_class)
    assert lock.acquire(blocking=False) is False
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        lock.locked()
    client.delete(name)
