"""joblock.taskiq with a real taskiq worker (``taskiq worker``) on taskiq-redis, on each core twin.

The module runs once per twin: a taskiq worker process (up to 20 tasks at once) on
that twin (JOBLOCK_NO_EXTENSIONS=1 for the pure one), on a queue of its own; the test
process sends through AsyncLocks on the same twin, each test in its own event loop.
Tasks (tests_legacy/taskiq_app.py) write events to a Redis list per test run.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from legacy import TIMEOUT, async_locks_class, events, legacy_env, most_at_once, starts, wait_events

from conftest import TWINS
from joblock import LockNotAcquired, Locks
from joblock._tools import admin
from joblock._tools.servers import RedisServer
from joblock.taskiq import LockMiddleware, kiq
from workers import Worker, python, wait_for

TWIN_IDS = ["c", "python"] if "c" in TWINS else ["python"]
QUEUE = "joblock-taskiq"  # the twins' workers run one after the other
# tests_legacy/taskiq_app.py, imported by the ``worker`` fixture once the suite's Redis is up:
# its broker is built at import, from JOBLOCK_TEST_REDIS as in the worker.
app: Any = None


def taskiq_worker(
    twin: str, redis_server: RedisServer, queue: str, log: Path, retry: str = "simple"
) -> Worker:
    env = legacy_env(twin, redis_server.url)
    env["JOBLOCK_TEST_QUEUE"] = queue
    env["JOBLOCK_TEST_RETRY"] = retry
    command = [
        python(), "-m", "taskiq", "worker", "taskiq_app:broker", "--workers", "1",
        "--max-async-tasks", "20", "--log-level", "INFO",
    ]  # fmt: skip
    return Worker(command, env, log)


def lock_key(task: Any, *args: Any) -> str | bytes:
    policy = app.broker.middlewares[0].policy(task.task_name)
    return policy.lock_key(args, {})  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=TWIN_IDS)
def twin(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> redis.Redis:
    global app  # noqa: PLW0603  # the tests read the module imported here
    os.environ["JOBLOCK_TEST_REDIS"] = redis_server.url
    os.environ["JOBLOCK_TEST_QUEUE"] = QUEUE
    app = importlib.import_module("taskiq_app")
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture(scope="module")
def worker(
    twin: str, redis_server: RedisServer, client: redis.Redis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    app.use_locks(async_locks_class(TWINS[twin])(redis_server.url, prefix=app.PREFIX))
    started = taskiq_worker(twin, redis_server, QUEUE, tmp_path_factory.mktemp("taskiq") / "worker.log")
    try:
        wait_for(lambda: "Listening started" in started.log() or not started.alive(), 60, "the worker")
        assert started.alive(), started.report()
        yield started
    finally:
        started.stop()
        redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/4").flushdb()


@pytest.fixture
def run(worker: Worker) -> Iterator[str]:
    """A fresh id for the test's tasks; the worker's log of the test is shown if it fails."""
    start = len(worker.log())
    yield uuid.uuid4().hex[:10]
    print(worker.log()[start:][-6000:])


def sending(body: Any) -> Any:
    """Runs ``body()`` in a fresh event loop with the broker started as a client."""

    async def main() -> Any:
        await app.broker.startup()
        try:
            return await body()
        finally:
            await app.broker.shutdown()
            await app.get_locks().close()

    return asyncio.run(main())


async def result(task: Any) -> Any:
    found = await task.wait_result(timeout=TIMEOUT)
    if found.is_err:
        raise found.error
    return found.return_value


def lines(worker: Worker, run: str, text: str) -> list[str]:
    return [line for line in worker.log().splitlines() if run in line and text in line]


# -- the article's two problems ------------------------------------------------------------


def test_cleanup_runs_one_at_a_time_and_reschedules(run, client, worker):
    """CleanupDataJob: three sent at once to a worker running 20 tasks at a time; one
    cleanup at a time, the others sent again after a backoff until the lock is free."""

    async def body() -> None:
        for user in (1, 2, 3):
            assert await kiq(app.cleanup_data, user, run, 0.3) is not None

    sending(body)
    log = wait_events(client, run, 6, "three cleanups")
    for i in range(0, 6, 2):
        assert log[i].split()[0] == "start" and log[i + 1] == "end " + log[i].split()[1]
    assert sorted(e for e in log if e.startswith("start")) == ["start 1", "start 2", "start 3"]
    assert lines(worker, run, "rescheduled in")
    wait_for(lambda: not client.exists(lock_key(app.cleanup_data, 1, run, 0.3)), 5, "the lock to go")


def test_product_sales_pile_up_runs_once_per_product(run, client, caplog):
    """ProductSalesJob: 100 submissions over 3 products; until_executed sends 3 and
    drops 97 duplicates (logged); exactly 3 runs; the locks are free afterwards."""
    caplog.set_level(logging.INFO, logger="joblock")

    async def body() -> list[Any]:
        # Runs of 2 s: the 100 calls end before the first run does, on a busy machine
        # too (at 0.5 s a run finished mid-burst and its product was sent again).
        sent = [await kiq(app.product_sales, i % 3, run, 2) for i in range(100)]
        sent = [task for task in sent if task is not None]
        assert len(sent) == 3
        return [await result(task) for task in sent]

    assert sorted(sending(body)) == ["sales 0", "sales 1", "sales 2"]
    dropped = [r for r in caplog.records if r.getMessage().startswith("Job already queued: ProductSalesJob")]
    assert len(dropped) == 97
    assert sorted(e for e in events(client, run) if e.startswith("start")) == [f"start {p}" for p in range(3)]
    for product in range(3):
        assert not client.exists(lock_key(app.product_sales, product, run, 2))


def test_a_burst_from_many_tasks_lets_one_copy_per_argument_set_through(run, client):
    """40 asyncio tasks send 200 ProductSalesJobs over 5 products at once: 5 are sent."""

    async def body() -> list[Any]:
        async def submit(n: int) -> list[Any]:
            # Runs of 2 s, as above: the burst ends before the first run does.
            return [await kiq(app.product_sales, (n + i) % 5, run, 2) for i in range(5)]

        sent = [task for batch in await asyncio.gather(*(submit(n) for n in range(40))) for task in batch]
        sent = [task for task in sent if task is not None]
        assert len(sent) == 5
        return [await result(task) for task in sent]

    assert sorted(sending(body)) == [f"sales {p}" for p in range(5)]
    assert starts(events(client, run)) == 5


# -- lifetimes -----------------------------------------------------------------------------


def test_while_executing_locks_the_run_only(run, client, worker):
    key = lock_key(app.while_executing, run, 0.8)

    async def body() -> None:
        first = await kiq(app.while_executing, run, 0.8)
        token = (await asyncio.to_thread(wait_events, client, run, 1, "the first run"))[0].split()[1]
        assert client.get(key).decode() == token
        second = await kiq(app.while_executing, run, 0.8)
        assert second is not None  # nothing taken at enqueue
        assert await result(second) is None  # skipped
        assert await result(first) == "done"

    sending(body)
    assert starts(events(client, run)) == 1
    assert lines(worker, run, "Job already running: while_executing")
    assert not client.exists(key)


def test_until_executing_frees_the_lock_when_the_run_starts(run, client):
    key = lock_key(app.until_executing, run, 0.8)

    async def body() -> None:
        async with app.get_locks().lock(key, ttl=30):
            assert await kiq(app.until_executing, run, 0.8) is None  # taken at enqueue
        first = await kiq(app.until_executing, run, 0.8)
        assert first is not None
        assert (await asyncio.to_thread(wait_events, client, run, 1, "the run's start"))[0] == "start -"
        assert not client.exists(key)
        during = await kiq(app.until_executing, run, 0.8)
        assert during is not None
        assert await result(first) == "done" and await result(during) == "done"

    sending(body)
    assert starts(events(client, run)) == 2


def test_until_executed_holds_from_enqueue_to_the_end_of_the_run(run, client):
    key = lock_key(app.until_executed, run, 0.8)

    async def body() -> None:
        first = await kiq(app.until_executed, run, 0.8)
        token = client.get(key)
        assert first is not None and token is not None
        start = (await asyncio.to_thread(wait_events, client, run, 1, "the run's start"))[0]
        assert start == f"start {token.decode()}"
        assert client.get(key) == token
        assert await kiq(app.until_executed, run, 0.8) is None  # while running
        assert await result(first) == "done"
        assert not client.exists(key)
        again = await kiq(app.until_executed, run, 0.8)
        assert again is not None and await result(again) == "done"

    sending(body)


def test_until_expired_leaves_the_lock_to_its_ttl(run, client):
    key = lock_key(app.until_expired, run, 0)

    async def body() -> None:
        first = await kiq(app.until_expired, run, 0)
        assert first is not None and await result(first) == "done"
        assert events(client, run) == ["start -", "end"]
        assert 0 < client.pttl(key) <= 2000
        assert await kiq(app.until_expired, run, 0) is None
        await asyncio.to_thread(wait_for, lambda: not client.exists(key), 5, "the lock's expiry")
        again = await kiq(app.until_expired, run, 0)
        assert again is not None and await result(again) == "done"

    sending(body)


# -- strategies and checks -----------------------------------------------------------------


def test_an_async_callable_decides_and_its_value_is_the_result(run, client):
    async def body() -> None:
        async with app.get_locks().lock(lock_key(app.calling, run, 0), ttl=30):
            assert await result(await app.calling.kiq(run, 0)) == f"busy {run}"

    sending(body)
    assert events(client, run) == ["busy"]


def test_raise_at_run_fails_the_task(run, client):
    async def body() -> None:
        async with app.get_locks().lock(lock_key(app.raising, run, 0), ttl=30):
            with pytest.raises(LockNotAcquired):
                await result(await app.raising.kiq(run, 0))

    sending(body)
    assert events(client, run) == []


def test_an_async_on_expired_hears_of_a_lock_that_expired_before_release(run, client):
    """A run of 1 s under a 0.5 s lock: its release finds the lock gone and awaits on_expired."""

    async def body() -> None:
        assert await result(await app.outlived.kiq(run, 1.0)) == "done"

    sending(body)
    assert [e.split()[0] for e in events(client, run)] == ["start", "end", "expired"]


def test_a_task_without_lock_ttl_runs_unlocked(run, client):
    async def body() -> None:
        assert await result(await app.plain.kiq(run, 0)) == "done"
        with pytest.raises(TypeError, match="lock_ttl"):
            await kiq(app.plain, run, 0)

    sending(body)
    assert events(client, run) == ["start -", "end"]


# -- taskiq's retries -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["retried_while_executing", "retried_until_executed"])
def test_a_retry_keeps_the_lock_until_the_last_try_ends(name, run, client, worker):
    """SimpleRetryMiddleware retries a task failing twice: its three tries run under one
    lock (one token), which a duplicate meets while the last try runs; it is freed when
    the last try ends."""
    task = getattr(app, name)
    key = lock_key(task, run, 3)

    async def body() -> None:
        first = await kiq(task, run, 3)
        tries = await asyncio.to_thread(wait_events, client, run, 3, "three tries")
        assert len({e.split()[1] for e in tries}) == 1  # never its own lock as a conflict
        assert client.get(key).decode() == tries[0].split()[1]
        duplicate = await kiq(task, run, 3)
        if name == "retried_until_executed":
            assert duplicate is None
        else:
            assert await result(duplicate) is None  # skipped at the worker
        assert client.get(key).decode() == tries[0].split()[1]
        client.rpush(f"go:{run}", 1)
        assert await result(first) == "done"

    sending(body)
    assert len(events(client, run)) == 3
    assert not client.exists(key)
    if name == "retried_while_executing":
        assert lines(worker, run, f"Job already running: {name}")


def test_a_failure_at_the_last_try_frees_the_lock(run, client):
    """max_retries=2: the second try's failure is the task's, and frees the lock (ttl 30 s)."""

    async def body() -> None:
        with pytest.raises(RuntimeError, match="try again"):
            await result(await kiq(app.given_up, run, 3))

    sending(body)
    tries = events(client, run)
    assert len(tries) == 2 and tries[0] == tries[1]
    assert not client.exists(lock_key(app.given_up, run, 3))


def test_smart_retry_middleware_keeps_the_lock_too(twin, run, client, redis_server, tmp_path):
    """A worker whose broker has SmartRetryMiddleware (no schedule_source: it sends the
    retry itself, with a delay label that taskiq-redis does not read)."""
    name = f"joblock-taskiq-smart-{run}"
    smart = taskiq_worker(twin, redis_server, name, tmp_path / "worker.log", retry="smart")
    try:
        wait_for(lambda: "Listening started" in smart.log() or not smart.alive(), 60, "the worker")
        sender = app.make_broker(redis_server.url, name, retry="smart")
        key = lock_key(app.retried_while_executing, run, 3)

        async def body() -> None:
            await sender.startup()
            try:
                first = await app.retried_while_executing.kicker().with_broker(sender).kiq(run, 3)
                tries = await asyncio.to_thread(wait_events, client, run, 3, "three tries")
                assert len({e.split()[1] for e in tries}) == 1
                assert client.get(key).decode() == tries[0].split()[1]
                client.rpush(f"go:{run}", 1)
                assert await result(first) == "done"
            finally:
                await sender.shutdown()
                await app.get_locks().close()

        asyncio.run(body())
        assert "Retrying 1/3" in smart.log()
        assert not client.exists(key)
    finally:
        print(smart.report())
        smart.stop()


# -- debounce ------------------------------------------------------------------------------


def test_a_debounced_burst_runs_once_with_the_last_arguments(run, client, worker):
    """Five sends within the window: each supersedes the one before and waits out its delay
    at the worker; the last one's revision runs once, the other four are dropped (logged),
    their results None."""

    async def body() -> list[Any]:
        sent = [await kiq(app.debounced, run, rev) for rev in range(5)]
        assert all(task is not None for task in sent)
        return [await result(task) for task in sent]

    assert sending(body) == [None, None, None, None, 4]
    assert events(client, run) == ["run 4"]
    superseded = [f"Job superseded: debounced with '{run}', {rev} " for rev in range(4)]
    wait_for(lambda: all(lines(worker, run, line) for line in superseded), 5, "the superseded lines")

    async def later() -> Any:
        # A send after the run starts a new burst, run on its own.
        return await result(await kiq(app.debounced, run, 5))

    assert sending(later) == 5
    assert events(client, run) == ["run 4", "run 5"]


def test_debounce_max_runs_a_steady_stream(run, client):
    """Sends every 50 ms, far inside the 1 s window, would postpone the run for as long as
    they come: lock_debounce_max runs the burst while the stream goes on."""

    async def body() -> tuple[int, Any]:
        sent = []
        while not events(client, run):
            assert len(sent) < TIMEOUT * 20, "no run while the stream went on"
            sent.append(await kiq(app.capped, run, len(sent)))
            await asyncio.sleep(0.05)
        results = [await result(task) for task in sent]
        ran = [int(e.split()[1]) for e in events(client, run)]
        # One more run when a send came between the capped run's start and its event.
        assert results == [rev if rev in ran else None for rev in range(len(sent))]
        assert ran[-1] == len(sent) - 1 and len(ran) <= 2 < len(sent)
        return len(sent), await result(await kiq(app.capped, run, len(sent)))

    count, last = sending(body)
    assert last == count


@pytest.mark.parametrize(
    ("labels", "words"),
    [
        ({"lock_lifetime": "debounce"}, "lock_lifetime='debounce' needs lock_debounce"),
        ({"lock_lifetime": "debounce", "lock_debounce": -1}, "lock_debounce must be a finite number"),
        (
            {"lock_lifetime": "debounce", "lock_debounce": 2, "lock_debounce_max": 1},
            r"lock_debounce_max \(1\) must be at least lock_debounce \(2\)",
        ),
        ({"lock_debounce": 2}, "lock_debounce is for lock_lifetime='debounce', not 'while_executing'"),
        ({"lock_limit": 0}, "lock_limit must be between 1 and"),
        ({"lock_limit": 2, "lock_lifetime": "debounce", "lock_debounce": 1}, "lock_limit is for the locking"),
        (
            {"lock_on_lost": "nope"},
            "lock_on_lost must be 'ignore', 'interrupt', 'cancel', 'exit' or a callable",
        ),
        ({"lock_on_lost": "interrupt"}, "lock_on_lost='interrupt' interrupts a thread"),
        (
            {"lock_on_lost": "cancel", "lock_lifetime": "until_expired"},
            "lock_on_lost is for a run that holds",
        ),
    ],
)
def test_bad_lock_labels_raise_at_kiq_and_send_nothing(run, client, worker, labels, words):
    """The test process's broker has the task, the worker does not: a message sent would
    show in the worker's log as a task not found."""
    name = f"bad_{run}"

    async def bad(run: str, rev: int) -> None:
        raise AssertionError("never sent")

    task = app.broker.task(task_name=name, lock_ttl=30, **labels)(bad)

    async def body() -> None:
        with pytest.raises(ValueError, match=f"^{words}"):
            await kiq(task, run, 1)
        # A plain task that is sent after it, to the same worker, marks the log.
        assert await result(await kiq(app.until_executed, run, 0)) == "done"

    sending(body)
    assert client.keys(f"{app.PREFIX}:{name}*") == []
    assert not lines(worker, name, "not found")


# -- limit ---------------------------------------------------------------------------------


def test_limit_2_until_executed_sends_two_of_a_burst_and_runs_two_at_once(run, client):
    """Five sends of one key: two are sent, and both run at once (each waits for the
    test's word); more sends meanwhile are dropped; when one ends a third is sent.
    The start/end events never show more than two runs at once."""

    async def body() -> list[Any]:
        sent = [await kiq(app.limited, run, n) for n in range(5)]
        first = [task for task in sent if task is not None]
        assert len(first) == 2
        await asyncio.to_thread(wait_events, client, run, 2, "two runs at once")
        assert [await kiq(app.limited, run, n) for n in range(5, 10)] == [None] * 5
        client.rpush(f"go:{run}", 1)
        await asyncio.to_thread(wait_events, client, run, 3, "a run's end")
        third = None
        while third is None:  # until the ended run's lock is freed, after its "end"
            third = await kiq(app.limited, run, 10)
            await asyncio.sleep(0.05)
        await asyncio.to_thread(wait_events, client, run, 4, "the third run's start")
        client.rpush(f"go:{run}", 1, 1)
        return sorted([await result(task) for task in [*first, third]])

    assert sending(body) == [0, 1, 10]
    log = events(client, run)
    assert starts(log) == 3 and most_at_once(log) == 2
    assert sorted(log[:2]) == ["start 0", "start 1"]
    assert not client.exists(lock_key(app.limited, run, 0))


def test_a_threaded_locks_is_refused(redis_server):
    with pytest.raises(TypeError, match="locks must be an AsyncLocks"):
        LockMiddleware(Locks(redis_server.url))


# -- crashes -------------------------------------------------------------------------------


def test_killed_worker_lock_frees_at_its_ttl(twin, run, client, redis_server, tmp_path, worker):
    """SIGKILL to the taskiq worker's process group mid-task: the lock stays with the
    dead run's token until its ttl (3 s), never less."""
    name = f"joblock-taskiq-kill-{run}"
    killed_worker = taskiq_worker(twin, redis_server, name, tmp_path / "worker.log")
    try:
        key = lock_key(app.sleeper, run)
        sender = app.make_broker(redis_server.url, name)

        async def body() -> None:
            await sender.startup()
            try:
                await app.sleeper.kicker().with_broker(sender).kiq(run)
            finally:
                await sender.shutdown()

        asyncio.run(body())
        token = wait_events(client, run, 1, "the task's start")[0].split()[1]
        killed_worker.kill_and_watch_the_lock(client, key, token, ttl=3)
    finally:
        print(killed_worker.report())
        killed_worker.stop()


# -- a lost lock cancels the task -----------------------------------------------------------


def test_an_operators_release_cancels_the_running_task(run, client, worker, redis_server):
    """lock_on_lost="cancel": an operator releases the lock of a running task (``joblock
    release``); the task running its function is cancelled and ends with LockLost, the
    task's error; its work stops (its "end" never comes) and the worker goes on."""
    key = lock_key(app.cancelled, run)

    async def body() -> tuple[str, Any, Any]:
        sent = await kiq(app.cancelled, run)
        started = await asyncio.to_thread(wait_events, client, run, 1, "the task's start")
        token = started[0].split()[1]
        assert client.get(key).decode() == token
        assert await asyncio.to_thread(admin.release, redis_server.url, key) == 0
        found = await sent.wait_result(timeout=TIMEOUT)
        after = await kiq(app.until_executed, f"{run}-after", 0)
        return token, found, await result(after)

    token, found, after = sending(body)
    assert found.is_err and "LockLost" in repr(found.error), found
    assert events(client, run) == [f"start {token}"]
    assert lines(worker, run, f"joblock lost the lock {key!r}: an operator released it")
    assert after == "done" and worker.alive()
