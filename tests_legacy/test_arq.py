"""joblock.arq with a real arq worker (the ``arq`` command) on real Redis, on each core twin.

The module runs once per twin: an arq worker (up to 20 jobs at once) on that twin
(JOBLOCK_NO_EXTENSIONS=1 for the pure one); the test process enqueues through
AsyncLocks on the same twin, each test in its own event loop. Functions
(tests_legacy/arq_jobs.py) write events to a Redis list per test run.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import arq_jobs as jobs
import pytest
import redis
from arq.connections import ArqRedis, create_pool
from arq.worker import JobExecutionFailed
from legacy import TIMEOUT, async_locks_class, events, legacy_env, most_at_once, starts, wait_events

from conftest import TWINS
from joblock import LockLost, LockNotAcquired, Locks
from joblock._tools import admin
from joblock._tools.servers import RedisServer
from joblock.arq import enqueue, locked
from workers import Worker, python, wait_for

TWIN_IDS = ["c", "python"] if "c" in TWINS else ["python"]


def arq_worker(twin: str, redis_server: RedisServer, queue: str, log: Path) -> Worker:
    env = legacy_env(twin, redis_server.url)
    env["JOBLOCK_TEST_QUEUE"] = queue
    return Worker([python(), "-m", "arq", "arq_jobs.WorkerSettings"], env, log)


@pytest.fixture(scope="module", params=TWIN_IDS)
def twin(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> redis.Redis:
    jobs.configure(redis_server.url)
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture(scope="module")
def queue_name(twin: str) -> str:
    return f"joblock-arq-{twin}"


@pytest.fixture(scope="module")
def worker(
    twin: str,
    redis_server: RedisServer,
    client: redis.Redis,
    queue_name: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Worker]:
    jobs.use_locks(async_locks_class(TWINS[twin])(redis_server.url, prefix=jobs.PREFIX))
    started = arq_worker(twin, redis_server, queue_name, tmp_path_factory.mktemp("arq") / "worker.log")
    try:
        wait_for(lambda: "Starting worker" in started.log() or not started.alive(), 60, "the arq worker")
        assert started.alive(), started.report()
        yield started
    finally:
        started.stop()
        redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/3").flushdb()


@pytest.fixture
def run(worker: Worker) -> Iterator[str]:
    """A fresh id for the test's jobs; the worker's log of the test is shown if it fails."""
    start = len(worker.log())
    yield uuid.uuid4().hex[:10]
    print(worker.log()[start:][-6000:])


def arq(redis_server: RedisServer, queue_name: str, body: Any) -> Any:
    """Runs ``body(pool)`` in a fresh event loop with an arq pool on the test's queue."""

    async def main() -> Any:
        pool: ArqRedis = await create_pool(jobs.arq_settings(redis_server.url), default_queue_name=queue_name)
        try:
            return await body(pool)
        finally:
            await pool.aclose()
            await jobs.get_locks().close()

    return asyncio.run(main())


@pytest.fixture
def on_queue(redis_server: RedisServer, queue_name: str, worker: Worker) -> Any:
    return lambda body: arq(redis_server, queue_name, body)


def lines(worker: Worker, run: str, text: str) -> list[str]:
    return [line for line in worker.log().splitlines() if run in line and text in line]


# -- the article's two problems ------------------------------------------------------------


def test_cleanup_runs_one_at_a_time_and_reschedules(on_queue, run, client, worker):
    """CleanupDataJob: three enqueued at once on a worker running 20 jobs at a time; one
    cleanup at a time, the others re-enqueued (deferred) until the lock is free."""

    async def body(pool: ArqRedis) -> None:
        for user in (1, 2, 3):
            assert await enqueue(pool, jobs.cleanup_data, user, run, 0.3) is not None

    on_queue(body)
    log = wait_events(client, run, 6, "three cleanups")
    for i in range(0, 6, 2):
        assert log[i].split()[0] == "start" and log[i + 1] == "end " + log[i].split()[1]
    assert sorted(e for e in log if e.startswith("start")) == ["start 1", "start 2", "start 3"]
    assert lines(worker, run, "rescheduled in")
    # The last run frees the lock after its "end" event.
    wait_for(lambda: not client.exists(jobs.cleanup_data.lock_key(1, run, 0.3)), 5, "the lock to go")


def test_product_sales_pile_up_runs_once_per_product(on_queue, run, client, caplog):
    """ProductSalesJob: 100 submissions over 3 products; until_executed enqueues 3 and
    drops 97 duplicates (logged); exactly 3 runs; the locks are free afterwards."""
    caplog.set_level(logging.INFO, logger="joblock")

    async def body(pool: ArqRedis) -> list[Any]:
        # Runs of 2 s: the 100 calls end before the first run does, on a busy machine
        # too (at 0.5 s a run finished mid-burst and its product was sent again).
        sent = [await enqueue(pool, jobs.product_sales, i % 3, run, 2) for i in range(100)]
        sent = [job for job in sent if job is not None]
        assert len(sent) == 3
        return [await job.result(timeout=TIMEOUT) for job in sent]

    assert sorted(on_queue(body)) == ["sales 0", "sales 1", "sales 2"]
    dropped = [r for r in caplog.records if r.getMessage().startswith("Job already queued: ProductSalesJob")]
    assert len(dropped) == 97
    assert sorted(e for e in events(client, run) if e.startswith("start")) == [f"start {p}" for p in range(3)]
    for product in range(3):
        assert not client.exists(jobs.product_sales.lock_key(product, run, 2))


def test_a_burst_from_many_tasks_lets_one_copy_per_argument_set_through(on_queue, run, client):
    """40 asyncio tasks enqueue 200 ProductSalesJobs over 5 products at once: 5 are sent."""

    async def body(pool: ArqRedis) -> list[Any]:
        async def submit(task: int) -> list[Any]:
            # Runs of 2 s, as above: the burst ends before the first run does.
            return [await enqueue(pool, jobs.product_sales, (task + i) % 5, run, 2) for i in range(5)]

        sent = [job for batch in await asyncio.gather(*(submit(t) for t in range(40))) for job in batch]
        sent = [job for job in sent if job is not None]
        assert len(sent) == 5
        return [await job.result(timeout=TIMEOUT) for job in sent]

    assert sorted(on_queue(body)) == [f"sales {p}" for p in range(5)]
    assert starts(events(client, run)) == 5


# -- lifetimes -----------------------------------------------------------------------------


def test_while_executing_locks_the_run_only(on_queue, run, client, worker):
    key = jobs.while_executing.lock_key(run, 0.8)

    async def body(pool: ArqRedis) -> None:
        first = await enqueue(pool, jobs.while_executing, run, 0.8)
        token = (await asyncio.to_thread(wait_events, client, run, 1, "the first run"))[0].split()[1]
        assert client.get(key).decode() == token
        second = await enqueue(pool, jobs.while_executing, run, 0.8)
        assert second is not None  # nothing taken at enqueue
        assert await second.result(timeout=TIMEOUT) is None  # skipped
        assert await first.result(timeout=TIMEOUT) == "done"

    on_queue(body)
    assert starts(events(client, run)) == 1
    assert lines(worker, run, "Job already running: while_executing")
    assert not client.exists(key)


def test_until_executing_frees_the_lock_when_the_run_starts(on_queue, run, client):
    key = jobs.until_executing.lock_key(run, 0.8)

    async def body(pool: ArqRedis) -> None:
        first = await enqueue(pool, jobs.until_executing, run, 0.8, _defer_by=1)
        assert first is not None and client.pttl(key) > 0
        assert await enqueue(pool, jobs.until_executing, run, 0.8) is None  # one copy queued at a time
        assert (await asyncio.to_thread(wait_events, client, run, 1, "the run's start"))[0] == "start -"
        assert not client.exists(key)
        during = await enqueue(pool, jobs.until_executing, run, 0.8)
        assert during is not None
        assert await first.result(timeout=TIMEOUT) == "done"
        assert await during.result(timeout=TIMEOUT) == "done"

    on_queue(body)
    assert starts(events(client, run)) == 2


def test_until_executed_holds_from_enqueue_to_the_end_of_the_run(on_queue, run, client):
    key = jobs.until_executed.lock_key(run, 0.8)

    async def body(pool: ArqRedis) -> None:
        first = await enqueue(pool, jobs.until_executed, run, 0.8, _defer_by=1)
        token = client.get(key)
        assert first is not None and token is not None
        assert await enqueue(pool, jobs.until_executed, run, 0.8) is None  # while queued
        start = (await asyncio.to_thread(wait_events, client, run, 1, "the run's start"))[0]
        assert start == f"start {token.decode()}"
        assert client.get(key) == token
        assert await enqueue(pool, jobs.until_executed, run, 0.8) is None  # while running
        assert await first.result(timeout=TIMEOUT) == "done"
        assert not client.exists(key)
        again = await enqueue(pool, jobs.until_executed, run, 0.8)
        assert again is not None and await again.result(timeout=TIMEOUT) == "done"

    on_queue(body)


def test_until_expired_leaves_the_lock_to_its_ttl(on_queue, run, client):
    key = jobs.until_expired.lock_key(run, 0)

    async def body(pool: ArqRedis) -> None:
        first = await enqueue(pool, jobs.until_expired, run, 0)
        assert first is not None and await first.result(timeout=TIMEOUT) == "done"
        assert events(client, run) == ["start -", "end"]
        assert 0 < client.pttl(key) <= 2000
        assert await enqueue(pool, jobs.until_expired, run, 0) is None
        await asyncio.to_thread(wait_for, lambda: not client.exists(key), 5, "the lock's expiry")
        again = await enqueue(pool, jobs.until_expired, run, 0)
        assert again is not None and await again.result(timeout=TIMEOUT) == "done"

    on_queue(body)


# -- strategies ----------------------------------------------------------------------------


def test_an_async_callable_decides_and_its_value_is_the_result(on_queue, run, client):
    async def body(pool: ArqRedis) -> None:
        async with jobs.get_locks().lock(jobs.calling.lock_key(run, 0), ttl=30):
            job = await pool.enqueue_job("calling", run, 0)
            assert await job.result(timeout=TIMEOUT) == f"busy {run}"

    on_queue(body)
    assert events(client, run) == ["busy"]


def test_raise_at_run_fails_the_job(on_queue, run, client):
    async def body(pool: ArqRedis) -> None:
        async with jobs.get_locks().lock(jobs.raising.lock_key(run, 0), ttl=30):
            job = await pool.enqueue_job("raising", run, 0)
            with pytest.raises(LockNotAcquired):
                await job.result(timeout=TIMEOUT)

    on_queue(body)
    assert events(client, run) == []


def test_an_async_on_expired_hears_of_a_lock_that_expired_before_release(on_queue, run, client):
    """A run of 1 s under a 0.5 s lock: its release finds the lock gone and awaits on_expired."""

    async def body(pool: ArqRedis) -> None:
        assert await (await pool.enqueue_job("outlived", run, 1.0)).result(timeout=TIMEOUT) == "done"

    on_queue(body)
    assert [e.split()[0] for e in events(client, run)] == ["start", "end", "expired"]


# -- arq's retries --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["retried_while_executing", "retried_until_executed"])
def test_a_retry_keeps_the_lock_until_the_last_try_ends(name, on_queue, run, client, worker):
    """A job raising Retry twice: its three tries run under one lock (one token), which a
    duplicate meets while the last try runs; it is freed when the last try ends."""
    job_function = getattr(jobs, name)
    key = job_function.lock_key(run, 3)

    async def body(pool: ArqRedis) -> None:
        job = await enqueue(pool, job_function, run, 3)
        tries = await asyncio.to_thread(wait_events, client, run, 3, "three tries")
        assert [e.split()[:2] for e in tries] == [["try", "1"], ["try", "2"], ["try", "3"]]
        assert len({e.split()[2] for e in tries}) == 1  # never its own lock as a conflict
        assert client.get(key).decode() == tries[0].split()[2]
        duplicate = await enqueue(pool, job_function, run, 3)
        if name == "retried_until_executed":
            assert duplicate is None
        else:
            assert await duplicate.result(timeout=TIMEOUT) is None  # skipped at the worker
        assert client.get(key).decode() == tries[0].split()[2]
        await pool.rpush(f"go:{run}", 1)
        assert await job.result(timeout=TIMEOUT) == "done"
        assert not await pool.keys("joblock:arq:retry:*")

    on_queue(body)
    assert len(events(client, run)) == 3
    assert not client.exists(key)
    if name == "retried_while_executing":
        assert lines(worker, run, f"Job already running: {name}")


def test_a_retry_at_the_last_try_frees_the_lock(on_queue, run, client):
    """max_tries=2: the second try's Retry frees the lock (ttl 30 s) and arq gives the job up."""
    key = jobs.given_up.lock_key(run, 3)

    async def body(pool: ArqRedis) -> None:
        job = await enqueue(pool, jobs.given_up, run, 3)
        with pytest.raises(JobExecutionFailed, match="max 2 retries exceeded"):
            await job.result(timeout=TIMEOUT)

    on_queue(body)
    tries = events(client, run)
    assert [e.split()[:2] for e in tries] == [["try", "1"], ["try", "2"]]
    assert tries[0].split()[2] == tries[1].split()[2]
    assert not client.exists(key)


# -- debounce ------------------------------------------------------------------------------


def test_a_debounced_burst_runs_once_with_the_last_arguments(on_queue, run, client, worker):
    """Five enqueues within the window: each is deferred and supersedes the one before; the
    worker runs the last one's revision once and drops the other four (logged), their
    results None."""

    async def body(pool: ArqRedis) -> list[Any]:
        sent = [await enqueue(pool, jobs.debounced, run, rev) for rev in range(5)]
        assert all(job is not None for job in sent)
        return [await job.result(timeout=TIMEOUT) for job in sent]

    assert on_queue(body) == [None, None, None, None, 4]
    assert events(client, run) == ["run 4"]
    superseded = [f"Job superseded: debounced with '{run}', {rev} " for rev in range(4)]
    wait_for(lambda: all(lines(worker, run, line) for line in superseded), 5, "the superseded lines")

    async def later(pool: ArqRedis) -> Any:
        # An enqueue after the run starts a new burst, run on its own.
        return await (await enqueue(pool, jobs.debounced, run, 5)).result(timeout=TIMEOUT)

    assert on_queue(later) == 5
    assert events(client, run) == ["run 4", "run 5"]


def test_debounce_max_runs_a_steady_stream(on_queue, run, client):
    """Enqueues every 50 ms, far inside the 1 s window, would postpone the run for as long
    as they come: debounce_max runs the burst while the stream goes on."""

    async def body(pool: ArqRedis) -> tuple[list[Any], int]:
        sent = []
        while not events(client, run):
            assert len(sent) < TIMEOUT * 20, "no run while the stream went on"
            sent.append(await enqueue(pool, jobs.capped, run, len(sent)))
            await asyncio.sleep(0.05)
        results = [await job.result(timeout=TIMEOUT) for job in sent]
        ran = [int(e.split()[1]) for e in events(client, run)]
        # One more run when an enqueue came between the capped run's start and its event.
        assert results == [rev if rev in ran else None for rev in range(len(sent))]
        assert ran[-1] == len(sent) - 1 and len(ran) <= 2 < len(sent)
        return len(sent), await (await enqueue(pool, jobs.capped, run, len(sent))).result(timeout=TIMEOUT)

    count, last = on_queue(body)
    assert last == count


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"lifetime": "debounce"}, "lifetime='debounce' needs debounce"),
        ({"lifetime": "debounce", "debounce": -1}, "debounce must be a finite number"),
        (
            {"lifetime": "debounce", "debounce": 2, "debounce_max": 1},
            r"debounce_max \(1\) must be at least debounce \(2\)",
        ),
        ({"debounce": 2}, "debounce is for lifetime='debounce', not 'while_executing'"),
        ({"limit": 0}, "limit must be between 1 and"),
        ({"limit": 2, "lifetime": "debounce", "debounce": 1}, "limit is for the locking"),
        ({"on_lost": "nope"}, "on_lost must be 'ignore', 'interrupt', 'cancel', 'exit' or a callable"),
        ({"on_lost": "interrupt"}, "on_lost='interrupt' interrupts a thread"),
        ({"on_lost": "cancel", "lifetime": "until_executing"}, "on_lost is for a run that holds its lock"),
    ],
)
def test_bad_lock_options_raise_naming_the_option(redis_server, client, options, words):
    """At decoration, before the function exists to be enqueued or anything reaches Redis."""
    name = f"bad_{uuid.uuid4().hex[:8]}"
    locks = async_locks_class(TWINS["python"])(redis_server.url, prefix=jobs.PREFIX)

    async def bad(ctx: Any, run: str, rev: int) -> None:
        raise AssertionError("never enqueued")

    with pytest.raises(ValueError, match=f"^{words}"):
        locked(locks, ttl=30, name=name, **options)(bad)
    assert client.keys(f"{jobs.PREFIX}:{name}*") == []


# -- limit ---------------------------------------------------------------------------------


def test_limit_2_until_executed_sends_two_of_a_burst_and_runs_two_at_once(on_queue, run, client):
    """Five enqueues of one key: two are sent, and both run at once (each waits for the
    test's word); more enqueues meanwhile are dropped; when one ends a third is sent.
    The start/end events never show more than two runs at once."""

    async def body(pool: ArqRedis) -> list[Any]:
        sent = [await enqueue(pool, jobs.limited, run, n) for n in range(5)]
        first = [job for job in sent if job is not None]
        assert len(first) == 2
        await asyncio.to_thread(wait_events, client, run, 2, "two runs at once")
        assert [await enqueue(pool, jobs.limited, run, n) for n in range(5, 10)] == [None] * 5
        client.rpush(f"go:{run}", 1)
        await asyncio.to_thread(wait_events, client, run, 3, "a run's end")
        third = None
        while third is None:  # until the ended run's lock is freed, after its "end"
            third = await enqueue(pool, jobs.limited, run, 10)
            await asyncio.sleep(0.05)
        await asyncio.to_thread(wait_events, client, run, 4, "the third run's start")
        client.rpush(f"go:{run}", 1, 1)
        return sorted([await job.result(timeout=TIMEOUT) for job in [*first, third]])

    assert on_queue(body) == [0, 1, 10]
    log = events(client, run)
    assert starts(log) == 3 and most_at_once(log) == 2
    assert sorted(log[:2]) == ["start 0", "start 1"]
    assert not client.exists(jobs.limited.lock_key(run, 0))


def test_max_tries_is_checked(redis_server):
    with pytest.raises(ValueError, match="max_tries must be at least 1"):
        locked(jobs.get_locks, ttl=30, max_tries=0)
    with pytest.raises(TypeError, match="max_tries must be an int"):
        locked(jobs.get_locks, ttl=30, max_tries=2.5)


def test_a_threaded_locks_is_refused(redis_server):
    with pytest.raises(TypeError, match="locks must be a AsyncLocks"):
        locked(Locks(redis_server.url), ttl=30)(jobs.sleeper.__wrapped__)


# -- crashes -------------------------------------------------------------------------------


def test_killed_worker_lock_frees_at_its_ttl(twin, run, client, redis_server, tmp_path):
    """SIGKILL to the arq worker mid-job: the lock stays with the dead run's token
    until its ttl (3 s), never less."""
    name = f"joblock-arq-kill-{run}"
    worker = arq_worker(twin, redis_server, name, tmp_path / "worker.log")
    try:
        key = jobs.sleeper.lock_key(run)
        arq(redis_server, name, lambda pool: pool.enqueue_job("sleeper", run))
        token = wait_events(client, run, 1, "the job's start")[0].split()[1]
        worker.kill_and_watch_the_lock(client, key, token, ttl=3)
    finally:
        print(worker.report())
        worker.stop()


# -- a lost lock cancels the job ------------------------------------------------------------


def test_an_operators_release_cancels_the_running_job(on_queue, run, client, worker, redis_server):
    """on_lost="cancel": an operator releases the lock of a running job (``joblock
    release``); the job's task is cancelled and ends with LockLost, which arq records as
    the job's failure; its work stops (its "end" never comes) and the worker goes on."""
    key = jobs.cancelled.lock_key(run)

    async def body(pool: ArqRedis) -> tuple[str, BaseException, Any]:
        job = await enqueue(pool, jobs.cancelled, run)
        started = await asyncio.to_thread(wait_events, client, run, 1, "the job's start")
        token = started[0].split()[1]
        assert client.get(key).decode() == token
        assert await asyncio.to_thread(admin.release, redis_server.url, key) == 0
        with pytest.raises(LockLost) as caught:
            await job.result(timeout=TIMEOUT)
        after = await enqueue(pool, jobs.while_executing, f"{run}-after", 0)
        return token, caught.value, await after.result(timeout=TIMEOUT)

    token, error, after = on_queue(body)
    assert isinstance(error, LockLost) and error.key == key and error.cause == "released"
    assert events(client, run) == [f"start {token}"]
    assert lines(worker, run, f"joblock lost the lock {key!r}: an operator released it")
    assert after == "done" and worker.alive()
