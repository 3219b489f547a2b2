"""joblock.frameworks, the part the Celery and RQ adapters share, without a framework.

The backoff and the ticket format are plain functions; the enqueue and run halves of
each lifetime are driven here by hand against the session's real redis-server, on
every core twin, as the adapters drive them in the workers of test_celery/test_rq.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import redis

from joblock import LockLost, LockNotAcquired, testing
from joblock.frameworks import (
    UNTIL_EXECUTED,
    UNTIL_EXECUTING,
    UNTIL_EXPIRED,
    WHILE_EXECUTING,
    Policy,
    Reschedule,
    Run,
    Ticket,
    admit,
    current_run,
)
from joblock.jobs import current_lease


@pytest.fixture
def client(redis_server):
    return redis.Redis.from_url(redis_server.url)


def policy(locks, lifetime=WHILE_EXECUTING, **options):
    options.setdefault("ttl", 10)
    return Policy(locks, name="Job", lifetime=lifetime, **options)


# -- backoff -------------------------------------------------------------------------------


def test_countdown_grows_is_capped_and_jittered_downwards():
    r = Reschedule(delay=1, factor=3, max_delay=20, jitter=0.25, max_attempts=50)
    random.seed(7)
    for attempt, base in [(1, 1), (2, 3), (3, 9), (4, 20), (50, 20)]:
        samples = [r.countdown(attempt) for _ in range(200)]
        assert all(base * 0.75 <= s <= base for s in samples)
        assert max(samples) - min(samples) > base * 0.2  # really spread
    assert Reschedule(delay=1, factor=10, max_delay=5, max_attempts=10_000).countdown(10_000) <= 5


def test_no_jitter_is_exact():
    r = Reschedule(delay=0.5, factor=2, max_delay=3, jitter=0)
    assert [r.countdown(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"delay": 0}, ValueError),
        ({"delay": -1}, ValueError),
        ({"delay": "1"}, TypeError),
        ({"delay": 10, "max_delay": 5}, ValueError),
        ({"factor": 0.5}, ValueError),
        ({"factor": float("inf")}, ValueError),
        ({"jitter": 1.5}, ValueError),
        ({"jitter": None}, TypeError),
        ({"max_attempts": 0}, ValueError),
        ({"max_attempts": 2.0}, TypeError),
        ({"then": "reschedule"}, ValueError),
    ],
)
def test_reschedule_checks_its_options(options, error):
    with pytest.raises(error):
        Reschedule(**options)


def test_policy_checks_its_options(locks):
    with pytest.raises(ValueError, match="lifetime"):
        policy(locks, "until_done")
    with pytest.raises(ValueError, match="on_conflict"):
        policy(locks, on_conflict="retry")
    with pytest.raises(ValueError, match="ttl"):
        policy(locks, ttl=0)
    with pytest.raises(ValueError, match="identifier or key"):
        policy(locks, identifier=lambda: None, key=lambda: "k")
    with pytest.raises(TypeError, match="locks"):
        policy("redis://")
    assert policy(locks, on_conflict="reschedule").on_conflict == Reschedule()
    lazy = policy(lambda: 42)
    with pytest.raises(TypeError, match="returned int"):
        lazy.lock_key((1,), {})


# -- the ticket ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["jc:Job:1", "jc:Jöb:ü", b"jc:\x00\xff\x80raw", None])
def test_ticket_round_trips_through_json(key):
    import json

    ticket = Ticket(key, b"0123abcd@host:42", started=True, attempt=3)
    assert Ticket.load(json.loads(json.dumps(ticket.dump()))) == ticket
    assert Ticket.load(Ticket(key).dump()) == Ticket(key)


@pytest.mark.parametrize("data", [None, "x", {"v": 2}, {"v": 1, "key": 5}, {"v": 1, "attempt": "1"}])
def test_unreadable_tickets_are_ignored(data, caplog):
    assert Ticket.load(data) is None
    assert (data is None) == (not caplog.records)


# -- adopting a lease ----------------------------------------------------------------------


def test_adopted_lease_acts_only_while_the_grant_is_the_same(make_locks, client):
    enqueuer, worker = make_locks(), make_locks()
    lease = enqueuer.acquire(enqueuer.key("Job", 1), ttl=10)
    adopted = worker._adopt(lease.key, lease.token)
    assert (adopted.key, adopted.token, adopted.held) == (lease.key, lease.token, True)
    assert adopted.extend(20) and 19 < adopted.remaining() <= 20
    assert adopted.release()
    assert not lease.release()  # it was freed by the adopter
    again = enqueuer.acquire(lease.key, ttl=10)
    assert not worker._adopt(lease.key, lease.token).release()  # a stale token frees nothing
    assert client.get(lease.key) == again.token
    with pytest.raises(TypeError, match="token"):
        worker._adopt(lease.key, lease.token.decode())
    with pytest.raises(ValueError, match="token"):
        worker._adopt(lease.key, b"")


# -- lifetimes, driven by hand -------------------------------------------------------------


def enqueue_and_run(p, client, args=(1,)):
    """Enqueue-time admission, then the worker's run; returns what the lock looked like."""
    admission = admit(p, args, {})
    key = p.lock_key(args, {})
    at_enqueue = client.get(key)
    ticket = Ticket.load(admission.ticket.dump()) if admission.ticket else None
    run = Run(p, ticket, args, {}, job_id="job-1")
    assert run.begin() is None
    with run:
        inside = client.get(key)
        assert current_run() is run and current_lease() is run.lease
    assert current_run() is None
    return at_enqueue, inside, client.get(key), run


def test_while_executing_takes_the_lock_at_the_run(locks, client):
    at_enqueue, inside, after, run = enqueue_and_run(policy(locks), client)
    assert at_enqueue is None and inside == run.lease.token and after is None


def test_until_executing_frees_at_the_start(locks, client):
    at_enqueue, inside, after, run = enqueue_and_run(policy(locks, UNTIL_EXECUTING), client)
    assert at_enqueue is not None and inside is None and after is None and run.lease is None


def test_until_executed_adopts_the_enqueue_lock(locks, client):
    at_enqueue, inside, after, run = enqueue_and_run(policy(locks, UNTIL_EXECUTED), client)
    assert at_enqueue is not None and inside == at_enqueue == run.lease.token and after is None


def test_until_expired_leaves_the_lock(locks, client):
    at_enqueue, inside, after, _ = enqueue_and_run(policy(locks, UNTIL_EXPIRED, ttl=5), client)
    assert at_enqueue is not None and inside == after == at_enqueue
    assert 0 < client.pttl(policy(locks).lock_key((1,), {})) <= 5000


def test_a_lock_lost_in_the_queue_is_taken_again(locks, client):
    p = policy(locks, UNTIL_EXECUTED)
    admission = admit(p, (1,), {})
    admission.lease.release()  # as if it had expired while the job waited
    run = Run(p, admission.ticket, (1,), {})
    assert run.begin() is None
    assert run.lease.token != admission.ticket.token
    with run:
        pass


def test_retry_ticket_carries_the_lease_and_the_retry_adopts_it(locks, client):
    p = policy(locks)
    run = Run(p, None, (1,), {}, job_id="j")
    assert run.begin() is None
    with run:
        ticket = Ticket.load(run.retry_ticket().dump())
        run.keep()
    assert client.get(run.key) == run.lease.token  # kept for the retry
    retried = Run(p, ticket, (1,), {}, job_id="j")
    assert retried.begin() is None  # its own lock is no conflict
    assert retried.lease.token == run.lease.token
    with retried:
        pass
    assert client.get(run.key) is None


def test_skip_raise_and_callable_at_enqueue_and_run(locks, caplog):
    caplog.set_level(logging.INFO, logger="joblock")
    held = locks.acquire(policy(locks).lock_key((1,), {}), ttl=10)
    assert held is not None
    skipped = admit(policy(locks, UNTIL_EXECUTED), (1,), {})
    assert not skipped.send and skipped.verdict.value is None
    assert "Job already queued: Job with 1" in caplog.text
    assert Run(policy(locks), None, (1,), {}).begin().value is None
    assert "Job already running: Job with 1" in caplog.text
    with pytest.raises(LockNotAcquired):
        admit(policy(locks, UNTIL_EXECUTED, on_conflict="raise"), (1,), {})
    with pytest.raises(LockNotAcquired):
        Run(policy(locks, on_conflict="raise"), None, (1,), {}).begin()
    called = Run(policy(locks, on_conflict=lambda n: f"busy {n}"), None, (1,), {}).begin()
    assert called.value == "busy 1" and called.countdown is None


def test_reschedule_counts_attempts_then_gives_up(locks):
    held = locks.acquire(policy(locks).lock_key((1,), {}), ttl=10)
    assert held is not None
    strategy = Reschedule(delay=1, factor=2, max_delay=3, jitter=0, max_attempts=3, then="raise")
    p = policy(locks, on_conflict=strategy)
    queued = admit(policy(locks, UNTIL_EXECUTED, on_conflict=strategy), (1,), {})
    assert queued.send and queued.ticket.token is None and queued.verdict.countdown == 1
    ticket = None
    for attempt, countdown in [(1, 1), (2, 2), (3, 3)]:
        verdict = Run(p, ticket, (1,), {}).begin()
        assert (verdict.attempt, verdict.countdown) == (attempt, countdown)
        ticket = Ticket.load(Ticket(held.key, attempt=verdict.attempt).dump())
    with pytest.raises(LockNotAcquired):
        Run(p, ticket, (1,), {}).begin()
    # Where nothing can reschedule (a direct call), the strategy goes straight to `then`.
    with pytest.raises(LockNotAcquired):
        Run(p, None, (1,), {}, can_reschedule=False).begin()


def test_lock_lost_during_the_run_calls_on_expired(locks, client, caplog):
    heard = []
    p = policy(locks, on_expired=heard.append)
    run = Run(p, None, (7,), {})
    assert run.begin() is None
    with run:
        client.delete(run.key)
    assert heard == [7]
    run = Run(policy(locks), None, (7,), {})
    assert run.begin() is None
    with run:
        client.delete(run.key)
    assert "expired or was taken" in caplog.text


# -- the adapters want a Locks -------------------------------------------------------------


def test_an_asynclocks_where_a_locks_is_needed_is_refused_naming_the_argument(redis_server):
    import celery

    import joblock.rq
    from joblock.aio import AsyncLocks
    from joblock.celery import LockedTask

    made = AsyncLocks(redis_server.url)
    with pytest.raises(TypeError, match=r"^locks must be a Locks, not AsyncLocks$"):
        policy(made)
    with pytest.raises(TypeError, match=r"^locks must be a Locks, not AsyncLocks$"):
        joblock.rq.locked(made, ttl=5)(lambda: None)
    app = celery.Celery("refused", broker="memory://")

    @app.task(base=LockedTask, locks=made, lock_ttl=5)
    def task():
        return 1

    with pytest.raises(TypeError, match=r"^locks must be a Locks, not AsyncLocks$"):
        task.delay()
    late = policy(lambda: made, lifetime=UNTIL_EXECUTED)  # looked up when a lock is needed
    with pytest.raises(TypeError, match=r"^the locks function's result must be a Locks, not AsyncLocks$"):
        admit(late, (1,), {})


# -- limit: a counting lock per job key ----------------------------------------------------


def test_limit_lets_that_many_enqueued_jobs_hold_the_key_then_skips(locks, client):
    """until_executed with limit=2: two copies are sent, each with its own token; the
    third meets the lock busy; when one run ends, its place is free for the next."""
    p = policy(locks, UNTIL_EXECUTED, limit=2)
    first, second, third = (admit(p, (1,), {}) for _ in range(3))
    assert first.send and second.send and first.ticket.token != second.ticket.token
    assert not third.send and third.verdict.value is None  # skipped
    key = p.lock_key((1,), {})
    assert client.type(key) == b"zset" and client.zcard(key) == 3  # two holders and the limit
    run = Run(p, Ticket.load(first.ticket.dump()), (1,), {}, job_id="job-1")
    assert run.begin() is None and run.lease.token == first.ticket.token
    with run:
        pass
    assert admit(p, (1,), {}).send


def test_limit_at_the_run_for_while_executing(locks):
    p = policy(locks, limit=2)
    runs = [Run(p, None, (1,), {}, job_id=f"job-{n}") for n in range(3)]
    assert [run.begin() for run in runs[:2]] == [None, None]
    assert runs[2].begin().value is None  # the third is skipped while two run
    for run in runs[:2]:
        with run:
            pass
    assert runs[2].begin() is None
    with runs[2]:
        pass


def test_admit_many_counts_the_holders_of_a_key_in_one_batch(locks):
    from joblock.frameworks import admit_many

    p = policy(locks, UNTIL_EXECUTED, limit=2)
    plain = policy(locks, UNTIL_EXECUTED)
    admissions = admit_many(
        [(p, (1,), {}), (p, (1,), {}), (p, (1,), {}), (plain, (2,), {}), (plain, (2,), {})]
    )
    assert [a.send for a in admissions] == [True, True, False, True, False]


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"limit": 0}, ValueError, "lock_limit must be between 1 and"),
        ({"limit": 2.0}, TypeError, "lock_limit must be an int"),
        ({"limit": True}, TypeError, "lock_limit must be an int"),
        ({"limit": 2, "lifetime": "debounce", "debounce": 1}, ValueError, "lock_limit is for the locking"),
    ],
)
def test_bad_limits_are_refused_naming_the_option(locks, client, options, error, words):
    with pytest.raises(error, match=words):
        Policy(locks, name="Job", ttl=10, option_prefix="lock_", **options)
    assert client.keys(f"{locks.prefix}:*") == []


# -- on_lost: the run's guard --------------------------------------------------------------


def _busy(seconds=10.0):
    """Python work in small steps (an interrupt lands between them)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.001)
    raise AssertionError("the body was not stopped")


def test_the_guard_interrupts_a_body_whose_lock_is_taken_over(locks):
    run = Run(policy(locks, on_lost="interrupt"), None, (7,), {})
    assert run.begin() is None
    with pytest.raises(LockLost) as caught, run, run.guard():
        threading.Timer(0.1, testing.take_over, args=(run.lease,)).start()
        _busy()
    assert caught.value.key == run.key and caught.value.cause == "taken"


def test_an_until_executed_run_is_stopped_at_the_deadline_of_the_lock_it_adopted(locks, client):
    """The run's lease is rebuilt from the enqueue's ticket: the extend at its start gives
    it the deadline that stops it."""
    p = policy(locks, UNTIL_EXECUTED, ttl=0.4, on_lost="interrupt")
    ticket = admit(p, (7,), {}).ticket
    run = Run(p, Ticket.load(ticket.dump()), (7,), {})
    assert run.begin() is None and run.lease.token == ticket.token
    with pytest.raises(LockLost) as caught, run, run.guard():
        _busy()
    assert caught.value.cause == "deadline"


def test_a_callable_on_lost_is_given_the_jobs_arguments_and_the_body_goes_on(locks):
    heard = []
    run = Run(
        policy(locks, on_lost=lambda *args, **kwargs: heard.append((args, kwargs))), None, (7,), {"x": 1}
    )
    assert run.begin() is None
    with run, run.guard():
        testing.take_over(run.lease)
        end = time.monotonic() + 10
        while not heard and time.monotonic() < end:
            time.sleep(0.005)
    assert heard == [((7,), {"x": 1})]


def test_nothing_is_guarded_without_on_lost_or_a_lock_held_by_the_run(locks):
    for run in (Run(policy(locks), None, (1,), {}), Run(policy(locks, UNTIL_EXECUTING), None, (2,), {})):
        assert run.begin() is None
        with run, run.guard() as guard:
            assert guard is None


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        (
            {"on_lost": "nope"},
            ValueError,
            "^lock_on_lost must be 'ignore', 'interrupt', 'cancel', 'exit' or a",
        ),
        ({"on_lost": "cancel"}, ValueError, "^lock_on_lost='cancel' cancels an asyncio task"),
        ({"on_lost": b"exit"}, TypeError, "^lock_on_lost must be .* not bytes"),
        ({"on_lost": "exit", "lifetime": UNTIL_EXPIRED}, ValueError, "^lock_on_lost is for a run that holds"),
        (
            {"on_lost": "interrupt", "asynchronous": True},
            ValueError,
            "^lock_on_lost='interrupt' interrupts a",
        ),
    ],
)
def test_bad_on_lost_is_refused_naming_the_option(locks, redis_server, client, options, error, words):
    from joblock.aio import AsyncLocks

    made = AsyncLocks(redis_server.url, prefix=locks.prefix) if options.get("asynchronous") else locks
    with pytest.raises(error, match=words):
        Policy(made, name="Job", ttl=10, option_prefix="lock_", **options)
    assert client.keys(f"{locks.prefix}:*") == []
