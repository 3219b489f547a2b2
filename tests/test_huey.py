"""joblock.huey with real Huey consumers (``huey_consumer``, process and thread workers) on RedisHuey.

The module runs once per (core twin, worker type) pair: a consumer of 3 workers of that
type on that twin (JOBLOCK_NO_EXTENSIONS=1 for the pure one), and the test process
enqueueing through Locks on the same twin. Tasks (tests/huey_app.py) write events to a
Redis list per test run; tests read them, the lock keys and their PTTL, the tasks'
results and the consumer's log.
"""

from __future__ import annotations

import collections
import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from huey import MemoryHuey, RedisHuey, chord, crontab, group
from huey.exceptions import TaskException

import joblock
from conftest import TWINS, locks_class
from joblock import LockNotAcquired, Locks
from joblock._tools import admin
from joblock._tools.servers import RedisServer
from joblock.aio import AsyncLocks
from joblock.frameworks import TICKET
from joblock.huey import TaskLocks
from workers import (
    CountedWrites,
    Worker,
    events,
    import_app,
    most_at_once,
    python,
    starts,
    wait_events,
    wait_for,
    wait_free,
    worker_env,
)

if "c" in TWINS:
    PAIRS = [("c", "process"), ("python", "thread")]
else:
    PAIRS = [("python", "process"), ("python", "thread")]
TIMEOUT = 30


def huey_consumer(twin: str, worker_type: str, redis_server: RedisServer, instance: str, log: Path) -> Worker:
    command = [python(), "-m", "huey.bin.huey_consumer", f"huey_app.{instance}", "-w", "3", "-k", worker_type]
    env = worker_env(twin, redis_server.url)
    env["JOBLOCK_TEST_CONSUMER"] = "1"
    return Worker(command, env, log)


@pytest.fixture(scope="module")
def app(redis_server: RedisServer) -> Iterator[ModuleType]:
    """tests/huey_app.py, whose Huey instances read the suite's Redis from the environment."""
    module = import_app("huey_app", redis_server.url)
    yield module
    module.huey.flush()


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{t}-{w}" for t, w in PAIRS])
def pair(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture(scope="module")
def locks(pair: tuple[str, str], app: ModuleType, redis_server: RedisServer) -> Iterator[Locks]:
    locks = locks_class(TWINS[pair[0]])(redis_server.url, prefix=app.PREFIX)
    app.use_locks(locks)
    yield locks
    locks.close()


@pytest.fixture(scope="module")
def consumer(
    pair: tuple[str, str],
    app: ModuleType,
    locks: Locks,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Worker]:
    twin, worker_type = pair
    log = tmp_path_factory.mktemp(f"huey-{twin}-{worker_type}") / "consumer.log"
    started = huey_consumer(twin, worker_type, redis_server, "huey", log)
    try:
        # The consumer runs the twin under test ("python" for either pure one).
        assert app.ping().get(blocking=True, timeout=60) == ("c" if twin == "c" else "python")
        yield started
    finally:
        started.stop()
        # Nothing a test left queued or scheduled reaches the next pair's consumer.
        app.huey.flush()


@pytest.fixture
def run(consumer: Worker) -> Iterator[str]:
    """A fresh id for the test's tasks; the consumer's log of the test is shown if it fails."""
    start = len(consumer.log())
    yield uuid.uuid4().hex[:10]
    print(consumer.log()[start:][-6000:])


def lines(consumer: Worker, text: str, run: str) -> list[str]:
    return [line for line in consumer.log().splitlines() if text in line and run in line]


def result(sent: Any) -> Any:
    return sent.get(blocking=True, timeout=TIMEOUT)


# -- the article's two problems ------------------------------------------------------------


def test_cleanup_runs_one_at_a_time_and_reschedules(app, run, client, consumer):
    """CleanupDataJob on 3 workers: one cleanup at a time; a task meeting the lock comes
    back later under its own id (Huey's RetryTask) until it can run, and its result is
    that run's."""
    # Runs of a second: time enough for a second worker, slow on a busy machine, to
    # meet the lock (at 0.3 s one worker sometimes ran all three).
    sent = [app.cleanup_data(user, run, 1) for user in (1, 2, 3)]
    assert [result(r) for r in sent] == ["cleaned 1", "cleaned 2", "cleaned 3"]
    log = events(client, run)
    assert sorted(log) == sorted(f"{e} {u}" for u in (1, 2, 3) for e in ("start", "end"))
    for i in range(0, 6, 2):
        assert log[i].split()[0] == "start" and log[i + 1] == "end " + log[i].split()[1]
    assert lines(consumer, "rescheduled in", run)
    wait_free(client, app.tasks.lock_key(app.cleanup_data, 1, run, 1))


def test_product_sales_pile_up_runs_once_per_product(app, run, client, caplog):
    """ProductSalesJob: 100 calls over 3 products; until_executed enqueues 3 and drops 97
    duplicates (logged, the call returning None); exactly 3 runs; the locks are free afterwards."""
    caplog.set_level(logging.INFO, logger="joblock")
    # Runs of 2 s: the 100 calls end before the first run does, on a busy machine
    # too (at 0.5 s a run finished mid-burst and its product was sent again).
    submitted = [app.product_sales(i % 3, run, 2) for i in range(100)]
    sent = [r for r in submitted if r is not None]
    assert len(sent) == 3
    dropped = [r for r in caplog.records if r.getMessage().startswith("Job already queued: ProductSalesJob")]
    assert len(dropped) == 97
    assert sorted(result(r) for r in sent) == ["sales 0", "sales 1", "sales 2"]
    assert sorted(e for e in events(client, run) if e.startswith("start")) == [f"start {p}" for p in range(3)]
    for product in range(3):
        wait_free(client, app.tasks.lock_key(app.product_sales, product, run, 2))
    assert result(app.product_sales(0, run, 2)) == "sales 0"


# -- lifetimes -----------------------------------------------------------------------------


def test_while_executing_locks_the_run_only(app, run, client, consumer):
    key = app.tasks.lock_key(app.while_executing, run, 0.8)
    first = app.while_executing(run, 0.8)
    token = wait_events(client, run, 1, "the first run")[0].split()[1]
    assert client.get(key).decode() == token
    second = app.while_executing(run, 0.8)
    assert second is not None  # nothing taken at enqueue
    assert result(second) is None  # skipped at the consumer
    assert lines(consumer, "Job already running: while_executing", run)
    assert result(first) == "done"
    assert starts(events(client, run)) == 1
    wait_free(client, key)


def test_until_executing_frees_the_lock_when_the_run_starts(app, run, client):
    key = app.tasks.lock_key(app.until_executing, run, 0.8)
    first = app.until_executing.schedule((run, 0.8), delay=1)
    assert client.pttl(key) > 0
    assert app.until_executing(run, 0.8) is None  # one copy queued at a time
    assert wait_events(client, run, 1, "the run's start")[0] == "start -"
    assert not client.exists(key)
    during = app.until_executing(run, 0.8)  # while it runs
    assert result(first) == "done" and result(during) == "done"
    assert starts(events(client, run)) == 2


def test_until_executed_holds_from_enqueue_to_the_end_of_the_run(app, run, client):
    """The ticket travels in the task's keyword arguments; the run adopts its lock."""
    key = app.tasks.lock_key(app.until_executed, run, 0.8)
    first = app.until_executed.schedule((run, 0.8), delay=1)
    token = client.get(key)
    assert first.task.kwargs[TICKET]["token"].encode("latin-1") == token
    assert app.until_executed(run, 0.8) is None  # while queued
    assert wait_events(client, run, 1, "the run's start")[0] == f"start {token.decode()}"
    assert client.get(key) == token
    assert app.until_executed(run, 0.8) is None  # while running
    assert result(first) == "done"
    wait_free(client, key)
    assert result(app.until_executed(run, 0.8)) == "done"


def test_until_expired_leaves_the_lock_to_its_ttl(app, run, client):
    key = app.tasks.lock_key(app.until_expired, run, 0)
    assert result(app.until_expired(run, 0)) == "done"
    assert events(client, run) == ["start -", "end"]
    assert 0 < client.pttl(key) <= 2000
    assert app.until_expired(run, 0) is None
    wait_free(client, key)
    assert result(app.until_expired(run, 0)) == "done"


# -- conflict strategies -------------------------------------------------------------------


def test_raise_at_the_consumer_fails_the_task(app, run, client, locks):
    with locks.lock(app.tasks.lock_key(app.raising, run, 0), ttl=30):
        sent = app.raising(run, 0)
        with pytest.raises(TaskException, match="LockNotAcquired"):
            result(sent)
    assert events(client, run) == []


def test_raise_at_enqueue(app, run, locks):
    with locks.lock(app.tasks.lock_key(app.unique_raising, run, 0), ttl=30), pytest.raises(LockNotAcquired):
        app.unique_raising(run, 0)


def test_a_callable_decides_and_its_value_is_the_result(app, run, client, locks):
    with locks.lock(app.tasks.lock_key(app.calling, run, 0), ttl=30):
        assert result(app.calling(run, 0)) == "busy"
    assert events(client, run) == ["busy"]


CAPPED = re.compile(r"Job locked: (capped_\w+) .*rescheduled in ([0-9.]+) s \(attempt (\d) of 3\)")


def test_reschedule_backs_off_then_gives_up(app, run, client, locks, consumer):
    """Reschedule(delay=0.2, factor=2, max_delay=0.5, jitter=0.5, max_attempts=3): the task
    comes back 0.1-0.2, 0.2-0.4 and 0.25-0.5 s later, then is skipped (its result None)
    or fails (LockNotAcquired), both under the id it was enqueued with."""
    keys = [app.tasks.lock_key(task, run, 0) for task in (app.capped_skip, app.capped_raise)]
    held = [locks.acquire(key, ttl=30) for key in keys]
    try:
        skipped, raised = app.capped_skip(run, 0), app.capped_raise(run, 0)
        assert result(skipped) is None
        with pytest.raises(TaskException, match="LockNotAcquired"):
            result(raised)
    finally:
        for lease in held:
            lease.release()
    assert events(client, run) == []
    found = [CAPPED.search(line) for line in lines(consumer, "rescheduled in", run)]
    for name in ("capped_skip", "capped_raise"):
        attempts = sorted((int(m[3]), float(m[2])) for m in found if m and m[1] == name)
        assert [a for a, _ in attempts] == [1, 2, 3]
        for (_, countdown), base in zip(attempts, (0.2, 0.4, 0.5)):
            assert base / 2 <= countdown <= base
    assert len(lines(consumer, "lock still busy after 3 reschedules", run)) == 2


def test_reschedule_at_enqueue_runs_once_the_lock_is_free(app, run, client, locks):
    """Enqueued with its eta set to the backoff, without a token: it takes the lock when it runs."""
    key = app.tasks.lock_key(app.queued_reschedule, run, 0)
    held = locks.acquire(key, ttl=30)
    sent = app.queued_reschedule(run, 0)
    assert sent is not None and "token" not in sent.task.kwargs[TICKET]
    time.sleep(0.5)
    assert events(client, run) == []
    assert held.release()
    assert result(sent) == "done"
    assert events(client, run)[0] != "start -"
    wait_free(client, key)


# -- groups and bursts ---------------------------------------------------------------------


def test_a_group_takes_its_locks_in_one_write(app, run, client, locks, caplog):
    """20 GatedJobs over 5 items and one whose lock someone holds, as a Huey group: every
    lock in one write to Redis, one task per free item (the others left out, logged),
    each holding its lock until its run ends."""
    caplog.set_level(logging.INFO, logger="joblock")
    keys = [app.tasks.lock_key(app.gated, f"p{n}", run) for n in range(5)]
    held = locks.acquire(app.tasks.lock_key(app.gated, "p5", run), ttl=30)
    members = [app.gated.s(f"p{i % 5}", run) for i in range(20)] + [app.gated.s("p5", run)]
    try:
        with CountedWrites(locks) as counted:
            sent = app.huey.enqueue(group(members))
        assert counted.writes == 1
        assert [r.id for r in sent] == [m.id for m in members[:5]]
        dropped = [r for r in caplog.records if r.getMessage().startswith("Job already queued: GatedJob")]
        assert len(dropped) == 16
        # The runs wait for the gate: each lock still holds its task's ticket.
        assert client.mget(keys) == [r.task.kwargs[TICKET]["token"].encode("latin-1") for r in sent]
    finally:
        client.set(app.gate(run), 1)
    assert sent.get(blocking=True, timeout=TIMEOUT) == [f"p{n}" for n in range(5)]
    assert sorted(events(client, run)) == [f"run p{n}" for n in range(5)]
    wait_for(lambda: client.exists(*keys) == 0, TIMEOUT, "the group's locks to be freed")
    assert held.release()


def test_a_chord_leaves_out_its_duplicates_before_it_counts_them(app, run, client):
    """A chord of three members, one a duplicate: its callback gets the two results."""
    client.set(app.gate(run), 1)
    members = [app.gated.s(item, run) for item in ("a", "b", "a")]
    assert result(app.huey.enqueue(chord(members, app.collect.s()))) == ["a", "b"]
    assert sorted(events(client, run)) == ["run a", "run b"]


THREADS = 6


def test_a_burst_from_threads_runs_each_argument_set_once(app, run, client):
    """Six threads enqueue the same ten items and two of their own each, in their own
    order, half one by one and half as a group, all at once: exactly one task per item is
    enqueued and runs (until_executed; the runs wait until the burst is out)."""
    shared = [f"s{n}" for n in range(10)]
    start = threading.Barrier(THREADS)
    sent: list[list[Any]] = [[] for _ in range(THREADS)]

    def burst(t: int) -> None:
        items = shared + [f"t{t}-{n}" for n in range(2)]
        random.Random(t).shuffle(items)
        start.wait(10)
        if t % 2:
            sent[t] = [r for r in (app.gated(item, run) for item in items) if r is not None]
        else:
            sent[t] = list(app.huey.enqueue(group([app.gated.s(item, run) for item in items])))

    threads = [threading.Thread(target=burst, args=(t,)) for t in range(THREADS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        client.set(app.gate(run), 1)
    everything = shared + [f"t{t}-{n}" for t in range(THREADS) for n in range(2)]
    enqueued = [r for each in sent for r in each]
    assert sorted(result(r) for r in enqueued) == sorted(everything)
    runs = collections.Counter(e.split()[1] for e in events(client, run))
    assert runs == collections.Counter(everything)


# -- retries, crashes, periodic tasks ------------------------------------------------------


def test_retry_keeps_its_lock(app, run, client, consumer):
    """A task that fails with retries left keeps its lock through retry_delay: the retried
    run (the same task id) adopts the same token, a duplicate run in between is skipped,
    and the lock goes after the final run."""
    key = app.tasks.lock_key(app.retrying, run)
    sent = app.retrying(run)
    token = wait_events(client, run, 1, "the first try")[0].split()[2]
    wait_for(lambda: lines(consumer, f"Requeueing {sent.id}", ""), TIMEOUT, "the retry")
    with pytest.raises(TaskException, match="first try fails"):
        result(sent)  # Huey stores the first try's error, and the retry's result later
    sent.reset()
    duplicate = app.retrying(run)
    assert result(duplicate) is None
    assert lines(consumer, "Job already running: retrying", run)
    while len(events(client, run)) < 2:
        held = client.get(key)
        # Read after the lock: a lock gone only because the retry ended shows its events.
        if len(events(client, run)) >= 2:
            break
        assert held == token.encode(), f"the lock went between the tries: {events(client, run)}"
        time.sleep(0.02)
    assert result(sent) == "retried"
    assert events(client, run) == [f"try 0 {token} {sent.id}", f"try 1 {token} {sent.id}"]
    wait_free(client, key)


def test_killed_consumer_lock_frees_at_its_ttl(app, pair, run, client, redis_server, tmp_path):
    """SIGKILL to the consumer's process group (consumer and workers) mid-run: the lock
    stays with the dead run's token until its ttl (3 s), never less."""
    twin, worker_type = pair
    killed = huey_consumer(twin, worker_type, redis_server, "kill_huey", tmp_path / "consumer.log")
    try:
        key = app.kill_tasks.lock_key(app.sleeper, run)
        app.sleeper(run)
        token = wait_events(client, run, 1, "the run's start")[0].split()[1]
        killed.kill_and_watch_the_lock(client, key, token, ttl=3)
    finally:
        print(killed.report())
        killed.stop()
        app.kill_huey.flush()


def test_a_periodic_task_is_admitted_as_any_enqueue(app, run, client):
    """until_executed on a periodic task: a run enqueued while one is queued is dropped."""
    first = app.huey.enqueue(app.nightly.s(run))
    assert app.huey.enqueue(app.nightly.s(run)) is None
    client.set(app.gate(run), 1)  # the first runs only now (see nightly)
    token = first.task.kwargs[TICKET]["token"]
    assert wait_events(client, run, 1, "the periodic run") == [f"run {token}"]
    wait_free(client, app.tasks.lock_key(app.nightly, run))


# -- debounce and limit --------------------------------------------------------------------


def test_a_debounced_burst_runs_once_with_the_last_arguments(app, run, client, consumer):
    """Five enqueues within the window: each is enqueued with an eta and supersedes the one
    before; the last one runs, the four others finish without running (result None)."""
    sent = [app.debounced(run, rev) for rev in range(5)]
    assert all(r is not None and r.task.eta is not None for r in sent)
    assert [result(r) for r in sent] == [None, None, None, None, 4]
    assert events(client, run) == ["run 4"]
    wait_for(lambda: len(lines(consumer, "Job superseded", run)) == 4, TIMEOUT, "the superseded lines")
    assert result(app.debounced(run, 5)) == 5  # a new burst
    assert events(client, run) == ["run 4", "run 5"]


def test_limit_sends_that_many_copies_of_a_key_and_runs_them_at_once(app, run, client):
    """until_executed with lock_limit=2: of a burst of five enqueues (one by one, then as a
    group) two are sent, each holding a place of the counting lock until its run ends."""
    key = app.tasks.lock_key(app.limited, run, 1.0)
    sent = [app.limited(run, 1.0) for _ in range(5)]
    assert [r is not None for r in sent] == [True, True, False, False, False]
    assert client.zcard(key) == 3  # two holders and the limit
    assert [result(r) for r in sent[:2]] == ["done", "done"]
    happened = events(client, run)
    assert starts(happened) == 2 and most_at_once(happened) <= 2
    wait_free(client, key)
    batch = app.huey.enqueue(group([app.limited.s(run, 0.1) for _ in range(5)]))
    assert len(batch) == 2 and batch.get(blocking=True, timeout=TIMEOUT) == ["done", "done"]


# -- settings ------------------------------------------------------------------------------


def test_enqueue_raises_when_the_locks_redis_is_unreachable(pair, redis_server, down_url):
    """Not enqueued: Huey's queue stays empty; a task without a lock is enqueued as ever."""
    huey = RedisHuey(f"joblock-down-{pair[0]}", url=redis_server.url.rsplit("/", 1)[0] + "/6")
    locks = locks_class(TWINS[pair[0]])(down_url)
    tasks = TaskLocks(huey, locks)
    locked = tasks.task(lock_ttl=30, lock_lifetime="until_executed", name="unreachable")(lambda n: n)
    plain = huey.task(name="plain")(lambda n: n)
    try:
        with pytest.raises(joblock.ConnectionError):
            locked(1)
        plain(1)
        assert huey.pending_count() == 1  # the plain task only
    finally:
        locks.close()
        huey.flush()


def test_declaring(pair, redis_server):
    """TaskLocks takes a Huey instance and a Locks; tasks keep Huey's options and API, and
    a periodic task takes its lock too."""
    huey = MemoryHuey(f"joblock-declaring-{pair[0]}")
    locks = locks_class(TWINS[pair[0]])(redis_server.url, prefix="jh-declaring")
    try:
        with pytest.raises(TypeError, match="huey must be a Huey instance"):
            TaskLocks(object(), locks)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="locks must be a Locks"):
            TaskLocks(huey, AsyncLocks(redis_server.url))  # type: ignore[arg-type]
        tasks = TaskLocks(huey, locks)
        enqueue = huey.enqueue
        TaskLocks(huey, locks)  # a second one on the same Huey shares the first one's hooks
        assert huey.enqueue is enqueue
        report = tasks.periodic_task(crontab(minute="0", hour="2"), lock_ttl=600, retries=2, name="report")(
            lambda: "done"
        )
        assert report.task_class.default_retries == 2 and report.task_class.__name__ == "report"
        assert tasks.lock_key(report) == "jh-declaring:report"
        with pytest.raises(TypeError, match="not a task declared with TaskLocks"):
            tasks.lock_key(huey.task(name="unlocked")(lambda: None))
        with pytest.raises(TypeError, match="plain functions"):
            tasks.task(lock_ttl=30)(huey.task(name="wrapped")(lambda: None))
    finally:
        locks.close()


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"lock_ttl": 0}, ValueError, "ttl"),
        ({"lock_ttl": "300"}, TypeError, "ttl"),
        ({"lock_ttl": 30, "lock_lifetime": "forever"}, ValueError, "lifetime"),
        ({"lock_ttl": 30, "lock_on_conflict": "wait"}, ValueError, "on_conflict"),
        ({"lock_ttl": 30, "lock_lifetme": "until_executed"}, TypeError, "unknown lock option 'lock_lifetme'"),
        (
            {"lock_ttl": 30, "lock_lifetime": "debounce"},
            ValueError,
            "lock_lifetime='debounce' needs lock_debounce",
        ),
        ({"lock_ttl": 30, "lock_debounce": 2}, ValueError, "lock_debounce is for lock_lifetime='debounce'"),
        ({"lock_ttl": 30, "lock_limit": 0}, ValueError, "lock_limit must be between 1 and"),
        (
            {"lock_ttl": 30, "lock_lifetime": "debounce", "lock_debounce": 1, "lock_limit": 2},
            ValueError,
            "lock_limit is for the locking lifetimes",
        ),
        ({"lock_ttl": 30, "lock_on_lost": "nope"}, ValueError, "lock_on_lost must be 'ignore', 'interrupt'"),
        ({"lock_ttl": 30, "lock_on_lost": "cancel"}, ValueError, "lock_on_lost='cancel' cancels an asyncio"),
        (
            {"lock_ttl": 30, "lock_on_lost": "exit", "lock_lifetime": "until_executing"},
            ValueError,
            "lock_on_lost is for a run that holds its lock",
        ),
    ],
)
def test_bad_lock_options_are_refused_naming_them(pair, redis_server, options, error, words):
    """Refused when the task is declared, before Huey registers it."""
    huey = MemoryHuey(f"joblock-options-{pair[0]}")
    locks = locks_class(TWINS[pair[0]])(redis_server.url)
    try:
        with pytest.raises(error, match=words):
            TaskLocks(huey, locks).task(name="bad", **options)(lambda: None)
        huey.task(name="bad")(lambda: None)  # Huey would refuse a second task of that name
    finally:
        locks.close()


# -- a lost lock stops the task ------------------------------------------------------------


def test_an_operators_release_stops_the_running_task(pair, app, run, client, consumer, redis_server):
    """lock_on_lost: an operator releases the lock of a running task (``joblock release``);
    a process worker exits with EXIT_STATUS after saying why ("exit") and the consumer
    starts a new one; a thread worker's task is interrupted with LockLost ("interrupt")
    and fails. Either way the task's work stops (its "end" never comes)."""
    task = app.exits if pair[1] == "process" else app.interrupted
    key = app.tasks.lock_key(task, run)
    sent = task(run)
    token = wait_events(client, run, 1, "the task's start")[0].split()[1]
    assert client.get(key).decode() == token
    assert admin.release(redis_server.url, key) == 0
    if pair[1] == "process":
        said = f"joblock lost the lock {key!r} (an operator released it): exiting with status 75"
        wait_for(lambda: said in consumer.log(), TIMEOUT, "the worker's log of the loss")
        wait_for(lambda: "died, restarting" in consumer.log(), TIMEOUT, "the consumer's health check")
        assert sent.get() is None  # the worker that ran it is gone: no result
    else:
        with pytest.raises(TaskException, match="LockLost"):
            result(sent)
        assert lines(consumer, "an operator released it", key)
    assert events(client, run) == [f"start {token}"]
    assert consumer.alive()
    twin = "c" if pair[0] == "c" else "python"
    assert [app.ping().get(blocking=True, timeout=TIMEOUT) for _ in range(4)] == [twin] * 4
