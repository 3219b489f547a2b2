"""joblock.rq with real RQ workers (the forking Worker and SimpleWorker) on real Redis.

The module runs once per (core twin, worker class) pair: two workers of that class
(one job at a time each, so two are needed for jobs to overlap) with the scheduler,
on that twin (JOBLOCK_NO_EXTENSIONS=1 for the pure one); the test process enqueues
through Locks on the same twin. Jobs (tests/rq_jobs.py) write events to a Redis list
per test run; tests read them, the lock keys and their PTTL, and the workers' logs.
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

import pytest
import redis
from rq import Queue, Retry
from rq.job import Job

import rq_jobs as jobs
from conftest import TWINS, locks_class
from joblock import LockNotAcquired, Locks, lost
from joblock._tools import admin
from joblock._tools.servers import RedisServer
from joblock.rq import RESCHEDULED_AS, enqueue, enqueue_in, enqueue_many, locked
from workers import TESTS, CountedWrites, Worker, most_at_once, python, wait_for, worker_env

if "c" in TWINS:
    PAIRS = [("c", "Worker"), ("python", "SimpleWorker")]
else:
    PAIRS = [("python", "Worker"), ("python", "SimpleWorker")]
TIMEOUT = 30


def rq_url(redis_server: RedisServer) -> str:
    return redis_server.url.rsplit("/", 1)[0] + "/3"


def rq_worker(twin: str, worker_class: str, redis_server: RedisServer, queue: str, log: Path) -> Worker:
    command = [
        python(), "-m", "rq.cli", "worker", "--url", rq_url(redis_server), "--with-scheduler",
        "--worker-class", f"rq.{worker_class}", "--path", TESTS, "--name", f"{queue}-{uuid.uuid4().hex[:6]}",
        queue,
    ]  # fmt: skip
    return Worker(command, worker_env(twin, redis_server.url), log)


def status(job: Job) -> str:
    """The job's status as text (a JobStatus enum on RQ >= 2, a str before)."""
    found = job.get_status(refresh=True)
    return str(getattr(found, "value", found))


def wait_job(job: Job, timeout: float = TIMEOUT) -> str:
    def done() -> str | None:
        found = status(job)
        return found if found in ("finished", "failed") else None

    return wait_for(done, timeout, f"job {job.id} to end")  # type: ignore[no-any-return]


def final(job: Job, timeout: float = TIMEOUT) -> Job:
    """The job that finally ran for ``job``: it, or the end of its chain of reschedules."""
    while True:
        wait_job(job, timeout)
        job.refresh()
        later = job.meta.get(RESCHEDULED_AS)
        if later is None:
            return job
        job = Job.fetch(later, connection=job.connection)


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{t}-{w}" for t, w in PAIRS])
def pair(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> redis.Redis:
    jobs.configure(redis_server.url)
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture(scope="module")
def locks(pair: tuple[str, str], redis_server: RedisServer, client: redis.Redis) -> Iterator[Locks]:
    locks = locks_class(TWINS[pair[0]])(redis_server.url, prefix=jobs.PREFIX)
    jobs.use_locks(locks)
    yield locks
    locks.close()


@pytest.fixture(scope="module")
def rq_client(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(rq_url(redis_server))


class Workers:
    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    def log(self) -> str:
        return "\n".join(w.log() for w in self.workers)

    def lines(self, run: str, text: str) -> list[str]:
        return [line for line in self.log().splitlines() if run in line and text in line]


@pytest.fixture(scope="module")
def workers(
    pair: tuple[str, str],
    locks: Locks,
    redis_server: RedisServer,
    rq_client: redis.Redis,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Workers]:
    twin, worker_class = pair
    queue = f"joblock-rq-{twin}-{worker_class}"
    logs = tmp_path_factory.mktemp("rq")
    started = [rq_worker(twin, worker_class, redis_server, queue, logs / f"worker-{i}.log") for i in range(2)]
    try:
        ping = Queue(queue, connection=rq_client).enqueue(jobs.ping)
        wait_job(ping, 60)
        yield Workers(started)
    finally:
        for w in started:
            w.stop()
        rq_client.flushdb()  # nothing a test left queued or scheduled reaches the next pair


@pytest.fixture
def queue(workers: Workers, rq_client: redis.Redis, pair: tuple[str, str]) -> Queue:
    return Queue(f"joblock-rq-{pair[0]}-{pair[1]}", connection=rq_client)


@pytest.fixture
def run(workers: Workers) -> Iterator[str]:
    """A fresh id for the test's jobs; the workers' logs of the test are shown if it fails."""
    start = [len(w.log()) for w in workers.workers]
    yield uuid.uuid4().hex[:10]
    for w, n in zip(workers.workers, start):
        print(w.log()[n:][-6000:])


def events(client: redis.Redis, run: str) -> list[str]:
    return [e.decode() for e in client.lrange(f"events:{run}", 0, -1)]


def wait_events(client: redis.Redis, run: str, n: int, what: str) -> list[str]:
    def ready() -> list[str] | None:
        found = events(client, run)
        return found if len(found) >= n else None

    return wait_for(ready, TIMEOUT, what)  # type: ignore[no-any-return]


def starts(items: list[str]) -> int:
    return sum(1 for e in items if e.startswith("start"))


# -- the article's two problems ------------------------------------------------------------


def test_cleanup_runs_one_at_a_time_and_reschedules(queue, run, client, workers):
    """CleanupDataJob on two workers: one cleanup at a time; a job meeting the lock is
    rescheduled (a new job, its id in the old one's meta) until it can run."""
    # Each run takes a second: time enough for the other worker, slow on a busy machine,
    # to take a job and meet the lock (at 0.3 s one worker sometimes ran all three).
    sent = [queue.enqueue(jobs.cleanup_data, user, run, 1) for user in (1, 2, 3)]
    finals = [final(job) for job in sent]
    assert sorted(job.return_value() for job in finals) == ["cleaned 1", "cleaned 2", "cleaned 3"]
    log = events(client, run)
    assert len(log) == 6
    for i in range(0, 6, 2):
        assert log[i].split()[0] == "start" and log[i + 1] == "end " + log[i].split()[1]
    assert any(job.id not in {s.id for s in sent} for job in finals)  # some were rescheduled
    assert workers.lines(run, "rescheduled in")
    assert not client.exists(jobs.cleanup_data.lock_key(1, run, 1))


def test_product_sales_pile_up_runs_once_per_product(queue, run, client, caplog):
    """ProductSalesJob: 100 submissions over 3 products; until_executed enqueues 3 and
    drops 97 duplicates (logged); exactly 3 runs; the locks are free afterwards."""
    caplog.set_level(logging.INFO, logger="joblock")
    # Runs of 2 s: the 100 calls end before the first run does, on a busy machine
    # too (at 0.5 s a run finished mid-burst and its product was sent again).
    submitted = [enqueue(queue, jobs.product_sales, i % 3, run, 2) for i in range(100)]
    sent = [job for job in submitted if job is not None]
    assert len(sent) == 3
    dropped = [r for r in caplog.records if r.getMessage().startswith("Job already queued: ProductSalesJob")]
    assert len(dropped) == 97
    for job in sent:
        assert wait_job(job) == "finished"
    assert sorted(job.return_value() for job in sent) == ["sales 0", "sales 1", "sales 2"]
    assert sorted(e for e in events(client, run) if e.startswith("start")) == [f"start {p}" for p in range(3)]
    for product in range(3):
        assert not client.exists(jobs.product_sales.lock_key(product, run, 2))
    again = enqueue(queue, jobs.product_sales, 0, run, 2)
    assert again is not None and wait_job(again) == "finished"


# -- lifetimes -----------------------------------------------------------------------------


def test_while_executing_locks_the_run_only(queue, run, client, workers):
    # A 3 s run, so the second job meets it running on a busy machine too (a 0.8 s one
    # had ended before the other worker took the second).
    key = jobs.while_executing.lock_key(run, 3)
    first = enqueue(queue, jobs.while_executing, run, 3)
    assert first is not None
    token = wait_events(client, run, 1, "the first run")[0].split()[1]
    assert client.get(key).decode() == token
    second = enqueue(queue, jobs.while_executing, run, 3)
    assert second is not None  # nothing taken at enqueue
    assert wait_job(second) == "finished" and second.return_value() is None  # skipped
    assert wait_job(first) == "finished" and first.return_value() == "done"
    assert starts(events(client, run)) == 1
    assert workers.lines(run, "Job already running: while_executing")
    assert not client.exists(key)


def test_until_executing_frees_the_lock_when_the_run_starts(queue, run, client):
    key = jobs.until_executing.lock_key(run, 0.8)
    first = enqueue_in(queue, 1, jobs.until_executing, run, 0.8)
    assert first is not None
    assert client.pttl(key) > 0
    assert enqueue(queue, jobs.until_executing, run, 0.8) is None  # one copy queued at a time
    assert wait_events(client, run, 1, "the run's start")[0] == "start -"
    assert not client.exists(key)
    during = enqueue(queue, jobs.until_executing, run, 0.8)
    assert during is not None
    assert wait_job(first) == "finished" and wait_job(during) == "finished"
    assert starts(events(client, run)) == 2


def test_until_executed_holds_from_enqueue_to_the_end_of_the_run(queue, run, client):
    key = jobs.until_executed.lock_key(run, 0.8)
    first = enqueue_in(queue, 1, jobs.until_executed, run, 0.8)
    token = client.get(key)
    assert first is not None and token is not None
    assert enqueue(queue, jobs.until_executed, run, 0.8) is None  # while queued
    assert wait_events(client, run, 1, "the run's start")[0] == f"start {token.decode()}"
    assert client.get(key) == token
    assert enqueue(queue, jobs.until_executed, run, 0.8) is None  # while running
    assert wait_job(first) == "finished"
    assert not client.exists(key)
    again = enqueue(queue, jobs.until_executed, run, 0.8)
    assert again is not None and wait_job(again) == "finished"


def test_until_expired_leaves_the_lock_to_its_ttl(queue, run, client):
    key = jobs.until_expired.lock_key(run, 0)
    first = enqueue(queue, jobs.until_expired, run, 0)
    assert first is not None and wait_job(first) == "finished"
    assert events(client, run) == ["start -", "end"]
    assert 0 < client.pttl(key) <= 2000
    assert enqueue(queue, jobs.until_expired, run, 0) is None
    wait_for(lambda: not client.exists(key), 5, "the lock's expiry")
    again = enqueue(queue, jobs.until_expired, run, 0)
    assert again is not None and wait_job(again) == "finished"


# -- conflict strategies -------------------------------------------------------------------


def test_raise_at_run_fails_the_job(queue, run, client, locks):
    with locks.lock(jobs.raising.lock_key(run, 0), ttl=30):
        job = queue.enqueue(jobs.raising, run, 0)
        assert wait_job(job) == "failed"
    assert "LockNotAcquired" in job.latest_result().exc_string
    assert events(client, run) == []


def test_raise_at_enqueue(queue, run, locks):
    with locks.lock(jobs.unique_raising.lock_key(run, 0), ttl=30), pytest.raises(LockNotAcquired):
        enqueue(queue, jobs.unique_raising, run, 0)


def test_callable_decides_and_its_value_is_the_result(queue, run, client, locks):
    with locks.lock(jobs.calling.lock_key(run, 0), ttl=30):
        job = queue.enqueue(jobs.calling, run, 0)
        assert wait_job(job) == "finished"
    assert job.return_value() == f"busy {run}"
    assert events(client, run) == ["busy"]


CAPPED = re.compile(r"rescheduled in ([0-9.]+) s \(attempt (\d) of 3\)")


@pytest.mark.parametrize("then", ["skip", "raise"])
def test_reschedule_backs_off_then_gives_up(queue, run, client, locks, workers, then):
    """Reschedule(delay=0.2, factor=2, max_delay=0.5, jitter=0.5, max_attempts=3): three
    new jobs scheduled 0.1-0.2, 0.2-0.4 and 0.25-0.5 s later, then skip or raise."""
    task = jobs.capped_skip if then == "skip" else jobs.capped_raise
    with locks.lock(task.lock_key(run, 0), ttl=30):
        first = queue.enqueue(task, run, 0)
        chain = [first]
        while True:
            wait_job(chain[-1])
            chain[-1].refresh()
            later = chain[-1].meta.get(RESCHEDULED_AS)
            if later is None:
                break
            chain.append(Job.fetch(later, connection=queue.connection))
    assert len(chain) == 4  # the job and its three reschedules
    if then == "skip":
        assert status(chain[-1]) == "finished" and chain[-1].return_value() is None
    else:
        assert status(chain[-1]) == "failed"
        assert "LockNotAcquired" in chain[-1].latest_result().exc_string
    assert events(client, run) == []
    found = [CAPPED.search(line) for line in workers.lines(run, "rescheduled in")]
    # Two workers' logs: in attempt order, not time order.
    attempts = sorted(((float(m.group(1)), int(m.group(2))) for m in found if m), key=lambda a: a[1])
    assert [a for _, a in attempts] == [1, 2, 3]
    for (countdown, _), base in zip(attempts, (0.2, 0.4, 0.5)):
        assert base / 2 <= countdown <= base
    assert workers.lines(run, "lock still busy after 3 reschedules")


def test_reschedule_at_enqueue_runs_once_the_lock_is_free(queue, run, client, locks):
    key = jobs.queued_reschedule.lock_key(run, 0)
    held = locks.acquire(key, ttl=30)
    job = enqueue(queue, jobs.queued_reschedule, run, 0)
    assert job is not None  # scheduled for later, not dropped
    time.sleep(0.5)
    assert events(client, run) == []
    assert held.release()
    assert final(job).return_value() == "done"
    assert events(client, run)[0] != "start -"
    assert not client.exists(key)


# -- bulk enqueue and bursts ---------------------------------------------------------------


def test_enqueue_many_takes_its_locks_in_one_write(queue, run, client, locks, caplog):
    """20 GatedJobs over 5 items, one whose lock someone holds, one that reschedules, one
    while_executing job: every enqueue lock (all of a 30 s ttl: one batch per ttl) in
    one write to Redis, one job per free item (the duplicates dropped, logged), each
    holding its lock until its run ends."""
    caplog.set_level(logging.INFO, logger="joblock")
    keys = [jobs.gated.lock_key(f"p{n}", run) for n in range(5)]
    held = locks.acquire(jobs.gated.lock_key("p5", run), ttl=30)
    waiting = locks.acquire(jobs.queued_reschedule.lock_key(f"{run}-r", 0), ttl=30)
    datas = [Queue.prepare_data(jobs.gated, (f"p{i % 5}", run)) for i in range(20)]
    datas += [(jobs.gated, ("p5", run)), (jobs.queued_reschedule, (f"{run}-r", 0))]
    datas.append(Queue.prepare_data(jobs.while_executing, (f"{run}-w", 0), meta={"mine": 1}))
    try:
        with CountedWrites(locks) as counted:
            out = enqueue_many(queue, datas)
        assert counted.writes == 1
        assert [job is not None for job in out] == [True] * 5 + [False] * 16 + [True, True]
        dropped = [r for r in caplog.records if r.getMessage().startswith("Job already queued: GatedJob")]
        assert len(dropped) == 16
        # The runs wait for the gate: each lock still holds its job's ticket.
        assert client.mget(keys) == [job.meta["joblock"]["token"].encode("latin-1") for job in out[:5]]
        assert status(out[21]) == "scheduled" and "token" not in out[21].meta["joblock"]
        assert out[22].meta == {"mine": 1}
    finally:
        client.set(jobs.gate(run), 1)
    assert [wait_job(job) for job in [*out[:5], out[22]]] == ["finished"] * 6
    assert sorted(events(client, run)) == [f"run p{n}" for n in range(5)]
    assert client.exists(*keys) == 0
    assert held.release() and waiting.release()
    assert final(out[21]).return_value() == "done"
    assert events(client, f"{run}-r")[0] != "start -"  # rescheduled, it took its lock when it ran


def test_enqueue_many_raising_frees_the_batch_and_enqueues_nothing(queue, run, client, locks):
    keys = [jobs.until_executed.lock_key(run, n) for n in range(3)]
    ids = [f"{run}-{n}" for n in range(4)]
    datas = [Queue.prepare_data(jobs.until_executed, (run, n), job_id=ids[n]) for n in range(3)]
    datas.append(Queue.prepare_data(jobs.unique_raising, (run, 0), job_id=ids[3]))
    with locks.lock(jobs.unique_raising.lock_key(run, 0), ttl=30), pytest.raises(LockNotAcquired):
        enqueue_many(queue, datas)
    assert [client.exists(key) for key in keys] == [0, 0, 0]
    assert [Job.exists(job_id, connection=queue.connection) for job_id in ids] == [False] * 4
    with pytest.raises(TypeError, match=r"decorated with joblock\.rq\.locked"):
        enqueue_many(queue, [(jobs.ping, ())])


def test_enqueue_many_on_a_pipeline_writes_the_jobs_when_it_executes(queue, run, client, locks):
    """Given RQ's pipeline, the locks are taken at once and the jobs go out with it."""
    key = jobs.until_executed.lock_key(run, 0)
    with queue.connection.pipeline() as pipe:
        out = enqueue_many(queue, [(jobs.until_executed, (run, 0)), (jobs.until_executed, (run, 0))], pipe)
        assert out[1] is None and client.exists(key)
        assert not Job.exists(out[0].id, connection=queue.connection)
        pipe.execute()
    assert wait_job(out[0]) == "finished"
    assert not client.exists(key)


THREADS = 6


def test_a_burst_from_threads_runs_each_argument_set_once(queue, run, client):
    """Six threads enqueue the same ten items and two of their own each, in their own
    order, half one by one and half with enqueue_many, all at once: exactly one job
    per item is enqueued and runs (until_executed; the runs wait until the burst is out)."""
    shared = [f"s{n}" for n in range(10)]
    start = threading.Barrier(THREADS)
    sent: list[list[object]] = [[] for _ in range(THREADS)]

    def burst(t: int) -> None:
        items = shared + [f"t{t}-{n}" for n in range(2)]
        random.Random(t).shuffle(items)
        start.wait(10)
        if t % 2:
            sent[t] = [enqueue(queue, jobs.gated, item, run) for item in items]
        else:
            sent[t] = enqueue_many(queue, [(jobs.gated, (item, run)) for item in items])

    threads = [threading.Thread(target=burst, args=(t,)) for t in range(THREADS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        client.set(jobs.gate(run), 1)
    enqueued = [job for each in sent for job in each if job is not None]
    everything = shared + [f"t{t}-{n}" for t in range(THREADS) for n in range(2)]
    assert sum(len(each) for each in sent) == THREADS * 12
    assert len(enqueued) == len(everything)
    assert [wait_job(job) for job in enqueued] == ["finished"] * len(everything)
    runs = collections.Counter(e.split()[1] for e in events(client, run))
    assert runs == collections.Counter(everything)


# -- retries and crashes -------------------------------------------------------------------


def test_retry_keeps_its_lock(queue, run, client):
    """A failed job with retries left keeps its lock through the interval: the retried
    run adopts the same token (no conflict with itself), a duplicate run in between is
    skipped, and the lock goes after the final run."""
    key = jobs.retrying.lock_key(run)
    job = queue.enqueue(jobs.retrying, run, retry=Retry(max=1, interval=2))
    token = wait_events(client, run, 1, "the first try")[0].split()[2]
    wait_for(lambda: status(job) == "scheduled", TIMEOUT, "the retry to be scheduled")
    assert client.get(key).decode() == token  # held between the tries
    duplicate = queue.enqueue(jobs.retrying, run)
    assert wait_job(duplicate) == "finished" and duplicate.return_value() is None
    assert wait_job(job) == "finished" and job.return_value() == "retried"
    assert events(client, run) == [f"try 0 {token}", f"try 1 {token}"]
    assert not client.exists(key)


def test_killed_worker_lock_frees_at_its_ttl(pair, run, client, rq_client, redis_server, tmp_path):
    """SIGKILL to the worker's process group (worker, work horse, scheduler) mid-job:
    the lock stays with the dead run's token until its ttl (3 s), never less."""
    twin, worker_class = pair
    name = f"joblock-kill-{run}"
    worker = rq_worker(twin, worker_class, redis_server, name, tmp_path / "worker.log")
    try:
        key = jobs.sleeper.lock_key(run)
        Queue(name, connection=rq_client).enqueue(jobs.sleeper, run)
        token = wait_events(client, run, 1, "the job's start")[0].split()[1]
        worker.kill_and_watch_the_lock(client, key, token, ttl=3)
    finally:
        print(worker.report())
        worker.stop()


# -- debounce and limit --------------------------------------------------------------------


def test_a_debounced_burst_runs_once_with_the_last_arguments(queue, run, client, workers):
    """Five enqueues within the window: each is scheduled for later (RQ's scheduler) and
    supersedes the one before; the last one runs, the four others finish without running."""
    sent = [enqueue(queue, jobs.debounced, run, rev) for rev in range(5)]
    assert all(job is not None for job in sent)
    assert [final(job).return_value() for job in sent] == [None, None, None, None, 4]
    assert events(client, run) == ["run 4"]
    wait_for(lambda: len(workers.lines(run, "Job superseded")) == 4, TIMEOUT, "the superseded lines")
    assert final(enqueue(queue, jobs.debounced, run, 5)).return_value() == 5  # a new burst
    assert events(client, run) == ["run 4", "run 5"]


def test_bad_debounce_and_limit_options_are_refused_naming_them(locks):
    for options, words in [
        ({"lifetime": "debounce"}, "lifetime='debounce' needs debounce"),
        ({"debounce": 1}, "debounce is for lifetime='debounce'"),
        ({"limit": 0}, "limit must be between 1 and"),
        ({"lifetime": "debounce", "debounce": 1, "limit": 2}, "limit is for the locking lifetimes"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            locked(locks, ttl=10, **options)(jobs.ping)


def test_limit_sends_that_many_copies_of_a_key_and_runs_them_at_once(queue, run, client):
    """until_executed with limit=2: of a burst of five enqueues (one by one, then through
    enqueue_many) two are sent, each holding a place of the counting lock until its run
    ends; the two workers run them, never more than two at once."""
    key = jobs.limited.lock_key(run, 1.0)
    sent = [enqueue(queue, jobs.limited, run, 1.0) for _ in range(5)]
    assert [job is not None for job in sent] == [True, True, False, False, False]
    assert client.zcard(key) == 3  # two holders and the limit
    for job in sent[:2]:
        assert final(job).return_value() == "done"
    happened = events(client, run)
    assert starts(happened) == 2 and most_at_once(happened) <= 2
    assert not client.exists(key)
    batch = enqueue_many(queue, [(jobs.limited, (run, 0.1))] * 5)
    assert [job is not None for job in batch] == [True, True, False, False, False]
    for job in batch[:2]:
        assert final(job).return_value() == "done"


# -- a lost lock stops the job -------------------------------------------------------------


def test_an_operators_release_stops_the_running_job(pair, queue, run, client, workers, redis_server):
    """``on_lost``: an operator releases the lock of a running job (``joblock release``);
    the forking Worker's work horse exits with EXIT_STATUS after saying why ("exit"), a
    SimpleWorker's job is interrupted with LockLost ("interrupt"). Either way the job's
    work stops (its "end" never comes), RQ fails the job, and the workers go on."""
    job_function = jobs.exits if pair[1] == "Worker" else jobs.interrupted
    job = queue.enqueue(job_function, run)
    key = job_function.lock_key(run)
    token = wait_events(client, run, 1, "the job's start")[0].split()[1]
    assert client.get(key).decode() == token
    assert admin.release(redis_server.url, key) == 0
    assert wait_job(job) == "failed"
    assert events(client, run) == [f"start {token}"]  # stopped: and a dead horse says nothing more
    job.refresh()
    failure = job.latest_result().exc_string if hasattr(job, "latest_result") else job.exc_info
    if pair[1] == "Worker":
        assert f"waitpid returned {lost.EXIT_STATUS << 8}" in failure  # the horse's exit status
        said = f"joblock lost the lock {key!r} (an operator released it): exiting with status 75"
    else:
        assert "LockLost" in failure
        said = f"joblock lost the lock {key!r}: an operator released it"
    wait_for(lambda: said in workers.log(), TIMEOUT, "the worker's log of the loss")
    assert all(w.alive() for w in workers.workers)
    assert wait_job(queue.enqueue(jobs.ping)) == "finished"


def test_a_bad_on_lost_is_refused_when_the_job_is_declared(locks, client):
    name = f"bad-{uuid.uuid4().hex[:8]}"
    for options, error, words in [
        (
            {"on_lost": "nope"},
            ValueError,
            "on_lost must be 'ignore', 'interrupt', 'cancel', 'exit' or a callable",
        ),
        ({"on_lost": "cancel"}, ValueError, "on_lost='cancel' cancels an asyncio task"),
        ({"on_lost": 3}, TypeError, "on_lost must be"),
        ({"on_lost": "exit", "lifetime": "until_executing"}, ValueError, "on_lost is for a run that holds"),
    ]:
        with pytest.raises(error, match=re.escape(words)):
            locked(locks, ttl=10, name=name, **options)(jobs.ping)
    assert client.keys(f"*{name}*") == []
