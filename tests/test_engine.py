"""The engine's promises with many callers on one connection, on every twin and both drivers.

Threads sharing a ``Locks`` and tasks sharing an ``AsyncLocks`` are multiplexed on one
connection: their commands leave together and each reply goes back to the caller whose
command it answers, also when the reply is an error, when the connection breaks with
all of them in flight, when the scripts must be loaded again, and when Redis stops
answering. A forked child starts with its own connection and driver state.

To put many callers' commands on the wire at once, deterministically, the threaded
tests hold the first write back (``HeldWrite``): the callers that come meanwhile are
written together once it goes. asyncio gathers what its tasks submit in one loop turn.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import joblock
from helpers import assert_counted_once, command, name, names
from joblock._engine import sync
from joblock._engine.aio import EARLY_WRITE, EARLY_WRITE_WHILE
from joblock._engine.ops import RELEASE, Engine
from joblock._engine.requests import CompareOne, SingleAcquire
from joblock._engine.wire import Wire
from joblock._scripts import RELEASE_SHA, SCRIPTS
from joblock._tools.servers import RedisServer
from rig.faults import FaultProxy
from test_aio import Aio
from test_connection import run_in_child

THREADS = 32


class HeldWrite:
    """The connection's real socket, its next write held back until ``go()``; counts writes."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.writes = 0
        self.holding = threading.Event()
        self._go = threading.Event()
        self._hold = True

    def sendall(self, data: bytes) -> None:
        self.writes += 1
        if self._hold:
            self._hold = False
            self.holding.set()
            self._go.wait(10)
        self._sock.sendall(data)

    def go(self) -> None:
        self._go.set()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._sock, attr)


def connection(locks: Any) -> Any:
    """The driver's connection of a single-server client (after one call has opened it)."""
    return locks._driver._current().conns[None]


def hold_writes(locks: Any) -> HeldWrite:
    lease = locks.acquire(name(locks, "warm"), 5)
    assert lease.release() is True
    conn = connection(locks)
    held = conn.sock = HeldWrite(conn.sock)
    return held


def in_step(locks: Any, held: HeldWrite, calls: list[Callable[[], Any]]) -> list[Any]:
    """Runs each call in a thread of its own, all of them on the wire at once; their outcomes."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    threads[0].start()
    assert held.holding.wait(10)  # the first caller is writing: the others queue behind it
    for thread in threads[1:]:
        thread.start()
    wire = connection(locks).wire
    deadline = time.monotonic() + 10
    while wire.busy() and len(wire._inflight) < len(calls) and time.monotonic() < deadline:
        time.sleep(0.001)
    held.go()
    for thread in threads:
        thread.join(30)
    return out


@pytest.fixture
def scripts_loaded(raw: Any) -> None:
    for body in SCRIPTS.values():
        raw.script_load(body)


def opened(raw: Any) -> int:
    return int(raw.info("stats")["total_connections_received"])


def counted(raw: Any, name: str) -> int:
    """How many times Redis ran a command (``script|load`` is ``script`` before Redis 7)."""
    stats = raw.info("commandstats")
    entry = (
        stats.get(f"cmdstat_{name}") or stats.get(f"cmdstat_{name.split('|', maxsplit=1)[0]}") or {"calls": 0}
    )
    return int(entry["calls"])


# -- threads ---------------------------------------------------------------------------


def test_threads_share_one_connection_and_their_commands_leave_together(make_locks, raw):
    locks = make_locks()
    before = opened(raw)
    held = hold_writes(locks)
    keys = names(locks, THREADS)
    leases = in_step(locks, held, [lambda k=k: locks.acquire(k, 30) for k in keys])
    assert held.writes == 2  # the first caller's, then everyone who came while it was held
    assert [lease.key for lease in leases] == keys
    assert [raw.get(k) for k in keys] == [lease.token for lease in leases]
    assert locks.release_many(leases) == [True] * THREADS
    assert opened(raw) - before == 1


def test_callers_woken_by_one_read_write_their_next_commands_together(make_locks, raw):
    """Callers whose replies came in one read and who call again at once queue their
    commands behind whichever of them writes first, also when it hands the leader's role
    on: not a write each. (Two writes at best: the first caller's, then the others';
    more when a read returns before every caller has queued, as threads are scheduled.)"""
    locks = make_locks()
    held = hold_writes(locks)
    keys = names(locks, THREADS)

    def acquire_then_release(key: str) -> bool:
        lease = locks.acquire(key, 30)
        return lease is not None and lease.release()

    assert in_step(locks, held, [lambda k=k: acquire_then_release(k) for k in keys]) == [True] * THREADS
    assert held.writes - 2 <= THREADS // 4  # the releases'
    assert raw.exists(*keys) == 0


class WokenAtReads:
    """The connection's real socket; at each read, counts the waiting callers that are
    woken and not yet running (the leader holds the GIL here: none of them can run)."""

    def __init__(self, sock: Any, state: Any) -> None:
        self._sock = sock
        self._state = state
        self.counts: list[int] = []

    def recv(self, size: int) -> bytes:
        self.counts.append(sum(op.waiter is None for op in list(self._state.waiting)))
        return bytes(self._sock.recv(size))

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._sock, attr)


def test_callers_finished_by_one_read_are_woken_one_at_a_time(make_locks, monkeypatch):
    """Woken together, the callers of one read would each wake for its reply, find the
    GIL taken and sleep again: they are woken in turn, each by the one before as it runs
    (and the heir at once). Every one of them is woken (followers look again on their
    own only after a minute here), and the count of the woken balances when all are done."""
    monkeypatch.setattr(sync, "FOLLOW_CHECK", 60.0)
    locks = make_locks()
    assert locks.acquire(name(locks, "warm"), 5).release() is True
    conn = connection(locks)
    spy = conn.sock = WokenAtReads(conn.sock, locks._driver._current())

    def work(t: int) -> None:
        for r in range(20):
            lease = locks.acquire(name(locks, f"w{t}-{r}"), 30)
            assert lease is not None and lease.release() is True

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads)
    assert len(spy.counts) > 20 and max(spy.counts) <= 2  # the one in turn, and the heir
    assert locks._driver._current().woken == 0


def test_the_leaders_role_goes_to_no_caller_busy_making_its_input(make_locks, monkeypatch):
    """A batch whose windows are answered waits for its caller's next keys (a generator,
    which may take its time): that caller is not the one the leader's role goes to, or
    nobody would read the replies of the others meanwhile. Followers look again on their
    own only after a minute here, so a caller left unread would not be saved by it."""
    monkeypatch.setattr(sync, "FOLLOW_CHECK", 60.0)
    locks = make_locks(window=2)
    assert locks.acquire(name(locks, "warm"), 5).release() is True
    blocked = name(locks, "empty-list")
    last_done = threading.Event()
    seen: list[bool] = []

    def keys() -> Any:
        for i in range(12):
            if i == 6:  # windows answered: the others' calls go on without this one
                seen.append(last_done.wait(20))
            yield name(locks, f"batch-{i}")

    def batch() -> None:
        assert locks.release_many(locks.acquire_many(keys(), 30)) == [True] * 12

    def last() -> None:
        command(locks, "BLPOP", blocked, "0.05")
        last_done.set()

    calls = [
        lambda: command(locks, "BLPOP", blocked, "0.2"),  # the leader, its reply 0.2 s away
        lambda: locks.acquire(name(locks, "x"), 5).release(),
        lambda: locks.acquire(name(locks, "y"), 5),
        batch,
        last,
    ]
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for thread in threads:
        thread.start()
        time.sleep(0.02)  # on the wire in this order, all behind the leader's BLPOP
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert seen == [True]


def test_concurrent_threads_each_get_their_own_lock(make_locks, raw):
    """Many threads, many rounds, one connection: no reply goes to the wrong caller."""
    locks = make_locks()
    before = opened(raw)
    errors: list[str] = []
    held: list[Any] = []

    def work(t: int) -> None:
        for r in range(50):
            key = name(locks, f"t{t}-{r}")
            lease = locks.acquire(key, 30, fence=r % 2 == 1)
            # A fenced lease's token ends in its number, as Redis holds it: extend checks both.
            if lease is None or lease.key != key or (r % 2 and type(lease.fence) is not int):
                errors.append(f"{key}: {lease!r}")
            elif lease.extend(30) is not True:
                errors.append(f"{key}: not ours")
            elif r % 5 == 0:
                held.append(lease)  # looked at in Redis afterwards
            elif lease.release() is not True:
                errors.append(f"{key}: not released")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert opened(raw) - before == 1
    assert raw.mget([lease.key for lease in held]) == [lease.token for lease in held]
    assert locks.release_many(held) == [True] * len(held)


class Quiet(Engine):
    """An engine that wakes nobody: the wire's steps, watched from outside."""

    def wake(self, op: Any) -> None:
        pass


QUICK = (b"$-1\r\n", b":1\r\n", b":0\r\n", b"+OK\r\n")


@pytest.mark.parametrize(
    "data", [*QUICK, b"$5\r\nother\r\n", b"-WRONGTYPE Operation against a key\r\n", b":-1\r\n", b"+OKAY\r\n"]
)
def test_a_lone_callers_commonest_replies_skip_the_parser_and_end_as_parsed(make_locks, data):
    """``Wire.quick`` takes a nil (a grant of SET NX GET), 1 and 0 (a release done or not)
    and OK without the parser and leaves every other reply to ``feed``; either way, each
    operation ends as the parser would have it end."""
    locks = make_locks(native_commands=False)
    core = locks._core
    held = locks.acquire(name(locks, "held"), 30)
    ends = []
    for quick in (True, False):
        wire = Wire(core, locks.settings, set())
        wire.connected()  # (no handshake on this server: ready at once)
        if data[:1] in b"$-":
            op = locks._acquire_op(name(locks, "k"), 30, False, 1)
            request: Any = SingleAcquire(op, None, b"", False, op.key, op.value)
        else:
            op = locks._lease_op(RELEASE, held)
            request = CompareOne(op, None, core, RELEASE_SHA, held._key, held._value, None)
        op.engine = Quiet()
        wire.submit(request)
        assert wire.output() is not None
        took = quick and wire.quick(data)
        assert took is (quick and data in QUICK)
        if not took:
            wire.feed(data)
        result = None if type(op.result) is core.Lease else op.result
        ends.append((op.done, type(op.result).__name__, result, wire.unsent()))
        if type(op.result) is core.Lease:
            assert op.result._value == op.value and op.result._key == op.key
        held._held = True  # (the release's verdict was written on the lease: as it was, for the next)
    assert ends[0] == ends[1]
    # Done, or a question more for the server: the probe of a WRONGTYPE, the script of a release not done.
    assert ends[0][0] or ends[0][3] == 1
    two = Wire(core, locks.settings, set())
    two.connected()
    for _ in range(2):
        two.submit(SingleAcquire(None, None, b"", False, b"k", b"v"))
    two.output()
    assert not two.quick(b"$-1\r\n")  # (two in flight: the bytes may be the parser's second)


def test_an_error_reply_reaches_only_the_caller_it_answers(make_locks, raw):
    locks = make_locks()
    held = hold_writes(locks)
    keys = names(locks, THREADS)
    lists = set(keys[::4])
    for key in lists:
        raw.rpush(key, "not a lock")  # the fenced script's GET fails with WRONGTYPE
    outcomes = in_step(locks, held, [lambda k=k: locks.acquire(k, 30, fence=True) for k in keys])
    # The first caller's, everyone else's, then the probes of the WRONGTYPE keys (are
    # they counting locks?) as their replies came in.
    assert 3 <= held.writes <= 2 + len(lists)
    for key, outcome in zip(keys, outcomes):
        if key in lists:
            assert isinstance(outcome, joblock.WrongTypeError)
            assert outcome.key == key.encode()
        else:
            assert outcome.key == key and outcome.fence >= 1
            assert outcome.release() is True
    raw.delete(*lists)


@pytest.mark.parametrize("fence", [False, True])
def test_a_lost_reply_is_retried_for_every_caller_on_the_connection(
    make_locks, redis_server, raw, scripts_loaded, fence
):
    # The warm-up's acquire reply passes; the connection is cut one byte into the burst's.
    proxy = FaultProxy(redis_server.port, after=6 if not fence else 5)
    try:
        locks = make_locks(proxy.url)
        warm = locks.acquire(name(locks, "warm"), 30, fence=fence)
        conn = connection(locks)
        held = conn.sock = HeldWrite(conn.sock)
        keys = names(locks, THREADS)
        leases = in_step(locks, held, [lambda k=k: locks.acquire(k, 30, fence=fence) for k in keys])
        assert (proxy.cut, proxy.connections) == (1, 2)
        assert [lease.key for lease in leases] == keys  # every caller, none given another's lock
        assert [raw.get(k) for k in keys] == [lease.token for lease in leases]
        if fence:  # each lock granted once: its slot's counter moved once for it
            assert_counted_once(leases)
        assert locks.release_many([warm, *leases]) == [True] * (THREADS + 1)
    finally:
        proxy.close()


def test_noscript_loads_the_scripts_once_and_redoes_only_what_it_hit(make_locks, raw):
    locks = make_locks(native_commands=False)  # the releases as scripts on every server
    leases = locks.acquire_many(names(locks, THREADS // 2, "r"), 30)
    held = hold_writes(locks)
    raw.script_flush()
    loads, evalshas, sets = counted(raw, "script|load"), counted(raw, "evalsha"), counted(raw, "set")
    fresh = names(locks, THREADS // 2, "a")
    calls = [lambda lease=lease: lease.release() for lease in leases]
    calls += [lambda k=k: locks.acquire(k, 30) for k in fresh]
    outcomes = in_step(locks, held, calls)
    assert outcomes[: len(leases)] == [True] * len(leases)
    got = outcomes[len(leases) :]
    assert [lease.key for lease in got] == fresh
    assert counted(raw, "script|load") - loads == len(SCRIPTS)  # once for all of them
    assert counted(raw, "evalsha") - evalshas == 2 * len(leases)  # each release: NOSCRIPT, then done
    assert counted(raw, "set") - sets == len(fresh)  # the acquires in between were not sent again
    assert locks.release_many(got) == [True] * len(got)


@pytest.fixture
def paused_server():
    with RedisServer() as server:
        yield server


def test_socket_timeout_bounds_every_caller_when_redis_stops_answering(make_locks, paused_server):
    locks = make_locks(paused_server.url, socket_timeout=0.3, retries=0)
    assert locks.acquire(name(locks, "warm"), 5) is not None
    os.kill(paused_server.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        outcomes: list[Any] = [None] * 8

        def call(i: int) -> None:
            try:
                outcomes[i] = locks.acquire(name(locks, f"k{i}"), 5)
            except joblock.JoblockError as e:
                outcomes[i] = e

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        elapsed = time.monotonic() - started
    finally:
        os.kill(paused_server.process.pid, signal.SIGCONT)
    assert all(isinstance(o, joblock.TimeoutError) for o in outcomes), outcomes
    assert all("did not answer within 0.3 s" in str(o) for o in outcomes)
    assert elapsed < 5  # each one's single attempt ended at its socket timeout, not later
    assert locks.acquire(name(locks, "after"), 5) is not None  # a new connection once Redis is back


def test_a_child_forked_while_a_parent_thread_reads_starts_afresh(make_locks, raw):
    locks = make_locks()
    parent = locks.acquire(name(locks, "parent"), 30)
    parent_id = command(locks, "CLIENT", "ID")
    # A parent thread leads the shared connection, blocked in a read for 2 s, at the fork.
    blocker = threading.Thread(target=command, args=(locks, "BLPOP", name(locks, "never"), 2))
    blocker.start()
    time.sleep(0.2)

    def child() -> float:
        started = time.monotonic()
        lease = locks.acquire(name(locks, "child"), 5)
        assert lease is not None and lease.token.endswith(b":%d" % os.getpid())
        assert lease.release() is True
        assert command(locks, "CLIENT", "ID") != parent_id
        return time.monotonic() - started

    code, report = run_in_child(child)
    blocker.join()
    assert code == 0, report
    assert float(report) < 1.5  # it did not wait behind the parent's blocked read
    assert command(locks, "CLIENT", "ID") == parent_id  # the parent's connection, still in step
    assert parent.release() is True


# -- asyncio -------------------------------------------------------------------------------


@pytest.fixture
def aio(core, redis_server):
    return Aio(core, redis_server.url)


class CountedWrites:
    """Counts the writes of an asyncio transport (the real ones go on)."""

    def __init__(self, transport: Any) -> None:
        self.writes = 0
        real = transport.write

        def write(data: bytes) -> None:
            self.writes += 1
            real(data)

        transport.write = write


# Writes for a crowd of tasks that all submit in one loop turn: the first task's command
# at once; then every EARLY_WRITE (48) of them while fewer than EARLY_WRITE_WHILE (192)
# commands are unanswered; the rest at the turn's end. On Redis 6.2 an acquire is two
# commands (SET NX, then GET), so the unanswered ones reach 192 sooner.
CROWD_WRITES = {
    EARLY_WRITE: (2, 2),  # 1 at once, 47 at the turn's end
    100: (4, 3),  # 1, 48, 48 early, 3 at the end; 6.2: 1, 48 early (then 2 + 2 * 96 would pass 192), 51
    400: (5, 3),  # 1, 48, 48, 48 early (then 145 + 48 would pass 192), 255 at the end; 6.2: 1, 48, 351
}


@pytest.mark.parametrize("tasks", sorted(CROWD_WRITES))
def test_tasks_share_one_connection_and_a_loop_turn_leaves_in_few_writes(aio, raw, tasks):
    assert (EARLY_WRITE, EARLY_WRITE_WHILE) == (48, 192)  # the table above counts with them
    redis_6 = raw.info("server")["redis_version"].startswith("6.")

    async def main():
        locks = aio.locks()
        before = opened(raw)
        assert await (await locks.acquire(aio.name("warm"), 5)).release() is True
        counter = CountedWrites(connection(locks).transport)
        keys = aio.names(tasks)
        leases = await asyncio.gather(*(locks.acquire(k, 30) for k in keys))
        assert counter.writes == CROWD_WRITES[tasks][redis_6]
        assert [lease.key for lease in leases] == keys
        assert [raw.get(k) for k in keys] == [lease.token for lease in leases]
        assert await asyncio.gather(*(lease.release() for lease in leases)) == [True] * tasks
        assert opened(raw) - before == 1

    aio.run(main)


def test_an_error_reply_reaches_only_the_task_it_answers(aio, raw):
    async def main():
        locks = aio.locks()
        keys = aio.names(40)
        lists = set(keys[::4])
        for key in lists:
            raw.rpush(key, "not a lock")
        outcomes = await asyncio.gather(
            *(locks.acquire(k, 30, fence=True) for k in keys), return_exceptions=True
        )
        for key, outcome in zip(keys, outcomes):
            if key in lists:
                assert isinstance(outcome, joblock.WrongTypeError) and outcome.key == key.encode()
            else:
                assert outcome.key == key and await outcome.release() is True
        raw.delete(*lists)

    aio.run(main)


@pytest.mark.parametrize("fence", [False, True])
def test_a_lost_reply_is_retried_for_every_task_on_the_connection(
    aio, redis_server, raw, scripts_loaded, fence
):
    proxy = FaultProxy(redis_server.port, after=6 if not fence else 5)

    async def main():
        locks = aio.locks(proxy.url)
        warm = await locks.acquire(aio.name("warm"), 30, fence=fence)
        keys = aio.names(THREADS)
        leases = await asyncio.gather(*(locks.acquire(k, 30, fence=fence) for k in keys))
        assert (proxy.cut, proxy.connections) == (1, 2)
        assert [lease.key for lease in leases] == keys
        assert [raw.get(k) for k in keys] == [lease.token for lease in leases]
        if fence:
            assert_counted_once(leases)
        assert await locks.release_many([warm, *leases]) == [True] * (THREADS + 1)

    try:
        aio.run(main)
    finally:
        proxy.close()


def test_socket_timeout_bounds_every_task_when_redis_stops_answering(aio, paused_server):
    async def main():
        locks = aio.locks(paused_server.url, socket_timeout=0.3, retries=0)
        assert await locks.acquire(aio.name("warm"), 5) is not None
        os.kill(paused_server.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            calls = [asyncio.ensure_future(locks.acquire(aio.name(f"k{i}"), 5)) for i in range(20)]
            await asyncio.sleep(0)  # all written, none answered
            # The watchdog is an alarm of joblock's thread (_engine/alarms.py), not a loop
            # timer: asyncio's loop pays on every turn for any timer armed.
            assert not asyncio.get_running_loop()._scheduled
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            elapsed = time.monotonic() - started
        finally:
            os.kill(paused_server.process.pid, signal.SIGCONT)
        assert all(isinstance(o, joblock.TimeoutError) for o in outcomes), outcomes
        assert elapsed < 5
        assert await locks.acquire(aio.name("after"), 5) is not None

    aio.run(main)
