"""Lost means stopped: a lease's deadline, ``lease.lost``, ``check()``, ``valid_for()``
and the ``on_lost`` strategies, on real servers and each twin of the core.

Losses come as they come to users: a deadline passing (Redis answering, or stopped
with SIGSTOP while auto_renew tries), an extend finding the lock expired or taken, an
operator's release (``joblock release``, ``joblock.testing``), a forked process exiting.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from typing import Any

import pytest

import joblock
from helpers import name
from joblock import LockLost, lost, testing
from joblock._tools import admin
from joblock._tools.servers import RedisServer
from joblock.aio import AsyncLocks

# Long enough for a busy machine's round trips, short enough that a deadline comes soon.
SHORT = 0.4
PATIENCE = 10.0  # what a test waits at most for a loss it expects


def until(predicate: Any, what: str, timeout: float = PATIENCE) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def busy(seconds: float = PATIENCE) -> None:
    """Python work in small steps, as a job does (an interrupt lands between them)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.001)
    raise AssertionError("the block was not stopped")


def async_locks(core: Any, url: str, prefix: str) -> AsyncLocks:
    return type("AsyncLocks", (AsyncLocks,), {"_core": core})(url, prefix=prefix)


# -- what every lease knows ---------------------------------------------------------------


def test_a_lease_is_sure_of_its_lock_for_its_ttl_less_the_drift(locks):
    locks.acquire(name(locks, "warm"), 10)  # connected: the next grant is one round trip
    before = time.monotonic()
    lease = locks.acquire(name(locks, "sure"), 10)
    after = time.monotonic()
    assert lease is not None
    # Counted from before the grant was sent: at most the ttl less the drift allowance.
    sure = 10 * 0.99 - 0.002
    earlier = time.monotonic()
    left = lease.valid_for()
    later = time.monotonic()
    assert before + sure - later <= left <= after + sure - earlier
    assert not lease.lost.is_set() and not lease.lost
    lease.check()
    assert lease.lost.wait(0.01) is False
    assert lease.extend(20) is True
    assert 19.5 < lease.valid_for() <= 20 * 0.99
    assert lease.release() is True
    assert lease.valid_for() == 0.0 and lease.lost.is_set() and lease.lost.cause == "ended"
    with pytest.raises(LockLost, match="its holder released it") as caught:
        lease.check()
    assert caught.value.key == lease.key and caught.value.cause == "ended"


def test_a_deadline_passing_unconfirmed_loses_the_lease_for_good(locks):
    lease = locks.acquire(name(locks, "deadline"), SHORT)
    assert lease is not None
    assert lease.lost.wait(PATIENCE) is True  # woken at the deadline, nobody telling it
    assert lease.lost.cause == "deadline" and lease.valid_for() == 0.0
    with pytest.raises(LockLost, match="deadline passed") as caught:
        lease.check()
    assert caught.value.cause == "deadline"
    # The lock may still be there in Redis (the deadline is the lease's doubt, not
    # Redis's expiry): an extend of it does not make the lease sure again.
    lease.extend(60)
    assert lease.lost.is_set() and lease.lost.cause == "deadline"
    lease.release()


@pytest.mark.parametrize("how", ["expired", "taken"])
def test_an_extend_that_finds_the_lock_gone_says_why(locks, raw, how):
    lease = locks.acquire(name(locks, how), 60)
    assert lease is not None
    if how == "expired":
        raw.delete(lease.key)
    else:
        raw.set(lease.key, b"another holder's token", px=60_000)
    assert lease.extend(60) is False
    assert lease.lost.cause == how and not lease.held
    with pytest.raises(LockLost, match="expired" if how == "expired" else "another holder"):
        lease.check()


def test_batches_give_each_lease_its_deadline_and_extend_many_moves_it(locks, raw):
    leases = locks.acquire_many([name(locks, f"b{i}") for i in range(2500)], 30)
    assert all(lease is not None and 29 < lease.valid_for() <= 30 for lease in leases)
    raw.set(leases[7].key, b"another holder's token", px=60_000)
    assert locks.extend_many(leases, 120).count(False) == 1
    assert leases[7].lost.cause == "taken"
    assert all(118 < lease.valid_for() <= 120 * 0.99 for i, lease in enumerate(leases) if i != 7)
    locks.release_many(leases)


def test_a_lock_handed_over_after_a_long_wait_is_sure_for_its_whole_ttl(locks, make_locks):
    key = name(locks, "handed")
    holder = locks.acquire(key, 60)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(make_locks().acquire(key, 1.0, wait=PATIENCE)))
    waiter.start()
    time.sleep(0.8)  # more than half the waiter's ttl: its queue step's send is too old to count from
    holder.release()
    waiter.join(PATIENCE)
    (lease,) = got
    assert lease is not None and 0.9 < lease.valid_for() <= 1.0
    lease.release()


def test_an_adopted_lease_knows_no_deadline_until_an_extend(locks):
    lease = locks.acquire(name(locks, "adopted"), 60)
    adopted = locks._adopt(lease.key, lease.token)
    assert adopted.valid_for() == 0.0 and not adopted.lost.is_set()
    assert adopted.extend(30) is True
    assert 29 < adopted.valid_for() <= 30
    adopted.release()


# -- on_lost="interrupt": threads ---------------------------------------------------------


def test_interrupt_at_the_deadline(locks):
    key = name(locks, "interrupt")
    started = time.monotonic()
    with pytest.raises(LockLost) as caught, locks.lock(key, SHORT, on_lost="interrupt"):
        busy()
    assert caught.value.key == key and caught.value.cause == "deadline"
    assert time.monotonic() - started < PATIENCE / 2


def test_interrupt_when_an_operator_releases_the_lock(locks, redis_server):
    key = name(locks, "operator")
    releaser = threading.Timer(0.3, admin.release, args=(redis_server.url, key))
    releaser.start()
    with pytest.raises(LockLost) as caught, locks.lock(key, 60, on_lost="interrupt"):
        busy()
    releaser.join()
    assert caught.value.cause == "released"


def test_interrupt_when_the_lock_is_taken_over(locks):
    key = name(locks, "over")
    leases: list[Any] = []
    with pytest.raises(LockLost) as caught, locks.lock(key, 60, on_lost="interrupt") as lease:
        threading.Timer(0.2, lambda: leases.append(testing.take_over(lease))).start()
        busy()
    assert caught.value.cause == "taken"
    until(lambda: leases, "the new holder")
    assert leases[0].release() is True


def test_a_block_that_catches_its_interrupt_has_handled_it(locks):
    key = name(locks, "caught")
    caught: list[LockLost] = []
    with locks.lock(key, SHORT, on_lost="interrupt") as lease:
        try:
            busy()
        except LockLost as error:
            caught.append(error)
        time.sleep(0.01)  # the block goes on a little, and ends cleanly: no second LockLost
    (error,) = caught
    assert error.key == key and error.cause == "deadline" and lease.lost.cause == "deadline"


def test_the_interrupt_comes_before_the_warning_is_logged(locks):
    """A log handler that is slow (a remote one, a full disk) must not let the block
    work on: its thread is interrupted first, then the loss is logged."""
    key = name(locks, "logged")
    stopped = threading.Event()
    seen: list[bool] = []

    class Slow(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if f"lost the lock {key!r}" in record.getMessage():
                seen.append(stopped.wait(PATIENCE / 2))  # True once the block was stopped

    handler = Slow(level=logging.WARNING)
    logger = logging.getLogger("joblock")
    logger.addHandler(handler)
    try:
        with pytest.raises(LockLost), locks.lock(key, SHORT, on_lost="interrupt"):
            try:
                busy()
            finally:
                stopped.set()
        until(lambda: seen, "the warning")  # logged after the interrupt: maybe after the block
    finally:
        logger.removeHandler(handler)
    assert seen == [True]


def test_a_block_that_ends_as_the_loss_comes_raises_nothing_after_it(locks):
    """Whatever the race between the block's end and its deadline, once the ``with``
    statement is over no LockLost comes: not in the next statement, nor later."""
    outcomes = []
    for i in range(40):
        ttl = 0.05
        try:
            with locks.lock(name(locks, f"race{i}"), ttl, on_lost="interrupt"):
                # Around the moment the block is stopped: its deadline less lost.EARLY.
                end = time.monotonic() + ttl * 0.99 - 0.002 - lost.EARLY + (i % 5 - 2) * 0.001
                while time.monotonic() < end:
                    pass
            outcomes.append("clean")
        except LockLost:
            outcomes.append("lost")
        for _ in range(20_000):  # Python code after the block, where a late interrupt would land
            pass
        time.sleep(0.002)
    assert set(outcomes) <= {"clean", "lost"}


def test_nested_locks_each_stop_only_for_their_own_loss(locks):
    outer_key, inner_key = name(locks, "outer"), name(locks, "inner")
    with locks.lock(outer_key, 60, on_lost="interrupt") as outer:
        with pytest.raises(LockLost) as caught, locks.lock(inner_key, SHORT, on_lost="interrupt"):
            busy()
        assert caught.value.key == inner_key
        outer.check()
        time.sleep(0.05)
    assert outer.lost.cause == "ended"


def test_a_callable_is_given_the_lease_and_the_block_goes_on(locks):
    told: list[Any] = []
    with locks.lock(name(locks, "callable"), SHORT, on_lost=told.append) as lease:
        until(lambda: told, "the callable")
    assert told == [lease] and lease.lost.cause == "deadline"


def test_interrupt_when_redis_is_stopped_and_renewals_cannot_come(core, make_locks):
    """auto_renew keeps a job's lease alive while Redis answers; stopped (SIGSTOP), the
    renewals hang, and the job is stopped at its deadline, not at a socket timeout."""
    with RedisServer() as server:
        locks = make_locks(server.url, socket_timeout=30, retries=0)
        times: list[float] = []

        def resume_once_lost(lease: Any) -> None:
            lease.lost.wait(PATIENCE)
            times.append(time.monotonic())
            os.kill(server.process.pid, signal.SIGCONT)  # the job's release may go through

        @locks.job(ttl=1.0, auto_renew=True, on_lost="interrupt")
        def job() -> None:
            time.sleep(1.0)  # renewed meanwhile: still sure
            current = joblock.current_lease()
            assert current is not None and current.valid_for() > 0.3
            threading.Thread(target=resume_once_lost, args=(current,), daemon=True).start()
            os.kill(server.process.pid, signal.SIGSTOP)
            times.append(time.monotonic())
            busy()

        try:
            with pytest.raises(LockLost) as caught:
                job()
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert caught.value.cause == "deadline"
        stopped, lost_at = times
        assert lost_at - stopped < 1.0  # by its deadline, long before the 30 s socket timeout


def test_renewals_keep_a_guarded_job_going_past_many_ttls(locks):
    @locks.job(ttl=SHORT, auto_renew=True, on_lost="interrupt")
    def job() -> float:
        time.sleep(SHORT * 4)
        current = joblock.current_lease()
        assert current is not None
        current.check()
        return current.valid_for()

    assert job() > 0


# -- on_lost="exit": forked workers --------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["c", "python"])
def pure(request: pytest.FixtureRequest) -> bool:
    """Whether the holder's process runs the pure twin (JOBLOCK_NO_EXTENSIONS=1)."""
    return request.param  # type: ignore[no-any-return]


def run_holder(script: str, redis_server: Any, pure: bool) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` in a process of its own, on the twin ``pure`` says, given the
    server's URL and a prefix of its own for its keys."""
    env = dict(os.environ)
    env.pop("JOBLOCK_NO_EXTENSIONS", None)
    if pure:
        env["JOBLOCK_NO_EXTENSIONS"] = "1"
    return subprocess.run(
        [sys.executable, "-c", script, redis_server.url, f"lost-{uuid.uuid4().hex}"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


# The scripts below test the stop the process makes itself: their stop margin
# (lost.EARLY) is wide, so that the kernel's stop at the deadline itself (tested after
# them) never comes first, however late a loaded machine runs the stopping thread.


_EXITING = textwrap.dedent(
    """
    import logging, sys, time
    import joblock
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    joblock.lost.EARLY = 1.5  # the process stops itself first
    locks = joblock.Locks(sys.argv[1], prefix=sys.argv[2])
    with locks.lock(sys.argv[2] + ":exit", 2.0, on_lost="exit"):
        while True:
            time.sleep(0.001)
    """
)


def test_exit_ends_the_process_with_its_status_after_saying_why(redis_server, pure):
    done = run_holder(_EXITING, redis_server, pure)
    assert done.returncode == lost.EXIT_STATUS == 75
    assert "lost the lock 'lost-" in done.stderr and "deadline passed" in done.stderr


_PARKED_FIRST = textwrap.dedent(
    """
    import logging, sys, threading, time
    import joblock
    block = threading.get_ident()

    def parked():
        frame = sys._current_frames().get(block)
        while frame is not None:
            if frame.f_globals.get("__name__") == "joblock.lost" and frame.f_code.co_name == "__init__":
                return True
            frame = frame.f_back
        return False

    class Slow(logging.Handler):
        # A slow handler (a remote one, a full disk): the block must not work on meanwhile.
        def emit(self, record):
            if "lost the lock" in record.getMessage():
                end = time.monotonic() + 10
                while not parked() and time.monotonic() < end:
                    time.sleep(0.001)
                print("parked" if parked() else "working", flush=True)

    logging.getLogger("joblock").addHandler(Slow(level=logging.CRITICAL))
    joblock.lost.EARLY = 1.5  # the process stops itself first
    locks = joblock.Locks(sys.argv[1], prefix=sys.argv[2])
    with locks.lock(sys.argv[2] + ":parked", 2.0, on_lost="exit"):
        try:
            while True:
                time.sleep(0.001)
        finally:
            print("the block's handler ran", flush=True)
    """
)


def test_exit_parks_the_blocks_thread_before_saying_why(redis_server, pure):
    """The exit's log line is I/O, which lets the block's thread take the GIL: the block
    is parked first (where it stands, none of its handlers running), then the loss is
    logged and the process exits."""
    done = run_holder(_PARKED_FIRST, redis_server, pure)
    assert done.returncode == lost.EXIT_STATUS
    assert done.stdout.split() == ["parked"], done.stderr


_HOLDING_THE_LOG = textwrap.dedent(
    """
    import logging, sys, time
    import joblock
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger("joblock").addHandler(handler)
    joblock.lost.EARLY = 1.5  # the process stops itself first
    locks = joblock.Locks(sys.argv[1], prefix=sys.argv[2])
    with locks.lock(sys.argv[2] + ":holding", 2.0, on_lost="exit"):
        with handler.lock:  # held throughout, as by a log call that takes long
            try:
                while True:
                    time.sleep(0.001)
            except joblock.LockLost:
                # Not parked: the exit's log line needs that lock. Said while it is
                # still held, so before the exit's log line and the exit.
                print("LockLost", flush=True)
                raise
    """
)


def test_exit_does_not_park_a_thread_that_holds_a_logging_lock(redis_server, pure):
    """Parked holding a log handler's lock, the block's thread would keep the exit's log
    line (and the exit) waiting: it gets LockLost instead, and the process exits."""
    done = run_holder(_HOLDING_THE_LOG, redis_server, pure)
    assert done.returncode == lost.EXIT_STATUS
    assert "holding' (" in done.stderr
    assert done.stdout.split() == ["LockLost"]


_STUCK_IN_C = textwrap.dedent(
    """
    import itertools, sys
    import joblock
    locks = joblock.Locks(sys.argv[1], prefix=sys.argv[2])
    with locks.lock(sys.argv[2] + ":stuck", 2.0, on_lost="exit"):
        print("held", flush=True)
        sum(itertools.repeat(1, 10**13))  # a C call that keeps the GIL for hours
        print("the C call ended", flush=True)
    """
)


def test_exit_kills_a_block_that_works_on_at_its_deadline(redis_server, pure):
    """A block in a C call that keeps the GIL lets no thread of its process stop it: the
    kernel's timer ends the process at the lease's deadline (SIGKILL, nothing logged)."""
    done = run_holder(_STUCK_IN_C, redis_server, pure)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout.split() == ["held"]


_RENEWED = textwrap.dedent(
    """
    import sys, time
    import joblock
    locks = joblock.Locks(sys.argv[1], prefix=sys.argv[2])

    @locks.job(ttl=2.0, auto_renew=True, on_lost="exit", key=lambda: "renewed")
    def job():
        lease = joblock.current_lease()
        first = lease._deadline
        while lease._deadline < first + 1.0:  # renewed
            time.sleep(0.01)
        lease.extend(2.0)  # an extend of the caller's moves it too
        time.sleep(max(0.0, first + 0.5 - time.monotonic()))  # past the first deadline
        print("done", lease.valid_for() > 0, flush=True)

    job()
    """
)


def test_exit_lets_a_renewed_block_work_past_its_first_deadlines(redis_server, pure):
    """The kernel's stop moves with every confirmed extend, the renewer's and the caller's."""
    done = run_holder(_RENEWED, redis_server, pure)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["done", "True"]


# -- on_lost="cancel": asyncio --------------------------------------------------------------


def test_cancel_at_the_deadline_ends_the_block_with_lock_lost(core, redis_server, locks):
    async def main() -> tuple[LockLost, float]:
        alocks = async_locks(core, redis_server.url, locks.prefix)
        started = time.monotonic()
        try:
            with pytest.raises(LockLost) as caught:
                async with alocks.lock(f"{locks.prefix}:cancel", SHORT, on_lost="cancel") as lease:
                    assert await lease.lost.wait(0.01) is False
                    await asyncio.sleep(PATIENCE)
            assert lease.lost.is_set() and await lease.lost
            return caught.value, time.monotonic() - started
        finally:
            await alocks.close()

    error, took = asyncio.run(main())
    assert error.cause == "deadline" and took < PATIENCE / 2


def test_cancel_when_an_operator_releases_the_lock(core, redis_server, locks):
    async def main() -> LockLost:
        alocks = async_locks(core, redis_server.url, locks.prefix)
        try:
            with pytest.raises(LockLost) as caught:
                async with alocks.lock(f"{locks.prefix}:op", 60, on_lost="cancel"):
                    await asyncio.to_thread(admin.release, redis_server.url, f"{locks.prefix}:op")
                    await asyncio.sleep(PATIENCE)
            return caught.value
        finally:
            await alocks.close()

    assert asyncio.run(main()).cause == "released"


def test_a_cancellation_that_is_not_joblocks_still_cancels(core, redis_server, locks):
    async def main() -> None:
        alocks = async_locks(core, redis_server.url, locks.prefix)

        async def guarded() -> None:
            async with alocks.lock(f"{locks.prefix}:theirs", 60, on_lost="cancel"):
                await asyncio.sleep(PATIENCE)

        try:
            task = asyncio.ensure_future(guarded())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await alocks.close()

    asyncio.run(main())


def test_a_block_that_swallows_the_cancellation_still_ends_with_lock_lost(core, redis_server, locks):
    async def main() -> list[str]:
        alocks = async_locks(core, redis_server.url, locks.prefix)
        seen: list[str] = []
        try:
            with pytest.raises(LockLost):
                async with alocks.lock(f"{locks.prefix}:swallow", SHORT, on_lost="cancel"):
                    try:
                        await asyncio.sleep(PATIENCE)
                    except asyncio.CancelledError:
                        seen.append("cancelled")
                    await asyncio.sleep(0.01)  # its work goes on: the exit still says lost
                    seen.append("went on")
            task = asyncio.current_task()
            if task is not None and hasattr(task, "cancelling"):
                assert task.cancelling() == 0  # joblock took its cancellation back
            return seen
        finally:
            await alocks.close()

    assert asyncio.run(main()) == ["cancelled", "went on"]


def test_an_async_callable_runs_on_the_loop(core, redis_server, locks):
    async def main() -> list[str]:
        alocks = async_locks(core, redis_server.url, locks.prefix)
        told: list[str] = []

        async def tell(lease: Any) -> None:
            await asyncio.sleep(0)
            told.append(lease.lost.cause)

        try:
            async with alocks.lock(f"{locks.prefix}:callable", SHORT, on_lost=tell):
                for _ in range(int(PATIENCE / 0.01)):
                    if told:
                        break
                    await asyncio.sleep(0.01)
            return told
        finally:
            await alocks.close()

    assert asyncio.run(main()) == ["deadline"]


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("on_lost", "error", "match"),
    [
        (
            "nope",
            ValueError,
            "on_lost must be 'ignore', 'interrupt', 'cancel', 'exit' or a callable, not 'nope'",
        ),
        ("cancel", ValueError, "on_lost='cancel' cancels an asyncio task"),
        (5, TypeError, "on_lost must be .* not int"),
        (True, TypeError, "on_lost must be .* not bool"),
    ],
)
def test_bad_on_lost_is_refused_before_anything_is_written(locks, raw, on_lost, error, match):
    with pytest.raises(error, match=match), locks.lock(name(locks, "bad"), 60, on_lost=on_lost):
        pass
    with pytest.raises(error, match=match):
        locks.job(ttl=60, on_lost=on_lost)
    assert raw.keys(f"{locks.prefix}:*") == []


def test_interrupt_is_refused_for_an_asyncio_block(core, redis_server, locks, raw):
    async def main() -> None:
        alocks = async_locks(core, redis_server.url, locks.prefix)
        try:
            with pytest.raises(ValueError, match="on_lost='interrupt' interrupts a thread"):
                async with alocks.lock(f"{locks.prefix}:bad", 60, on_lost="interrupt"):
                    pass
        finally:
            await alocks.close()

    asyncio.run(main())
    assert raw.keys(f"{locks.prefix}:*") == []
