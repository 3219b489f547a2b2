"""joblock.celery with real Celery workers (prefork pool, Redis broker) on real Redis.

One worker per core twin serves the module: the test process enqueues through Locks on
that twin (``use_locks``) and the worker runs on it too (JOBLOCK_NO_EXTENSIONS=1 for
the pure one). Tasks (tests/celery_app.py) write events to a Redis list per test run;
tests read them, the lock keys and their PTTL, and the worker's log.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import chain, chord, group
from celery.result import AsyncResult, GroupResult

import celery_app as tasks
from conftest import TWINS, locks_class
from joblock import LockNotAcquired, Locks, lost
from joblock._tools import admin
from joblock._tools.servers import RedisServer
from joblock.celery import apply_group
from workers import CountedWrites, Worker, python, wait_for, worker_env

WORKER_TWINS = [t for t in ("c", "python") if t in TWINS]
TIMEOUT = 30


def celery_worker(
    twin: str, redis_server: RedisServer, queue: str, log: Path, pool: str = "prefork"
) -> Worker:
    command = [
        python(), "-m", "celery", "-A", "celery_app", "worker", f"--pool={pool}", "--concurrency=2",
        "-Q", queue, "-n", f"{queue}@%h", "-l", "info", "--without-gossip", "--without-mingle",
        "--without-heartbeat",
    ]  # fmt: skip
    worker = Worker(command, worker_env(twin, redis_server.url), log)
    try:
        tasks.ping.apply_async(queue=queue).get(timeout=60)
    except BaseException:
        print(worker.report())
        worker.stop()
        raise
    return worker


@pytest.fixture(scope="module", params=WORKER_TWINS)
def twin(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> redis.Redis:
    tasks.configure(redis_server.url)
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture(scope="module")
def locks(twin: str, redis_server: RedisServer, client: redis.Redis) -> Iterator[Locks]:
    """The test process's Locks, on the module's twin, shared with the task module."""
    locks = locks_class(TWINS[twin])(redis_server.url, prefix=tasks.PREFIX)
    tasks.use_locks(locks)
    yield locks
    locks.close()


@pytest.fixture(scope="module")
def worker(
    twin: str, locks: Locks, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    log = tmp_path_factory.mktemp("celery") / f"worker-{twin}.log"
    worker = celery_worker(twin, redis_server, tasks.QUEUE, log)
    yield worker
    worker.stop()
    # Messages a test left behind (rescheduled, retried) must not reach the next worker.
    redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/1").flushdb()


@pytest.fixture
def run(worker: Worker) -> Iterator[str]:
    """A fresh id for the test's jobs; the worker's log of the test is shown if it fails."""
    start = len(worker.log())
    yield uuid.uuid4().hex[:10]
    print(worker.log()[start:][-8000:])


def events(client: redis.Redis, run: str) -> list[str]:
    return [e.decode() for e in client.lrange(f"events:{run}", 0, -1)]


def wait_events(
    client: redis.Redis, run: str, predicate: Callable[[list[str]], object], what: str
) -> list[str]:
    def ready() -> list[str] | None:
        found = events(client, run)
        return found if predicate(found) else None

    return wait_for(ready, TIMEOUT, what)  # type: ignore[no-any-return]


def count(items: list[str], word: str) -> int:
    return sum(1 for e in items if e.split()[0] == word)


def worker_lines(worker: Worker, run: str, text: str) -> list[str]:
    return [line for line in worker.log().splitlines() if run in line and text in line]


# -- the article's two problems ------------------------------------------------------------


def test_cleanup_runs_one_at_a_time_and_reschedules(worker, run, client):
    """CleanupDataJob: three users at once on two processes; one cleanup at a time, the
    others rescheduled (same task id) until the lock is free; all three finish."""
    # Runs of a second: time enough for a second worker, slow on a busy machine, to
    # meet the lock (at 0.3 s one worker sometimes ran all three).
    results = [tasks.cleanup_data.delay(user, run, 1) for user in (1, 2, 3)]
    assert all(isinstance(r, AsyncResult) for r in results)  # while_executing: all enqueued
    assert sorted(r.get(timeout=TIMEOUT) for r in results) == ["cleaned 1", "cleaned 2", "cleaned 3"]
    log = events(client, run)
    # Never two at once: every start is followed by its own end.
    assert len(log) == 6
    for i in range(0, 6, 2):
        assert log[i].split()[0] == "start" and log[i + 1] == "end " + log[i].split()[1]
    assert wait_for(lambda: worker_lines(worker, run, "rescheduled in"), 5, "a reschedule in the log")
    assert not client.exists(tasks.cleanup_data.joblock_key(1, run, 1))


def test_product_sales_pile_up_runs_once_per_product(worker, run, client, caplog):
    """ProductSalesJob: 100 submissions over 3 products while they pile up; until_executed
    enqueues 3 and drops 97 duplicates (logged); exactly 3 runs; then the locks are free."""
    caplog.set_level(logging.INFO, logger="joblock")
    # Runs of 2 s: the 100 calls end before the first run does, on a busy machine
    # too (at 0.5 s a run finished mid-burst and its product was sent again).
    submitted = [tasks.product_sales.delay(i % 3, run, 2) for i in range(100)]
    sent = [r for r in submitted if r is not None]
    assert len(sent) == 3
    dropped = [r for r in caplog.records if r.getMessage().startswith("Job already queued: ProductSalesJob")]
    assert len(dropped) == 97
    assert sorted(r.get(timeout=TIMEOUT) for r in sent) == ["sales 0", "sales 1", "sales 2"]
    log = events(client, run)
    assert sorted(e for e in log if e.startswith("start")) == ["start 0", "start 1", "start 2"]
    for product in range(3):
        assert not client.exists(tasks.product_sales.joblock_key(product, run, 2))
    # Freed at the end of the run: the next submission goes through.
    again = tasks.product_sales.delay(0, run, 2)
    assert again is not None and again.get(timeout=TIMEOUT) == "sales 0"


# -- lifetimes -----------------------------------------------------------------------------


def test_while_executing_locks_the_run_only(worker, run, client, locks):
    """Both duplicates are enqueued; the one that meets the running one's lock is skipped
    (logged by the worker); the lock lives for the run and goes at its end."""
    # A run of 3 s: the duplicate reaches a worker while it runs, on a busy machine too
    # (at 0.6-0.8 s the run had sometimes ended first, and the duplicate ran).
    key = tasks.while_executing.joblock_key(run, 3)
    first = tasks.while_executing.delay(run, 3)
    # Nothing taken at enqueue: if the key is already there, the worker's run took it.
    holder = client.get(key)
    assert holder is None or not holder.endswith(b":%d" % os.getpid())
    wait_events(client, run, lambda ev: count(ev, "start"), "the first run")
    token = events(client, run)[0].split()[1]
    assert client.get(key).decode() == token
    second = tasks.while_executing.delay(run, 3)
    assert second is not None
    assert second.get(timeout=TIMEOUT) is None  # skipped
    assert first.get(timeout=TIMEOUT) == "done"
    assert count(events(client, run), "start") == 1
    assert worker_lines(worker, run, "Job already running: while_executing")
    assert not client.exists(key)


def test_until_executing_frees_the_lock_when_the_run_starts(worker, run, client):
    """Taken at enqueue, held while queued (a duplicate is dropped), freed at the start."""
    key = tasks.until_executing.joblock_key(run, 0.6)
    first = tasks.until_executing.apply_async((run, 0.6), countdown=0.8)
    assert first is not None
    token = client.get(key)
    assert token is not None and client.pttl(key) > 0
    assert tasks.until_executing.delay(run, 0.6) is None  # one copy queued at a time
    wait_events(client, run, lambda ev: count(ev, "start"), "the run's start")
    assert events(client, run)[0] == "start -"  # the run holds no lock
    assert not client.exists(key)
    during = tasks.until_executing.delay(run, 0.6)  # a new copy may queue while it runs
    assert during is not None
    assert first.get(timeout=TIMEOUT) == "done" and during.get(timeout=TIMEOUT) == "done"
    assert count(events(client, run), "start") == 2


def test_until_executed_holds_from_enqueue_to_the_end_of_the_run(worker, run, client):
    key = tasks.until_executed.joblock_key(run, 0.6)
    first = tasks.until_executed.apply_async((run, 0.6), countdown=0.3)
    token = client.get(key)
    assert first is not None and token is not None
    assert tasks.until_executed.delay(run, 0.6) is None  # while queued
    wait_events(client, run, lambda ev: count(ev, "start"), "the run's start")
    # The run adopted the enqueuer's lock: same token, now its lease.
    assert events(client, run)[0] == f"start {token.decode()}"
    assert client.get(key) == token
    assert tasks.until_executed.delay(run, 0.6) is None  # while running
    assert first.get(timeout=TIMEOUT) == "done"
    assert not client.exists(key)
    assert tasks.until_executed.delay(run, 0.6) is not None
    wait_events(client, run, lambda ev: count(ev, "end") == 2, "the second run")


def test_until_expired_leaves_the_lock_to_its_ttl(worker, run, client):
    """At most one enqueue per ttl (2 s here), whether or not the job has run."""
    key = tasks.until_expired.joblock_key(run, 0)
    first = tasks.until_expired.delay(run, 0)
    assert first is not None and first.get(timeout=TIMEOUT) == "done"
    assert events(client, run) == ["start -", "end"]
    assert 0 < client.pttl(key) <= 2000  # the run left it
    assert tasks.until_expired.delay(run, 0) is None
    wait_for(lambda: not client.exists(key), 5, "the lock's expiry")
    again = tasks.until_expired.delay(run, 0)
    assert again is not None and again.get(timeout=TIMEOUT) == "done"


def test_signatures_and_apply_async_take_the_same_lock(worker, run, client):
    """The enqueue lock does not depend on how the task is sent."""
    key = tasks.until_executed.joblock_key(run, 0.5)
    signature = tasks.until_executed.s(run, 0.5)
    first = signature.apply_async(countdown=0.2)
    assert first is not None and client.exists(key)
    assert signature.delay() is None
    assert tasks.until_executed.signature((run, 0.5)).apply_async() is None
    assert tasks.until_executed.apply_async(args=(run,), kwargs={"seconds": 0.5}) is None  # same key
    assert tasks.until_executed.apply_async((run, 0.25)) is not None  # other arguments, other lock
    assert first.get(timeout=TIMEOUT) == "done"
    assert not client.exists(key)


def test_a_direct_call_runs_under_the_lock(locks, client):
    """Calling the task as a function (no worker, no message) still locks the run."""
    run = uuid.uuid4().hex[:10]
    assert tasks.while_executing(run, 0) == "done"
    token = events(client, run)[0].split()[1]
    assert token != "-"
    with locks.lock(tasks.while_executing.joblock_key(run, 0), ttl=10):
        assert tasks.while_executing(run, 0) is None  # skipped
    assert count(events(client, run), "start") == 1


# -- conflict strategies -------------------------------------------------------------------


def test_raise_at_run_fails_the_task(worker, run, client, locks):
    with locks.lock(tasks.raising.joblock_key(run, 0), ttl=30):
        result = tasks.raising.delay(run, 0)
        with pytest.raises(Exception) as info:
            result.get(timeout=TIMEOUT)
    assert type(info.value).__name__ == "LockNotAcquired"
    assert result.state == "FAILURE"
    assert events(client, run) == []


def test_raise_at_enqueue(worker, run, client, locks):
    with locks.lock(tasks.unique_raising.joblock_key(run, 0), ttl=30), pytest.raises(LockNotAcquired):
        tasks.unique_raising.delay(run, 0)


def test_callable_decides_and_its_value_is_the_result(worker, run, client, locks):
    with locks.lock(tasks.calling.joblock_key(run, 0), ttl=30):
        assert tasks.calling.delay(run, 0).get(timeout=TIMEOUT) == f"busy {run}"
    assert events(client, run) == ["busy"]


CAPPED = re.compile(r"rescheduled in ([0-9.]+) s \(attempt (\d) of 3\)")


@pytest.mark.parametrize("then", ["skip", "raise"])
def test_reschedule_backs_off_then_gives_up(worker, run, client, locks, then):
    """Reschedule(delay=0.2, factor=2, max_delay=0.5, jitter=0.5, max_attempts=3): three
    reschedules of the same task id at 0.1-0.2, 0.2-0.4 and 0.25-0.5 s, then skip or raise."""
    task = tasks.capped_skip if then == "skip" else tasks.capped_raise
    with locks.lock(task.joblock_key(run, 0), ttl=30):
        result = task.delay(run, 0)
        if then == "skip":
            assert result.get(timeout=TIMEOUT) is None
        else:
            with pytest.raises(Exception) as info:
                result.get(timeout=TIMEOUT)
            assert type(info.value).__name__ == "LockNotAcquired"
    assert events(client, run) == []  # the body never ran
    lines = worker_lines(worker, run, "rescheduled in")
    found = [CAPPED.search(line) for line in lines]
    attempts = [(float(m.group(1)), int(m.group(2))) for m in found if m]
    assert [a for _, a in attempts] == [1, 2, 3]
    for (countdown, _), base in zip(attempts, (0.2, 0.4, 0.5)):
        assert base / 2 <= countdown <= base
    assert worker_lines(worker, run, "lock still busy after 3 reschedules")


def test_reschedule_at_enqueue_runs_once_the_lock_is_free(worker, run, client, locks):
    """until_executed with reschedule: a duplicate is sent later instead of dropped; it
    takes the lock when it starts."""
    key = tasks.queued_reschedule.joblock_key(run, 0)
    held = locks.acquire(key, ttl=30)
    result = tasks.queued_reschedule.delay(run, 0)
    assert result is not None
    time.sleep(0.5)
    assert events(client, run) == []
    assert held.release()
    assert result.get(timeout=TIMEOUT) == "done"
    assert events(client, run)[0] != "start -"  # it held the lock it took at its start
    assert not client.exists(key)


# -- groups and bursts --------------------------------------------------------------------


def test_apply_group_takes_its_locks_in_one_write(worker, run, client, locks, caplog):
    """A group of 20 GatedJobs over 5 items (a nested group among them), one whose lock
    someone holds, one that reschedules, a while_executing task and a chain: the
    members' enqueue locks (all of a 30 s ttl: one batch per ttl) in one write to
    Redis, one message per free item (the duplicates left out, logged), each run
    adopting its lock."""
    caplog.set_level(logging.INFO, logger="joblock")
    keys = [tasks.gated.joblock_key(f"p{n}", run) for n in range(5)]
    held = locks.acquire(tasks.gated.joblock_key("p5", run), ttl=30)
    waiting = locks.acquire(tasks.queued_reschedule.joblock_key(f"{run}-r", 0), ttl=30)
    members = [tasks.gated.s(f"p{i % 5}", run) for i in range(15)]
    members.append(group(tasks.gated.s(f"p{i % 5}", run) for i in range(15, 20)))
    members += [tasks.gated.s("p5", run), tasks.queued_reschedule.s(f"{run}-r", 0)]
    members += [tasks.while_executing.s(f"{run}-w", 0), chain(tasks.ping.s(), tasks.ping.si())]
    try:
        with CountedWrites(locks) as counted:
            result = apply_group(group(members))
        assert counted.writes == 1
        assert isinstance(result, GroupResult) and len(result.results) == 8
        dropped = [r for r in caplog.records if r.getMessage().startswith("Job already queued: GatedJob")]
        assert len(dropped) == 16
        assert all(client.mget(keys))  # the runs wait for the gate, holding their locks
    finally:
        client.set(tasks.gate(run), 1)
    assert held.release() and waiting.release()
    assert result.get(timeout=TIMEOUT) == [f"p{n}" for n in range(5)] + ["done", "done", "pong"]
    assert sorted(events(client, run)) == [f"run p{n}" for n in range(5)]
    assert events(client, f"{run}-r")[0] != "start -"  # rescheduled, it took its lock when it ran
    assert client.exists(*keys) == 0


def test_apply_group_raising_frees_the_batch_and_sends_nothing(worker, run, client, locks, redis_server):
    """A member whose strategy raises: no message goes out (to a queue no worker reads,
    where any would stay) and none of the batch's locks stays taken."""
    keys = [tasks.until_executed.joblock_key(run, n) for n in range(3)]
    members = [tasks.until_executed.s(run, n) for n in range(3)] + [tasks.unique_raising.s(run, 0)]
    queue = f"nobody-{run}"
    broker = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/1")
    with locks.lock(tasks.unique_raising.joblock_key(run, 0), ttl=30), pytest.raises(LockNotAcquired):
        apply_group(group(members), queue=queue)
    assert client.exists(*keys) == 0
    assert broker.llen(queue) == 0
    # The same group with the lock free: its four messages wait in that queue.
    result = apply_group(group(members), queue=queue)
    assert len(result.results) == 4 and broker.llen(queue) == 4
    assert client.exists(*keys) == 3
    broker.delete(queue)
    client.delete(*keys, tasks.unique_raising.joblock_key(run, 0))
    broker.close()


def test_apply_group_leaves_a_chords_dropped_members_out_before_it_counts_them(worker, run, client, locks):
    """A chord whose header repeats arguments and has one whose lock is held: the
    header's locks in one write, the body run with the results of the members sent
    (with chord.apply_async it would wait forever for the dropped ones)."""
    with locks.lock(tasks.until_executed.joblock_key(f"{run}-held", 0), ttl=30):
        header = [tasks.until_executed.s(f"{run}-{n % 2}", 0) for n in range(4)]
        header.append(tasks.until_executed.s(f"{run}-held", 0))
        with CountedWrites(locks) as counted:
            result = apply_group(chord(header, tasks.collect.s()))
        assert counted.writes == 1
        assert result.get(timeout=TIMEOUT) == ["done", "done"]
    assert events(client, f"{run}-0")[0].split()[0] == "start"
    assert client.exists(*(tasks.until_executed.joblock_key(f"{run}-{n}", 0) for n in range(2))) == 0


THREADS = 6


def test_a_burst_from_threads_runs_each_argument_set_once(worker, run, client):
    """Six threads send the same ten items and two of their own each, in their own
    order, half one by one (delay) and half as a group (apply_group), all at once:
    exactly one message per item goes out and runs (until_executed; the runs wait
    until the burst is out)."""
    shared = [f"s{n}" for n in range(10)]
    start = threading.Barrier(THREADS)
    sent: list[list[AsyncResult]] = [[] for _ in range(THREADS)]
    tried = [0] * THREADS

    def burst(t: int) -> None:
        items = shared + [f"t{t}-{n}" for n in range(2)]
        random.Random(t).shuffle(items)
        tried[t] = len(items)
        start.wait(10)
        if t % 2:
            sent[t] = [r for r in (tasks.gated.delay(item, run) for item in items) if r is not None]
        else:
            sent[t] = apply_group(group(tasks.gated.s(item, run) for item in items)).results

    threads = [threading.Thread(target=burst, args=(t,)) for t in range(THREADS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        client.set(tasks.gate(run), 1)
    results = [r for each in sent for r in each]
    everything = shared + [f"t{t}-{n}" for t in range(THREADS) for n in range(2)]
    assert sum(tried) == THREADS * 12
    assert sorted(r.get(timeout=TIMEOUT) for r in results) == sorted(everything)
    runs = collections.Counter(e.split()[1] for e in events(client, run))
    assert runs == collections.Counter(everything)


# -- retries and crashes -------------------------------------------------------------------


def test_retry_keeps_its_lock(worker, run, client):
    """self.retry() takes the lease along: the retried run adopts the same token, a
    duplicate enqueued in between is dropped, and the lock goes after the final run."""
    key = tasks.retrying.joblock_key(run, 1.0)
    result = tasks.retrying.delay(run, 1.0)
    first = wait_events(client, run, lambda ev: ev, "the first try")[0].split()
    assert first[:3] == ["try", "0", client.get(key).decode()]
    assert tasks.retrying.delay(run, 1.0) is None  # between the tries: still locked
    assert client.get(key).decode() == first[2]
    assert result.get(timeout=TIMEOUT) == "retried"
    assert events(client, run) == [f"try 0 {first[2]}", f"try 1 {first[2]}"]
    assert not client.exists(key)


def test_killed_worker_lock_frees_at_its_ttl(twin, run, client, locks, redis_server, tmp_path):
    """SIGKILL to the worker's process group mid-job: nothing frees the lock, so it stays
    with the dead run's token until its ttl (3 s) and not a moment less."""
    queue = f"joblock-kill-{run}"
    worker = celery_worker(twin, redis_server, queue, tmp_path / "worker.log")
    try:
        key = tasks.sleeper.joblock_key(run)
        tasks.sleeper.apply_async((run,), queue=queue)
        token = wait_events(client, run, lambda ev: ev, "the job's start")[0].split()[1]
        worker.kill_and_watch_the_lock(client, key, token, ttl=3)
    finally:
        print(worker.report())
        worker.stop()


# -- debounce ------------------------------------------------------------------------------


def test_a_debounced_burst_runs_once_with_the_last_arguments(worker, run, client):
    """Five enqueues within the window: each supersedes the one before; the worker runs the
    last one's revision once and drops the other four (logged), their results None."""
    results = [tasks.debounced.delay(run, rev) for rev in range(5)]
    assert [r.get(timeout=TIMEOUT) for r in results] == [None, None, None, None, 4]
    assert events(client, run) == ["run 4"]
    superseded = [f"Job superseded: debounced with '{run}', {rev} " for rev in range(4)]
    wait_for(lambda: all(worker_lines(worker, run, line) for line in superseded), 5, "the superseded lines")
    # An enqueue after the run starts a new burst, run on its own.
    assert tasks.debounced.delay(run, 5).get(timeout=TIMEOUT) == 5
    assert events(client, run) == ["run 4", "run 5"]


def test_debounce_max_runs_a_steady_stream(worker, run, client):
    """Enqueues every 50 ms, far inside the 1 s window, would postpone the run for as long
    as they come: lock_debounce_max runs the burst while the stream goes on, with the
    revision pending then; the next enqueue starts a burst of its own."""
    sent = []
    deadline = time.monotonic() + TIMEOUT
    while not events(client, run):
        assert time.monotonic() < deadline, "no run while the stream went on"
        sent.append(tasks.capped.delay(run, len(sent)))
        time.sleep(0.05)
    results = [r.get(timeout=TIMEOUT) for r in sent]
    # One more run when an enqueue came between the capped run's start and its event.
    ran = [int(e.split()[1]) for e in events(client, run)]
    assert results == [rev if rev in ran else None for rev in range(len(sent))]
    assert ran[-1] == len(sent) - 1 and len(ran) <= 2 < len(sent)
    assert tasks.capped.delay(run, len(sent)).get(timeout=TIMEOUT) == len(sent)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"lock_lifetime": "debounce"}, "lock_lifetime='debounce' needs lock_debounce"),
        ({"lock_lifetime": "debounce", "lock_debounce": -1}, "lock_debounce must be a finite number"),
        (
            {"lock_lifetime": "debounce", "lock_debounce": 2, "lock_debounce_max": 1},
            r"lock_debounce_max \(1\) must be at least lock_debounce \(2\)",
        ),
        ({"lock_debounce": 2}, "lock_debounce is for lock_lifetime='debounce', not 'while_executing'"),
    ],
)
def test_bad_debounce_options_raise_at_send_and_send_nothing(worker, client, options, words):
    name = f"bad_debounce_{uuid.uuid4().hex[:8]}"

    @tasks.app.task(base=tasks.ShopTask, name=name, **options)
    def bad(run: str, rev: int) -> None:
        raise AssertionError("never sent")

    # A queue no worker reads: a message sent there would stay.
    broker = redis.Redis.from_url(tasks.app.conf.broker_url)
    with pytest.raises(ValueError, match=words):
        bad.apply_async(("r", 1), queue=name)
    assert not broker.exists(name)
    assert client.keys(f"{tasks.PREFIX}:{name}*") == []


# -- a lost lock stops the task ------------------------------------------------------------


def test_an_operators_release_stops_the_running_task(worker, run, client, redis_server):
    """lock_on_lost="exit" on the prefork pool: an operator releases the lock of a running
    task (``joblock release``); the child exits with EXIT_STATUS after saying why, its work
    stopped (the task's "end" never comes), Celery fails the task with WorkerLostError and
    starts a new child: the worker goes on."""
    key = tasks.exits.joblock_key(run)
    result = tasks.exits.delay(run)
    token = wait_events(client, run, lambda ev: ev, "the task's start")[0].split()[1]
    assert client.get(key).decode() == token
    assert admin.release(redis_server.url, key) == 0
    with pytest.raises(Exception) as info:
        result.get(timeout=TIMEOUT)
    assert type(info.value).__name__ == "WorkerLostError"
    assert f"exitcode {lost.EXIT_STATUS}" in str(info.value)
    assert events(client, run) == [f"start {token}"]
    said = f"joblock lost the lock {key!r} (an operator released it): exiting with status 75"
    assert said in worker.log()
    assert worker.alive()
    assert [tasks.ping.delay().get(timeout=TIMEOUT) for _ in range(3)] == ["pong"] * 3


def test_an_operators_release_interrupts_a_task_of_the_threads_pool(
    twin, run, client, redis_server, tmp_path
):
    """lock_on_lost="interrupt" on the threads pool: LockLost is raised in the thread
    running the task once an operator releases its lock; its work stops and the task
    fails with LockLost, the worker going on."""
    queue = f"joblock-threads-{run}"
    worker = celery_worker(twin, redis_server, queue, tmp_path / "worker.log", pool="threads")
    try:
        key = tasks.interrupted.joblock_key(run)
        result = tasks.interrupted.apply_async((run,), queue=queue)
        token = wait_events(client, run, lambda ev: ev, "the task's start")[0].split()[1]
        assert admin.release(redis_server.url, key) == 0
        with pytest.raises(Exception) as info:
            result.get(timeout=TIMEOUT)
        # Celery's JSON results rebuild an exception from its message alone, which
        # LockLost(key, cause) does not take: the error comes back as an Exception naming it.
        assert "LockLost" in f"{type(info.value).__name__} {info.value}"
        assert "an operator released it" in str(info.value) and result.state == "FAILURE"
        assert events(client, run) == [f"start {token}"]
        assert f"joblock lost the lock {key!r}: an operator released it" in worker.log()
        assert worker.alive() and tasks.ping.apply_async(queue=queue).get(timeout=TIMEOUT) == "pong"
    finally:
        print(worker.report())
        worker.stop()


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        (
            {"lock_on_lost": "nope"},
            ValueError,
            "lock_on_lost must be 'ignore', 'interrupt', 'cancel', 'exit'",
        ),
        ({"lock_on_lost": "cancel"}, ValueError, "lock_on_lost='cancel' cancels an asyncio task"),
        ({"lock_on_lost": 3}, TypeError, "lock_on_lost must be"),
        (
            {"lock_on_lost": "exit", "lock_lifetime": "until_expired"},
            ValueError,
            "lock_on_lost is for a run that holds its lock",
        ),
    ],
)
def test_a_bad_lock_on_lost_is_refused_when_the_task_is_made(worker, client, options, error, words):
    """Celery makes each task a subclass of its base: the option is checked then, before
    the task is registered (a lazy task is made when the app is finalized: a worker with
    such a task does not start). Not shared nor lazy here, so that no other app of the
    test process meets it."""
    name = f"bad_on_lost_{uuid.uuid4().hex[:8]}"

    def bad(run: str) -> None:
        raise AssertionError("never made")

    with pytest.raises(error, match=re.escape(words)):
        tasks.app.task(base=tasks.ShopTask, name=name, shared=False, lazy=False, **options)(bad)
    assert name not in tasks.app.tasks
    assert client.keys(f"{tasks.PREFIX}:{name}*") == []
    with pytest.raises(error, match=re.escape(words)):
        type("BadBase", (tasks.ShopTask,), dict(options))  # a base of the shop's own
