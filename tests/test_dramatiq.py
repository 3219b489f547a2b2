"""joblock.dramatiq with real Dramatiq workers (the ``dramatiq`` command) on the suite's Redis.

The module runs once per core twin: a ``dramatiq`` worker of 2 processes with 2 threads
each on that twin (JOBLOCK_NO_EXTENSIONS=1 for the pure one), and the test process
sending through Locks on the same twin. Actors (tests/dramatiq_app.py) write events to a
Redis list per test run; tests read them, the lock keys and their PTTL, and the worker's
output.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker

import joblock
from conftest import TWINS, locks_class
from joblock import LockNotAcquired, Locks
from joblock._tools import admin
from joblock._tools.servers import RedisServer
from joblock.aio import AsyncLocks
from joblock.dramatiq import LockMiddleware, LockOptionError, NotSent, Refused, send
from joblock.frameworks import TICKET, Ticket
from workers import Worker, import_app, most_at_once, python, wait_for, worker_env

TIMEOUT = 30


@pytest.fixture(scope="module")
def app(redis_server: RedisServer) -> Iterator[ModuleType]:
    """tests/dramatiq_app.py, whose broker reads the suite's Redis from the environment."""
    module = import_app("dramatiq_app", redis_server.url)
    yield module
    module.broker.client.flushdb()


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture(scope="module", params=[t for t in TWINS if t in ("c", "python")])
def twin(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def locks(twin: str, app: ModuleType, redis_server: RedisServer) -> Iterator[Locks]:
    locks = locks_class(TWINS[twin])(redis_server.url, prefix=app.PREFIX)
    app.use_locks(locks)
    yield locks
    locks.close()


def dramatiq_worker(twin: str, redis_server: RedisServer, queue: str, log: Path) -> Worker:
    command = [python(), "-m", "dramatiq", "dramatiq_app", "--processes", "2", "--threads", "2", "-Q", queue]
    env = worker_env(twin, redis_server.url)
    env["dramatiq_worker_timeout"] = "100"  # idle queues polled every 0.1 s, not every second
    return Worker(command, env, log)


@pytest.fixture(scope="module")
def worker(
    twin: str,
    app: ModuleType,
    locks: Locks,
    client: redis.Redis,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Worker]:
    started = dramatiq_worker(
        twin, redis_server, "default", tmp_path_factory.mktemp("dramatiq") / "worker.log"
    )
    try:
        run = uuid.uuid4().hex[:10]
        app.ping.send(run)
        wait_for(lambda: client.llen(f"events:{run}"), 60, "the worker's first message")
        # The worker runs the twin under test ("python" for either pure one).
        assert events(client, run) == ["c" if twin == "c" else "python"]
        yield started
    finally:
        started.stop()
        # Nothing a test left queued or delayed reaches the next twin's worker.
        app.broker.client.flushdb()


@pytest.fixture
def run(worker: Worker) -> Iterator[str]:
    """A fresh id for the test's messages; the worker's output of the test is shown if it fails."""
    start = len(worker.log())
    yield uuid.uuid4().hex[:10]
    print(worker.log()[start:][-6000:])


def lines(worker: Worker, text: str, run: str | None = None) -> list[str]:
    return [line for line in worker.log().splitlines() if text in line and (run is None or run in line)]


def events(client: redis.Redis, run: str) -> list[str]:
    return [e.decode() for e in client.lrange(f"events:{run}", 0, -1)]


def wait_events(client: redis.Redis, run: str, n: int, what: str) -> list[str]:
    def ready() -> list[str] | None:
        found = events(client, run)
        return found if len(found) >= n else None

    return wait_for(ready, TIMEOUT, what)  # type: ignore[no-any-return]


def wait_free(client: redis.Redis, key: str | bytes) -> None:
    wait_for(lambda: not client.exists(key), TIMEOUT, f"the lock {key!r} to be freed")


def starts(items: list[str]) -> int:
    return sum(1 for e in items if e.startswith("start"))


# -- the article's two problems ------------------------------------------------------------


def test_cleanup_runs_one_at_a_time_and_reschedules(app, run, client, worker):
    """CleanupDataJob on 4 worker threads: one cleanup at a time; a message meeting the
    lock is sent again later (Reschedule) until it can run, and its result is that run's."""
    # Runs of a second: time enough for a second worker, slow on a busy machine, to
    # meet the lock (at 0.3 s one worker sometimes ran all three).
    sent = [app.cleanup_data.send(user, run, 1) for user in (1, 2, 3)]
    results = [m.get_result(block=True, timeout=TIMEOUT * 1000) for m in sent]
    assert results == ["cleaned 1", "cleaned 2", "cleaned 3"]
    log = events(client, run)
    assert sorted(log) == sorted(f"{e} {u}" for u in (1, 2, 3) for e in ("start", "end"))
    for i in range(0, 6, 2):
        assert log[i].split()[0] == "start" and log[i + 1] == "end " + log[i].split()[1]
    assert lines(worker, "rescheduled in", run)
    wait_free(client, app.middleware.lock_key(app.cleanup_data, 1, run, 1))


def test_product_sales_pile_up_runs_once_per_product(app, run, client, caplog):
    """ProductSalesJob: 100 sends over 3 products; until_executed sends 3 messages and
    drops 97 duplicates (logged); exactly 3 runs; the locks are free afterwards."""
    caplog.set_level(logging.INFO, logger="joblock")
    # Runs of 2 s: the 100 calls end before the first run does, on a busy machine
    # too (at 0.5 s a run finished mid-burst and its product was sent again).
    sent = [send(app.product_sales, i % 3, run, 2) for i in range(100)]
    assert len([m for m in sent if m is not None]) == 3
    dropped = [r for r in caplog.records if r.getMessage().startswith("Job already queued: ProductSalesJob")]
    assert len(dropped) == 97
    with pytest.raises(NotSent) as refused:
        app.product_sales.send(0, run, 2)  # send itself says so
    assert refused.value.value is None
    wait_events(client, run, 6, "three runs")
    assert sorted(e for e in events(client, run) if e.startswith("start")) == [f"start {p}" for p in range(3)]
    for product in range(3):
        wait_free(client, app.middleware.lock_key(app.product_sales, product, run, 2))
    assert send(app.product_sales, 0, run, 2) is not None


# -- lifetimes -----------------------------------------------------------------------------


def test_while_executing_locks_the_run_only(app, run, client, worker):
    # A run of 3 s: the duplicate reaches a worker while it runs, on a busy machine too
    # (at 0.6-0.8 s the run had sometimes ended first, and the duplicate ran).
    key = app.middleware.lock_key(app.while_executing, run, 3)
    app.while_executing.send(run, 3)
    token = wait_events(client, run, 1, "the first run")[0].split()[1]
    assert client.get(key).decode() == token
    app.while_executing.send(run, 3)  # nothing taken at enqueue: it is sent
    wait_for(lambda: lines(worker, "Job already running: while_executing", run), TIMEOUT, "the skip")
    wait_events(client, run, 2, "the first run's end")
    wait_free(client, key)
    assert starts(events(client, run)) == 1


def test_until_executing_frees_the_lock_when_the_run_starts(app, run, client):
    key = app.middleware.lock_key(app.until_executing, run, 0.8)
    app.until_executing.send_with_options(args=(run, 0.8), delay=1000)
    assert client.pttl(key) > 0
    with pytest.raises(NotSent):
        app.until_executing.send(run, 0.8)  # one copy queued at a time
    assert wait_events(client, run, 1, "the run's start")[0] == "start -"
    assert not client.exists(key)
    app.until_executing.send(run, 0.8)  # while it runs
    wait_events(client, run, 4, "both runs")
    assert starts(events(client, run)) == 2


def test_until_executed_holds_from_send_to_the_end_of_the_run(app, run, client):
    key = app.middleware.lock_key(app.until_executed, run, 0.8)
    app.until_executed.send_with_options(args=(run, 0.8), delay=1000)
    token = client.get(key)
    assert token is not None
    with pytest.raises(NotSent):
        app.until_executed.send(run, 0.8)  # while queued
    assert wait_events(client, run, 1, "the run's start")[0] == f"start {token.decode()}"
    assert client.get(key) == token
    with pytest.raises(NotSent):
        app.until_executed.send(run, 0.8)  # while running
    wait_events(client, run, 2, "the run's end")
    wait_free(client, key)
    app.until_executed.send(run, 0.8)
    wait_events(client, run, 4, "the second run")


def test_until_expired_leaves_the_lock_to_its_ttl(app, run, client):
    key = app.middleware.lock_key(app.until_expired, run, 0)
    app.until_expired.send(run, 0)
    assert wait_events(client, run, 2, "the run") == ["start -", "end"]
    assert 0 < client.pttl(key) <= 2000
    assert send(app.until_expired, run, 0) is None
    wait_free(client, key)
    assert send(app.until_expired, run, 0) is not None
    wait_events(client, run, 4, "the second run")


def test_raise_at_send(app, run, locks):
    with locks.lock(app.middleware.lock_key(app.unique_raising, run), ttl=30):
        with pytest.raises(LockNotAcquired):
            app.unique_raising.send(run)
        with pytest.raises(LockNotAcquired):
            send(app.unique_raising, run)


def test_raise_at_the_worker_fails_the_message(app, run, client, locks):
    """The message is rejected to Dramatiq's dead-letter queue with the actor not run."""
    dead = f"{app.broker.namespace}:default.XQ.msgs"
    with locks.lock(app.middleware.lock_key(app.raising, run, 0), ttl=30):
        message = app.raising.send(run, 0)
        wait_for(
            lambda: app.broker.client.hexists(dead, message.options["redis_message_id"]), TIMEOUT, "the nack"
        )
    assert events(client, run) == []


def test_a_callable_decides_at_the_worker(app, run, client, locks):
    with locks.lock(app.middleware.lock_key(app.calling, run, 0), ttl=30):
        app.calling.send(run, 0)
        assert wait_events(client, run, 1, "the callable") == ["busy"]


# -- retries, crashes, expiry, bursts ------------------------------------------------------


def test_retry_keeps_its_lock(app, run, client, worker):
    """A failed message that Retries sends again keeps its lock through the backoff: the
    retried run adopts the same token, a duplicate sent in between is skipped, and the
    lock goes after the final run."""
    key = app.middleware.lock_key(app.retrying, run)
    message = app.retrying.send(run)
    token = wait_events(client, run, 1, "the first try")[0].split()[2]
    wait_for(lambda: lines(worker, f"Retrying message {message.message_id!r}"), TIMEOUT, "the retry")
    app.retrying.send(run)  # a duplicate, while the retry waits
    while True:
        held = client.get(key)
        # Read after the lock: a lock gone only because the retry ended shows its events.
        if len(events(client, run)) >= 2:
            break
        assert held == token.encode(), f"the lock went between the tries: {events(client, run)}"
        time.sleep(0.02)
    wait_free(client, key)
    assert events(client, run) == [f"try 0 {token}", f"try 1 {token}"]
    assert lines(worker, "Job already running: retrying", run)


def test_killed_worker_lock_frees_at_its_ttl(app, twin, run, client, redis_server, tmp_path):
    """SIGKILL to a worker's process group mid-run: the lock stays with the dead run's
    token until its ttl (3 s), never less."""
    worker = dramatiq_worker(twin, redis_server, "kill", tmp_path / "worker.log")
    try:
        key = app.middleware.lock_key(app.sleeper, run)
        app.sleeper.send(run)
        token = wait_events(client, run, 1, "the run's start")[0].split()[1]
        worker.kill_and_watch_the_lock(client, key, token, ttl=3)
    finally:
        print(worker.report())
        worker.stop()


def test_burst_from_threads_sends_one_copy_per_argument_set(app, run, client):
    """8 threads send 50 messages each over 5 argument sets at once: 5 are sent, 395 are
    refused, and each argument set runs exactly once (the runs wait until the burst is out)."""
    sent: list[object] = []
    gate = threading.Barrier(8)

    def sender(offset: int) -> None:
        gate.wait()
        found = [send(app.unique, (offset + i) % 5, run) for i in range(50)]
        sent.extend(m for m in found if m is not None)

    threads = [threading.Thread(target=sender, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.set(app.gate(run), 1)
    assert len(sent) == 5
    assert sorted(wait_events(client, run, 5, "five runs")) == [f"run {n}" for n in range(5)]
    for n in range(5):
        wait_free(client, app.middleware.lock_key(app.unique, n, run))
    assert len(events(client, run)) == 5


def test_on_expired_is_called_when_the_lock_expired_before_release(app, run, client):
    app.outlives_its_lock.send(run, 1.5)  # lock_ttl=1
    assert wait_events(client, run, 3, "the run and its expiry") == ["start", "end", "expired"]
    app.outlives_its_lock.send(run, 0)
    assert wait_events(client, run, 5, "a run within its ttl")[3:] == ["start", "end"]
    wait_free(client, app.middleware.lock_key(app.outlives_its_lock, run, 0))
    assert events(client, run)[3:] == ["start", "end"]


# -- debounce and limit --------------------------------------------------------------------


def test_a_debounced_burst_runs_once_with_the_last_arguments(app, run, client, worker):
    """Five sends within the window: each goes to the delay queue and supersedes the one
    before; the worker runs the last one's revision once and acks the other four unrun
    (logged), their results None."""
    sent = [send(app.debounced, run, rev) for rev in range(5)]
    assert all(isinstance(m, dramatiq.Message) for m in sent)
    with pytest.raises(NotSent, match="sent to run later") as sending:
        app.debounced.send(run, 5)  # send itself says where the message went
    sent.append(sending.value.value)
    results = [m.get_result(block=True, timeout=TIMEOUT * 1000) for m in sent]
    assert results == [None, None, None, None, None, 5]
    assert events(client, run) == ["run 5"]
    superseded = [f"Job superseded: debounced with '{run}', {rev} " for rev in range(5)]
    wait_for(lambda: all(lines(worker, line) for line in superseded), TIMEOUT, "the superseded lines")
    # A send after the run starts a new burst, run on its own.
    assert send(app.debounced, run, 6).get_result(block=True, timeout=TIMEOUT * 1000) == 6
    assert events(client, run) == ["run 5", "run 6"]


def test_debounce_max_runs_a_steady_stream(app, run, client):
    """Sends every 50 ms, far inside the 1 s window, would postpone the run for as long as
    they come: lock_debounce_max runs the burst while the stream goes on, with the revision
    pending then; the next send starts a burst of its own."""
    sent = []
    deadline = time.monotonic() + TIMEOUT
    while not events(client, run):
        assert time.monotonic() < deadline, "no run while the stream went on"
        sent.append(send(app.capped, run, len(sent)))
        time.sleep(0.05)
    results = [m.get_result(block=True, timeout=TIMEOUT * 1000) for m in sent]
    # One more run when a send came between the capped run's start and its event.
    ran = [int(e.split()[1]) for e in events(client, run)]
    assert results == [rev if rev in ran else None for rev in range(len(sent))]
    assert ran[-1] == len(sent) - 1 and len(ran) <= 2 < len(sent)
    assert send(app.capped, run, len(sent)).get_result(block=True, timeout=TIMEOUT * 1000) == len(sent)


def test_a_debounced_send_the_broker_refuses_leaves_the_burst_to_the_message_before(
    run, client, locks, redis_server, down_url
):
    """The locks' Redis answers and the broker's does not: the send raises Refused and the
    message it superseded is the pending one again, so the burst still runs."""
    middleware = LockMiddleware(locks)

    def declare(broker: RedisBroker) -> dramatiq.Actor[[str, int], None]:
        broker.add_middleware(middleware)
        options = {"lock_lifetime": "debounce", "lock_debounce": 30, "lock_identifier": lambda run, rev: run}
        return dramatiq.actor(
            lambda run, rev: None, actor_name="refused", broker=broker, lock_ttl=30, **options
        )

    # A namespace no worker reads: the delayed message stays in its delay queue.
    up = RedisBroker(url=redis_server.url, namespace=f"joblock-refused-{run}")
    sending, refusing = declare(up), declare(RedisBroker(url=down_url, namespace="joblock-down"))
    key = middleware.lock_key(sending, run, 1)
    try:
        first = send(sending, run, 1)
        pending = client.hget(key, "t")
        assert pending is not None and Ticket.load(first.options[TICKET]).token == pending
        with pytest.raises(Refused) as raised:
            refusing.send(run, 2)
        assert isinstance(raised.value.__cause__, redis.ConnectionError)
        assert client.hget(key, "t") == pending
    finally:
        up.client.delete(*up.client.keys(f"joblock-refused-{run}:*"), key)


def test_lock_limit_sends_that_many_copies_of_a_key(app, run, client):
    """until_executed with lock_limit=2: of five sends of one key two go out, each holding
    a place of the counting lock until its run ends; the others are dropped at send."""
    key = app.middleware.lock_key(app.limited_queued, run, 1.0)
    sent = [send(app.limited_queued, run, 1.0) for _ in range(5)]
    assert [m is not None for m in sent] == [True, True, False, False, False]
    assert client.zcard(key) == 3  # two holders and the limit
    happened = wait_events(client, run, 4, "the two runs")
    assert starts(happened) == 2 and most_at_once(happened) <= 2
    wait_free(client, key)
    assert send(app.limited_queued, run, 1.0) is not None


def test_lock_limit_at_the_worker_skips_a_third_run(app, run, client, locks, worker):
    """while_executing with lock_limit=2 and both places held (by the test): a message is
    skipped at the worker; once one place frees, the next message runs in it."""
    key = app.middleware.lock_key(app.limited_running, run, 0)
    held = [locks.acquire(key, 30, limit=2) for _ in range(2)]
    assert all(lease is not None for lease in held)
    app.limited_running.send(run, 0)
    wait_for(lambda: lines(worker, "Job already running: limited_running", run), TIMEOUT, "the skip")
    held[0].release()
    app.limited_running.send(run, 0)
    token = wait_events(client, run, 2, "the run in the freed place")[0].split()[1]
    assert token not in {lease.token.decode() for lease in held}
    held[1].release()
    wait_free(client, key)
    assert starts(events(client, run)) == 1


# -- settings ------------------------------------------------------------------------------


def test_send_raises_when_the_locks_redis_is_unreachable(twin, redis_server, down_url):
    """Not sent, and not left to Dramatiq, which would log the error and send it unlocked."""
    broker = RedisBroker(url=redis_server.url, namespace=f"joblock-down-{twin}")
    locks = locks_class(TWINS[twin])(down_url)
    broker.add_middleware(LockMiddleware(locks))
    messages = f"joblock-down-{twin}:default.msgs"  # where the broker keeps the queue's messages
    locked = dramatiq.actor(
        lambda n: None, actor_name="unreachable", broker=broker, lock_ttl=30, lock_lifetime="until_executed"
    )
    plain = dramatiq.actor(lambda n: None, actor_name="plain", broker=broker)
    try:
        with pytest.raises(Refused) as raised:
            locked.send(1)
        assert isinstance(raised.value.__cause__, joblock.ConnectionError)
        plain.send(1)
        assert broker.client.hlen(messages) == 1  # the plain message only
    finally:
        locks.close()
        broker.client.delete(messages)


def test_async_locks_are_refused(redis_server):
    async_locks = AsyncLocks(redis_server.url)
    with pytest.raises(TypeError, match="locks must be a Locks"):
        LockMiddleware(async_locks)


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"lock_ttl": 0}, ValueError, "ttl"),
        ({"lock_ttl": "300"}, TypeError, "ttl"),
        ({"lock_lifetime": "until_executed"}, TypeError, "lock_ttl"),
        ({"lock_ttl": 30, "lock_lifetime": "forever"}, ValueError, "lifetime"),
        ({"lock_ttl": 30, "lock_on_conflict": "wait"}, ValueError, "on_conflict"),
        (
            {"lock_ttl": 30, "lock_lifetime": "debounce"},
            ValueError,
            "lock_lifetime='debounce' needs lock_debounce",
        ),
        (
            {"lock_ttl": 30, "lock_lifetime": "debounce", "lock_debounce": -1},
            ValueError,
            "lock_debounce must be a finite number",
        ),
        (
            {"lock_ttl": 30, "lock_lifetime": "debounce", "lock_debounce": 2, "lock_debounce_max": 1},
            ValueError,
            r"lock_debounce_max \(1\) must be at least lock_debounce \(2\)",
        ),
        ({"lock_ttl": 30, "lock_debounce": 2}, ValueError, "lock_debounce is for lock_lifetime='debounce'"),
        ({"lock_ttl": 30, "lock_limit": 0}, ValueError, "lock_limit must be between 1 and"),
        ({"lock_ttl": 30, "lock_limit": "2"}, TypeError, "lock_limit must be an int"),
        (
            {"lock_ttl": 30, "lock_lifetime": "debounce", "lock_debounce": 1, "lock_limit": 2},
            ValueError,
            "lock_limit is for the locking lifetimes",
        ),
        ({"lock_ttl": 30, "lock_on_lost": "nope"}, ValueError, "lock_on_lost must be 'ignore', 'interrupt'"),
        ({"lock_ttl": 30, "lock_on_lost": "cancel"}, ValueError, "lock_on_lost='cancel' cancels an asyncio"),
        ({"lock_ttl": 30, "lock_on_lost": 1.5}, TypeError, "lock_on_lost must be .* not float"),
        (
            {"lock_ttl": 30, "lock_on_lost": "interrupt", "lock_lifetime": "debounce", "lock_debounce": 1},
            ValueError,
            "lock_on_lost is for a run that holds its lock",
        ),
    ],
)
def test_bad_actor_options_fail_the_declaration(redis_server, locks, options, error, words):
    broker = RedisBroker(url=redis_server.url, namespace="joblock-options")
    broker.add_middleware(LockMiddleware(locks))
    with pytest.raises(LockOptionError, match=words) as raised:
        dramatiq.actor(lambda: None, actor_name="bad", broker=broker, **options)
    assert isinstance(raised.value, error)
    assert "bad" not in broker.actors


# -- a lost lock stops the actor -----------------------------------------------------------


@pytest.mark.parametrize("cause", ["deadline", "released"])
def test_a_lost_lock_interrupts_the_running_actor(app, run, client, worker, redis_server, cause):
    """lock_on_lost="interrupt": the worker thread running the actor gets LockLost once the
    lock is lost, at its deadline (a 1 s lock_ttl outlived) or by an operator's release
    (``joblock release``); the actor's work stops (its "end" never comes), the message
    fails, and the worker goes on."""
    actor = app.interrupted if cause == "deadline" else app.released
    key = app.middleware.lock_key(actor, run)
    actor.send(run)
    token = wait_events(client, run, 1, "the actor's start")[0].split()[1]
    if cause == "released":
        assert client.get(key).decode() == token
        assert admin.release(redis_server.url, key) == 0
    why = "its deadline passed" if cause == "deadline" else "an operator released it"
    wait_for(lambda: lines(worker, f"joblock lost the lock {key!r}: {why}"), TIMEOUT, "the loss")
    wait_for(lambda: lines(worker, f"lock {key!r} was lost: {why}"), TIMEOUT, "the message's failure")
    assert events(client, run) == [f"start {token}"]
    wait_free(client, key)
    assert worker.alive()
    pinged = uuid.uuid4().hex[:10]
    for _ in range(4):
        app.ping.send(pinged)
    wait_events(client, pinged, 4, "the worker's next messages")
