"""Waiting acquires (``wait=``) without polling: waiters queue in Redis, a release hands
the lock straight to the first live waiter and wakes it on its client's channel.

Every test runs once per core twin, against a redis-server of this module's own, so
that INFO commandstats counts only what these tests send: a waiter that polled would
show there as dozens of commands a second. Time bounds are generous ("well before the
wait ends"); what is asserted exactly is Redis' state and the order of the grants.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from types import ModuleType
from typing import Any

import pytest

import joblock
from helpers import name, stored, twin_name
from joblock._core_py import key_slot
from joblock._engine.listeners import ThreadListener
from joblock._engine.waits import LOST_CHANNEL, Wakeups
from joblock._tools.servers import RedisServer
from joblock.aio import AsyncLocks
from rig.faults import FaultProxy

TTL = 30
PROMPT = 5.0  # "long before the wait ends": every waiter here waits 10 s or more


@pytest.fixture(scope="module")
def redis_server():
    """This module's own server (make_locks and raw use it): no other module's clients
    add to its command counts."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def async_locks(core: ModuleType, redis_server: RedisServer, locks: joblock.Locks):
    """Builds AsyncLocks on the test's twin, under the test's key prefix (close them on their loop)."""
    cls = type("AsyncLocks", (AsyncLocks,), {"_core": core})
    return lambda **options: cls(redis_server.url, prefix=locks.prefix, **options)


def queue_key(key: str) -> str:
    """Where ``key``'s waiters queue: in its hash slot, as the fence counter."""
    start = key.find("{")
    if start >= 0 and key.find("}", start + 2) > 0:  # a hash tag already
        return f"{key}:waiters"
    return f"{{{key}}}:waiters"


def queued(raw: Any, key: str) -> int:
    """How many waiters ``key``'s queue holds (a list or a sorted set)."""
    queue = queue_key(key)
    kind = raw.type(queue)
    if kind == b"list":
        return int(raw.llen(queue))
    if kind == b"zset":
        return int(raw.zcard(queue))
    assert kind == b"none", kind
    return 0


def until(condition: Any, what: str, within: float = 10.0) -> None:
    """Polls ``condition`` (bounded): the setup steps the tests wait for."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


def until_queued(raw: Any, key: str, n: int) -> None:
    until(lambda: queued(raw, key) >= n, f"{n} waiter(s) queued on {key}")


def calls(raw: Any) -> int:
    """Commands Redis ran so far (those inside scripts too), without our own INFOs."""
    stats = raw.info("commandstats")
    return sum(int(stat["calls"]) for command, stat in stats.items() if command != "cmdstat_info")


def script_calls(raw: Any) -> int:
    stats = raw.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


class Waiter(threading.Thread):
    """A thread that runs one waiting acquire, and notes its lease and when it came back."""

    def __init__(self, locks: Any, key: str, **options: Any) -> None:
        super().__init__(daemon=True)
        self.locks, self.key, self.options = locks, key, options
        self.lease: Any = None
        self.error: BaseException | None = None
        self.returned = 0.0

    def run(self) -> None:
        try:
            self.lease = self.locks.acquire(self.key, TTL, **self.options)
        except BaseException as e:  # raised again in the test's thread by result()
            self.error = e
        self.returned = time.monotonic()

    def result(self) -> Any:
        self.join(30)
        assert not self.is_alive(), "the waiter never came back"
        if self.error is not None:
            raise self.error
        return self.lease


# -- woken by the release, by an expiry, or not at all ---------------------------------------


def test_a_release_hands_the_lock_to_the_waiter_that_sent_nothing_meanwhile(make_locks, raw, lease_type):
    holding, waiting = make_locks(), make_locks()
    key = name(holding, "handed")
    holder = holding.acquire(key, TTL)
    waiter = Waiter(waiting, key, wait=10)
    waiter.start()
    until_queued(raw, key, 1)
    before = calls(raw)
    time.sleep(1)  # a poller would run dozens of commands in this second
    idle = calls(raw) - before
    released = time.monotonic()
    assert holder.release() is True
    lease = waiter.result()
    assert type(lease) is lease_type
    assert waiter.returned - released < PROMPT
    # The release script granted it: the key holds the waiter's token, its queue is gone.
    assert raw.get(key) == lease.token
    assert stored(raw, holding) == [key.encode()]
    assert idle < 10, f"{idle} commands while one waiter waited"
    assert calls(raw) - before < 40  # the wait, the release and its hand-off
    assert lease.release() is True


def test_an_async_waiter_is_handed_the_lock_and_sends_nothing_meanwhile(async_locks, raw):
    async def main():
        async with async_locks() as holding, async_locks() as waiting:
            key = name(holding, "handed-aio")
            holder = await holding.acquire(key, TTL)
            task = asyncio.ensure_future(waiting.acquire(key, TTL, wait=10))
            while queued(raw, key) < 1:
                assert not task.done(), task
                await asyncio.sleep(0.005)
            before = calls(raw)
            await asyncio.sleep(1)
            idle = calls(raw) - before
            released = time.monotonic()
            assert await holder.release() is True
            lease = await asyncio.wait_for(task, 30)
            assert time.monotonic() - released < PROMPT
            assert lease is not None and raw.get(key) == lease.token
            assert idle < 10, f"{idle} commands while one waiter waited"
            assert calls(raw) - before < 40
            assert await lease.release() is True
            return key

    key = asyncio.run(main())
    assert raw.exists(key, queue_key(key)) == 0


def test_the_queue_lives_in_the_lock_keys_hash_slot(make_locks, raw):
    """A key with a hash tag keeps it: the queue sits beside the key on a Cluster too."""
    holding, waiting = make_locks(), make_locks()
    for key in (name(holding, "untagged"), f"{{{holding.prefix}}}:tagged"):
        holder = holding.acquire(key, TTL)
        waiter = Waiter(waiting, key, wait=10)
        waiter.start()
        until_queued(raw, key, 1)
        assert key_slot(queue_key(key).encode()) == key_slot(key.encode())
        assert holder.release() is True
        assert waiter.result().release() is True
        assert raw.exists(key, queue_key(key)) == 0


def test_a_lock_that_expires_wakes_its_first_waiter(locks, make_locks, raw):
    key = name(locks, "expiring")
    assert locks.acquire(key, 0.5) is not None  # never released
    started = time.monotonic()
    lease = make_locks().acquire(key, TTL, wait=10)
    assert lease is not None
    assert time.monotonic() - started < PROMPT  # at the expiry, not at the wait's end
    assert raw.get(key) == lease.token
    assert lease.release() is True


@pytest.mark.parametrize("fair", [False, True])
def test_a_wait_that_ends_returns_none_and_leaves_the_queue(locks, make_locks, raw, fair):
    key = name(locks, "timeout")
    holder = locks.acquire(key, 60)
    waiting = make_locks()
    assert waiting.acquire(key, TTL, wait=0.3, fair=fair) is None
    assert stored(raw, locks) == [key.encode()]  # nobody left queued
    with pytest.raises(joblock.LockNotAcquired), waiting.lock(key, TTL, wait=0.3, fair=fair):
        pass
    assert stored(raw, locks) == [key.encode()]
    assert raw.get(key) == holder.token
    assert holder.release() is True


def test_an_async_wait_that_ends_returns_none_and_leaves_the_queue(locks, async_locks, raw):
    key = name(locks, "timeout-aio")
    holder = locks.acquire(key, 60)

    async def main():
        async with async_locks() as waiting:
            assert await waiting.acquire(key, TTL, wait=0.3) is None
            with pytest.raises(joblock.LockNotAcquired):
                async with waiting.lock(key, TTL, wait=0.3):
                    pass

    asyncio.run(main())
    assert stored(raw, locks) == [key.encode()]
    assert holder.release() is True


# -- order, fairness ---------------------------------------------------------------------------


@pytest.mark.parametrize("fair", [False, True])
def test_waiters_get_the_lock_in_arrival_order_one_woken_per_release(locks, make_locks, raw, fair):
    key = name(locks, "order")
    holder = locks.acquire(key, TTL)
    waiting = make_locks()
    grants: list[int] = []
    released: list[bool] = []

    def wait_then_hold(i: int) -> None:
        lease = waiting.acquire(key, TTL, wait=30, fair=fair)
        grants.append(i)  # the next one cannot have it before this one releases
        time.sleep(0.02)
        released.append(lease.release())

    threads = [threading.Thread(target=wait_then_hold, args=(i,), daemon=True) for i in range(5)]
    for i, thread in enumerate(threads):
        thread.start()
        until_queued(raw, key, i + 1)  # the arrival order is known
    scripts = script_calls(raw)
    assert holder.release() is True
    for thread in threads:
        thread.join(30)
    assert grants == [0, 1, 2, 3, 4]
    assert released == [True] * 5
    # Six releases, each waking only the next waiter: a herd would re-run the queue script
    # for every remaining waiter at every release (15 more).
    assert script_calls(raw) - scripts < 12
    assert stored(raw, locks) == []


def test_a_fair_acquire_without_wait_passes_while_anyone_waits(locks, make_locks, raw):
    key = name(locks, "fair")
    holder = locks.acquire(key, TTL)
    fair = make_locks()
    # Nobody waits: a fair acquire of a busy lock is simply busy.
    assert fair.acquire(key, TTL, fair=True) is None
    waiter = Waiter(make_locks(), key, wait=2)
    waiter.start()
    until_queued(raw, key, 1)
    assert fair.acquire(key, TTL, fair=True) is None
    # The lock freed without a hand-off (a DEL by hand): free, but someone waits.
    assert raw.delete(key) == 1
    assert fair.acquire(key, TTL, fair=True) is None
    with pytest.raises(joblock.LockNotAcquired), fair.lock(key, TTL, fair=True):
        pass
    assert fair.acquire(key, TTL, fair=True, fence=True) is None
    # The waiter takes it at its next check (its deadline), having lost its place to nobody.
    lease = waiter.result()
    assert lease is not None and raw.get(key) == lease.token
    assert queued(raw, key) == 0
    assert lease.release() is True
    # Nobody waits any more: a fair acquire is an acquire, with a wait or without.
    for wait in (None, 10):
        started = time.monotonic()
        again = fair.acquire(key, TTL, fair=True, wait=wait)
        assert again is not None and time.monotonic() - started < PROMPT
        assert again.release() is True
    assert stored(raw, locks) == []
    assert holder.held  # never released: the DEL took it
    assert holder.release() is False


# -- waiters that die, subscriptions that break, tasks that are cancelled -----------------------

DYING_WAITER = """
import sys
sys.path.insert(0, sys.argv[1])
from helpers import child_locks
child_locks(sys.argv[2], sys.argv[3]).acquire(sys.argv[4], 30, wait=60)
raise SystemExit("the waiter came back: it was to be killed while waiting")
"""


def wake_channels(raw: Any) -> set[bytes]:
    """The clients' own wake-up channels (not the one operators' releases go to)."""
    return set(raw.pubsub_channels("joblock:wake:*")) - {LOST_CHANNEL}


def test_a_dead_waiter_is_passed_over(core, locks, make_locks, raw, redis_server):
    key = name(locks, "dead")
    holder = locks.acquire(key, TTL)
    listening = wake_channels(raw)
    tests = os.path.dirname(os.path.abspath(__file__))
    argv = [sys.executable, "-c", DYING_WAITER, tests, twin_name(core), redis_server.url, key]
    dying = subprocess.Popen(argv)
    try:
        until(lambda: queued(raw, key) >= 1 or dying.poll() is not None, "the child queued", 60)
        assert dying.poll() is None, "the child waiter exited"
        (channel,) = wake_channels(raw) - listening  # the child's client's
        waiter = Waiter(make_locks(), key, wait=10)  # queued behind the child
        waiter.start()
        until_queued(raw, key, 2)
    finally:
        dying.kill()  # SIGKILL: it never leaves the queue itself
        dying.wait(10)
    assert dying.returncode == -signal.SIGKILL
    until(lambda: raw.pubsub_numsub(channel)[0][1] == 0, "Redis saw the child's subscription close")
    released = time.monotonic()
    assert holder.release() is True
    lease = waiter.result()
    assert lease is not None and raw.get(key) == lease.token
    assert waiter.returned - released < PROMPT  # not after the dead one's minute
    assert stored(raw, locks) == [key.encode()]  # the dead one was dropped from the queue
    assert lease.release() is True


def test_a_lock_handed_to_a_waiter_that_stopped_without_leaving_is_released(locks, make_locks, raw):
    # A waiter whose last step failed (Redis unreachable for it just then) stops without
    # being sure it left the queue; its process lives and listens on. A release that
    # hands it the lock later tells its client, which releases it for the next waiter.
    key = name(locks, "departed")
    holder = locks.acquire(key, TTL)
    client = make_locks()
    assert client.acquire(key, TTL, wait=0.01) is None  # a wait starts the client's listener
    (listener,) = client._driver._current().listeners.values()
    wakeups = listener.wakeups
    slot = wakeups.slot()
    token = client._core.new_values(1, b"@gone:1")[0]
    raw.rpush(queue_key(key), wakeups.entry(slot, time.time() + 60, 30_000, b"0", 1, token))
    # What a waiter leaves behind when its steps failed, its leave too: gone from the
    # client's mailboxes, remembered as departed, its entry still queued.
    del wakeups.slots[slot.seq]
    wakeups.departed[slot.seq] = None
    waiter = Waiter(make_locks(), key, wait=10)  # queued behind the departed one
    waiter.start()
    until_queued(raw, key, 2)
    released = time.monotonic()
    assert holder.release() is True  # handed to the departed waiter, which gives it back
    lease = waiter.result()
    assert lease is not None and raw.get(key) == lease.token
    assert waiter.returned - released < PROMPT
    assert lease.release() is True


def test_a_queue_step_whose_reply_is_lost_recognises_its_grant_and_its_place(make_locks, raw, redis_server):
    # The proxy lets the step run and cuts its reply: the step sent again must find the
    # lock it was granted (a fair acquire) or the place it took (a waiter), not take a
    # second place nor give up a lock it holds.
    key = name(make_locks(), "lost-step")
    proxy = FaultProxy(redis_server.port, after=None)
    try:
        locks = make_locks(proxy.url)
        assert locks.acquire(name(locks, "warm"), TTL) is not None  # connected, scripts loaded
        proxy.cut_after(0)
        lease = locks.acquire(key, TTL, fair=True)
        assert lease is not None and raw.get(key) == lease.token
        waiter = Waiter(locks, key, wait=10)
        proxy.cut_after(0)  # the waiter's first step: it queues, its reply is lost
        waiter.start()
        until_queued(raw, key, 1)
        time.sleep(0.3)  # the step is sent again meanwhile
        assert queued(raw, key) == 1  # one place, not two
        assert lease.release() is True
        handed = waiter.result()
        assert handed is not None and raw.get(key) == handed.token
        assert handed.release() is True
        assert raw.exists(key) == 0 and raw.exists(queue_key(key)) == 0  # nobody else was queued
    finally:
        proxy.close()


def test_a_key_without_a_slot_for_its_queue_cannot_be_waited_for(locks, raw):
    key = name(locks, "odd}key")
    lease = locks.acquire(key, TTL)  # taken and released as any lock
    for call in (
        lambda: locks.acquire(key, TTL, wait=1),
        lambda: locks.acquire(key, TTL, fair=True),
        lambda: locks.acquire(key, TTL, shared=True),
    ):
        with pytest.raises(ValueError, match="waiting for a lock needs a key without an unmatched"):
            call()
    assert lease.release() is True
    assert stored(raw, locks) == []


class Reads:
    """Which threads took the turn to read a subscription, and which thread delivered
    each message (its payload): ``ThreadListener._turn`` and ``Wakeups.message`` spied on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.turns: list[str] = []
        self.messages: list[tuple[bytes, str]] = []
        self.turned = threading.Event()
        turn, message = ThreadListener._turn, Wakeups.message

        def spied_turn(listener: ThreadListener, *args: Any) -> bool:
            got = turn(listener, *args)
            if got:
                self.turns.append(threading.current_thread().name)
                self.turned.set()
            return got

        def spied_message(wakeups: Wakeups, payload: bytes) -> None:
            self.messages.append((payload, threading.current_thread().name))
            message(wakeups, payload)

        monkeypatch.setattr(ThreadListener, "_turn", spied_turn)
        monkeypatch.setattr(Wakeups, "message", spied_message)

    def of(self, key: str) -> list[str]:
        """The threads that delivered the hand-offs of ``key``."""
        return [thread for payload, thread in self.messages if payload.endswith(key.encode())]


def named(waiter: Waiter, thread_name: str) -> Waiter:
    waiter.name = thread_name
    return waiter


def held_apart(locks: Any, make_locks: Any, *names: str) -> tuple[Any, list[str], dict[str, Any]]:
    """Another client to wait with, and keys of these names that ``locks`` holds (their leases)."""
    keys = [name(locks, each) for each in names]
    return make_locks(), keys, {key: locks.acquire(key, TTL) for key in keys}


def test_a_parked_waiter_reads_its_wake_up_itself_and_wakes_those_parked_beside_it(
    locks, make_locks, raw, monkeypatch
):
    reads = Reads(monkeypatch)
    waiting, (first, beside), held = held_apart(locks, make_locks, "reader", "beside")
    reader = named(Waiter(waiting, first, wait=10), "reader")
    reader.start()
    assert reads.turned.wait(10), "the lone parked waiter never took the turn to read"
    other = named(Waiter(waiting, beside, wait=10), "beside")
    other.start()
    until_queued(raw, beside, 1)
    # The one beside is handed its lock while the reader reads: the reader wakes it.
    assert held[beside].release() is True
    assert other.result() is not None
    assert held[first].release() is True
    assert reader.result() is not None
    assert reads.turns == ["reader"]
    assert reads.of(beside) == ["reader"] and reads.of(first) == ["reader"]
    # The turn went back to the thread and is taken again by the next lone waiter.
    reads.turned.clear()
    again = named(Waiter(waiting, first, wait=10), "again")
    again.start()
    assert reads.turned.wait(10), "the next lone parked waiter never took the turn to read"
    assert reader.lease.release() is True
    assert again.result() is not None
    assert reads.turns == ["reader", "again"] and reads.of(first) == ["reader", "again"]
    for lease in (other.lease, again.lease):
        assert lease.release() is True
    assert stored(raw, locks) == []


def test_a_waiter_interrupted_while_it_reads_leaves_those_parked_beside_it_woken(
    locks, make_locks, raw, monkeypatch
):
    assert threading.current_thread() is threading.main_thread()  # where signal handlers run
    reads = Reads(monkeypatch)
    waiting, (first, beside), held = held_apart(locks, make_locks, "interrupted", "beside")
    other = named(Waiter(waiting, beside, wait=10), "beside")

    class Alarm(Exception):
        pass

    def alarm(signum: int, frame: object) -> None:
        raise Alarm

    def park_beside() -> None:  # once the main thread reads, the other parks
        assert reads.turned.wait(10)
        other.start()

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        threading.Thread(target=park_beside, daemon=True).start()
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(Alarm):
            waiting.acquire(first, TTL, wait=10)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert reads.turns[0] == threading.current_thread().name
    until(lambda: queued(raw, first) == 0, "the interrupted waiter left the queue")
    released = time.monotonic()
    assert held[beside].release() is True
    assert other.result() is not None
    assert other.returned - released < PROMPT
    for lease in (held[first], other.lease):
        assert lease.release() is True
    assert stored(raw, locks) == []


def kill_subscriptions(raw: Any) -> None:
    assert raw.client_kill_filter(_type="pubsub") >= 1


def test_a_waiter_whose_subscription_breaks_still_gets_the_lock(locks, make_locks, raw):
    key = name(locks, "broken")
    holder = locks.acquire(key, TTL)
    waiting = make_locks()
    waiter = Waiter(waiting, key, wait=10)
    waiter.start()
    until_queued(raw, key, 1)
    kill_subscriptions(raw)
    # Released at once: handed over, or (the waiter's channel being silent) freed.
    released = time.monotonic()
    assert holder.release() is True
    lease = waiter.result()
    assert lease is not None and raw.get(key) == lease.token
    assert waiter.returned - released < PROMPT
    # The client listens again: its next waiter is woken by a hand-off.
    second = Waiter(waiting, key, wait=10)
    second.start()
    until_queued(raw, key, 1)
    released = time.monotonic()
    assert lease.release() is True
    assert second.result() is not None
    assert second.returned - released < PROMPT
    assert second.lease.release() is True
    assert stored(raw, locks) == []


def test_an_async_waiter_whose_subscription_breaks_still_gets_the_lock(locks, async_locks, raw):
    key = name(locks, "broken-aio")

    async def main():
        async with async_locks() as holding, async_locks() as waiting:
            holder = await holding.acquire(key, TTL)
            for _ in range(2):  # the second time on the subscription made again
                task = asyncio.ensure_future(waiting.acquire(key, TTL, wait=10))
                while queued(raw, key) < 1:
                    assert not task.done(), task
                    await asyncio.sleep(0.005)
                kill_subscriptions(raw)
                released = time.monotonic()
                assert await holder.release() is True
                lease = await asyncio.wait_for(task, 30)
                assert time.monotonic() - released < PROMPT
                assert lease is not None and raw.get(key) == lease.token
                holder = lease  # the next round's holder
            assert await holder.release() is True

    asyncio.run(main())
    assert stored(raw, locks) == []


@pytest.mark.parametrize("how", ["cancel", "wait_for"])
def test_a_cancelled_async_waiter_leaves_no_lock_behind(locks, async_locks, raw, how):
    """Cancelled while queued, then the lock is released at once: the hand-off may reach
    the cancelled waiter before it leaves the queue; what it was handed is given back."""
    key = name(locks, "cancelled")
    holder = locks.acquire(key, TTL)

    async def main():
        waiting = async_locks()
        try:
            if how == "cancel":
                task = asyncio.ensure_future(waiting.acquire(key, TTL, wait=10))
                while queued(raw, key) < 1:
                    await asyncio.sleep(0.005)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(waiting.acquire(key, TTL, wait=10), 0.3)
            assert holder.release() is True
            # Free shortly after (polled: the leaving runs in the background).
            deadline = time.monotonic() + PROMPT
            while (lease := locks.acquire(key, TTL)) is None:
                assert time.monotonic() < deadline, f"the lock stayed held: {raw.get(key)!r}"
                await asyncio.sleep(0.01)
            assert queued(raw, key) == 0
            return lease
        finally:
            # close() waits for the clean-ups left running: bounded, so that one that
            # never ends fails the test instead of hanging the suite.
            await asyncio.wait_for(waiting.close(), 5)

    lease = asyncio.run(main())
    assert lease.release() is True
    assert stored(raw, locks) == []


# -- counting and fenced locks ------------------------------------------------------------------


def test_a_counting_locks_waiter_takes_the_place_a_release_frees(locks, make_locks, raw):
    key = name(locks, "counting")
    first, second = (locks.acquire(key, TTL, limit=2) for _ in range(2))
    assert first is not None and second is not None
    waiter = Waiter(make_locks(), key, wait=10, limit=2)
    waiter.start()
    until_queued(raw, key, 1)
    released = time.monotonic()
    assert first.release() is True
    lease = waiter.result()
    assert lease is not None
    assert waiter.returned - released < PROMPT
    held = {m for m in raw.zrange(key, 0, -1) if m != b"limit"}
    assert held == {second.token, lease.token}
    assert locks.release_many([second, lease]) == [True, True]
    assert stored(raw, locks) == []


def queue_waiters(locks: Any, raw: Any, key: str, n: int, **options: Any) -> tuple[list[Waiter], float]:
    """``n`` waiters (wait=10) on ``locks``, queued one after another, and when they began."""
    waiters = [Waiter(locks, key, wait=10, **options) for _ in range(n)]
    started = time.monotonic()
    for i, waiter in enumerate(waiters):
        waiter.start()
        until_queued(raw, key, i + 1)
    return waiters, started


def granted_promptly(waiters: list[Waiter], started: float) -> list[Any]:
    """Their leases, every one granted, and soon after they began."""
    leases = [waiter.result() for waiter in waiters]
    assert all(leases)
    assert max(waiter.returned for waiter in waiters) - started < PROMPT
    return leases


def test_places_that_expire_go_to_as_many_waiters(locks, make_locks, raw):
    """Nobody releases: the first waiter looks again at the soonest expiry, takes a place
    and hands the other freed one to the next waiter."""
    key = name(locks, "counting-expiry")
    assert all(locks.acquire(key, 0.5, limit=2) for _ in range(2))  # never released
    leases = granted_promptly(*queue_waiters(make_locks(), raw, key, 2, limit=2))
    assert {m for m in raw.zrange(key, 0, -1) if m != b"limit"} == {lease.token for lease in leases}
    assert locks.release_many(leases) == [True, True]
    assert stored(raw, locks) == []


@pytest.mark.parametrize("limit", [1, 2])
def test_a_fenced_waiter_gets_a_greater_fencing_number(locks, make_locks, raw, limit):
    key = name(locks, "fenced")
    holders = [locks.acquire(key, TTL, fence=True, limit=limit) for _ in range(limit)]
    waiter = Waiter(make_locks(), key, wait=10, fence=True, limit=limit)
    waiter.start()
    until_queued(raw, key, 1)
    assert holders[-1].release() is True
    lease = waiter.result()
    assert lease is not None
    assert lease.fence > max(holder.fence for holder in holders)
    assert lease.token.endswith(b"#%d" % lease.fence)  # as the hand-off set it in Redis
    assert locks.release_many([*holders[:-1], lease]) == [True] * limit


@pytest.mark.parametrize("fair", [False, True])
def test_a_waiter_meets_a_mismatched_locks_error_at_once_and_leaves_no_trace(locks, make_locks, raw, fair):
    """The errors of the acquire without wait, before any waiting: nothing to wait for."""
    counted, plain, listed = name(locks, "counted"), name(locks, "plain"), name(locks, "list")
    held = [locks.acquire(counted, TTL, limit=2), locks.acquire(plain, TTL)]
    raw.rpush(listed, "job")
    waiting = make_locks()
    cases = [
        (counted, {}, joblock.LimitMismatchError, "is a counting lock with limit=2, not a plain lock"),
        (counted, {"fence": True}, joblock.LimitMismatchError, "with limit=2, not a plain lock"),
        (counted, {"limit": 3}, joblock.LimitMismatchError, "with limit=2, not limit=3"),
        (plain, {"limit": 2}, joblock.LimitMismatchError, "is a plain lock"),
        (listed, {}, joblock.WrongTypeError, "WRONGTYPE"),
        (listed, {"fence": True}, joblock.WrongTypeError, "WRONGTYPE"),
    ]
    for key, options, error, message in cases:
        started = time.monotonic()
        with pytest.raises(error, match=message):
            waiting.acquire(key, TTL, wait=6, fair=fair, **options)
        assert time.monotonic() - started < 3, (options, "met at the wait's end")
        assert queued(raw, key) == 0, options
    assert locks.release_many(held) == [True, True]
    assert raw.lrange(listed, 0, -1) == [b"job"]
    raw.delete(listed)
    assert stored(raw, locks) == []


# -- many idle waiters -----------------------------------------------------------------------


def test_many_idle_async_waiters_send_nothing(locks, async_locks, raw):
    """200 tasks, each waiting on a held key of its own: the one connection's subscription
    stays silent, and nobody asks Redis anything until the holders release."""
    n = 200
    keys = [name(locks, f"idle{i}") for i in range(n)]
    holders = locks.acquire_many(keys, TTL)
    assert all(holders)

    async def main():
        async with async_locks() as waiting:
            started = time.monotonic()
            tasks = [asyncio.ensure_future(waiting.acquire(key, TTL, wait=10)) for key in keys]
            queues = [queue_key(key) for key in keys]
            while raw.exists(*queues) < n:
                assert not any(task.done() for task in tasks)
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            before = calls(raw)
            await asyncio.sleep(2)
            idle = calls(raw) - before
            assert time.monotonic() - started < 9, "too slow a machine for the measure to mean anything"
            assert locks.release_many(holders) == [True] * n
            leases = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert all(lease is not None for lease in leases)
            assert raw.mget(keys) == [lease.token for lease in leases]
            assert await waiting.release_many(leases) == [True] * n
            return idle

    idle = asyncio.run(main())
    assert idle < 20, f"{idle} commands in 2 s from {n} idle waiters"
    assert stored(raw, locks) == []
