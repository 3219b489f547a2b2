"""The alarms that keep the asyncio driver's watchdogs off the event loop (_engine/alarms.py):
each rings on its own loop, not before its time; a cancelled one never; a sooner one set
while the thread sleeps for a later one rings first; a closed loop's is dropped; a forked
child has alarms of its own; the thread ends with the last alarm. (The watchdog itself:
test_engine's socket_timeout tests.)"""

from __future__ import annotations

import ast
import asyncio
import threading
import time

from joblock._engine import alarms
from test_connection import run_in_child


def ring_times(*delays: float, cancel: tuple[int, ...] = ()) -> dict[int, float]:
    """Sets an alarm per delay on a fresh loop: when each rang, after the loop's start.
    It waits for every alarm not in ``cancel`` to ring (up to 10 s: a busy machine rings
    late, not never), then half the last delay more, in which a cancelled one would ring."""

    async def main() -> dict[int, float]:
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        rang: dict[int, float] = {}

        def ring(i: int) -> None:
            assert threading.current_thread() is threading.main_thread()  # on the loop's thread
            rang[i] = time.monotonic() - start

        set_ = [alarms.call_at(start + delay, loop, ring, i) for i, delay in enumerate(delays)]
        for i in cancel:
            set_[i].cancel()
        due = set(range(len(delays))) - set(cancel)
        while not due <= rang.keys() and time.monotonic() < start + 10:
            await asyncio.sleep(0.01)
        await asyncio.sleep(max(delays) * 0.5)
        return rang

    return asyncio.run(main())


def test_an_alarm_rings_on_its_loop_not_before_its_time():
    rang = ring_times(0.05, 0.2)
    assert list(rang) == [0, 1]
    assert 0.05 <= rang[0] < rang[1]
    assert rang[1] >= 0.2


def test_a_cancelled_alarm_never_rings():
    assert list(ring_times(0.05, 0.1, 0.15, cancel=(1,))) == [0, 2]


def test_a_sooner_alarm_rings_first_though_the_thread_sleeps_for_a_later_one():
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        rang: list[str] = []
        alarms.call_at(time.monotonic() + 30, loop, rang.append, "later").cancel()
        await asyncio.sleep(0.05)  # the thread asleep until the later one
        alarms.call_at(time.monotonic() + 0.05, loop, rang.append, "sooner")
        await asyncio.sleep(0.5)
        return rang

    assert asyncio.run(main()) == ["sooner"]


def test_a_closed_loops_alarm_is_dropped_and_the_others_still_ring():
    loop = asyncio.new_event_loop()
    alarms.call_at(time.monotonic() + 0.05, loop, print, "never")
    loop.close()
    assert list(ring_times(0.1, 0.2)) == [0, 1]


def test_a_forked_child_rings_its_own_alarms_and_not_its_parents():
    parent_rang: list[str] = []
    parents_loop = asyncio.new_event_loop()
    alarms.call_at(time.monotonic() + 0.1, parents_loop, parent_rang.append, "parent")

    def child() -> str:
        assert not alarms._keeper.due  # the parent's pending alarm stayed with the parent
        return repr(ring_times(0.05, 0.1))

    code, report = run_in_child(child)
    assert code == 0, report
    assert list(ast.literal_eval(report)) == [0, 1]
    parents_loop.run_until_complete(asyncio.sleep(0.2))
    parents_loop.close()
    assert parent_rang == ["parent"]


def test_the_thread_ends_with_the_last_alarm_and_the_next_alarm_starts_another():
    def threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "joblock-alarms"]

    def child() -> str:
        # A forked child starts with no alarms: the earlier tests' watchdogs (clients left
        # open when their loop closed ring out only at their socket_timeout) are not here.
        assert threads() == []
        assert list(ring_times(0.05)) == [0]
        deadline = time.monotonic() + alarms.LINGER + 5
        while threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threads() == []
        return repr(ring_times(0.05, 0.1))

    code, report = run_in_child(child)
    assert code == 0, report
    assert list(ast.literal_eval(report)) == [0, 1]
