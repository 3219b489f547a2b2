"""``@locks.job``: resque-lock-timeout's job locks on plain functions and methods.

Every test runs once per core twin (the ``core`` fixture behind ``locks``/``make_locks``)
against the session's real redis-server. Concurrency is real: threads, forked and
spawned processes, each with a witness that counts runs inside the job at once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from contextlib import contextmanager, suppress
from datetime import timedelta

import pytest
import redis

import joblock
from conftest import TWINS, locks_class
from joblock import LockNotAcquired, current_lease


@pytest.fixture
def twin(core):
    """The name of the test's twin, for child processes that build their own Locks."""
    return next(name for name, module in TWINS.items() if module is core)


class Witness:
    """Counts the runs inside a critical section at once, per argument set."""

    def __init__(self):
        self._lock = threading.Lock()
        self.now = Counter()
        self.most = Counter()
        self.runs = Counter()

    @contextmanager
    def inside(self, key):
        with self._lock:
            self.now[key] += 1
            self.most[key] = max(self.most[key], self.now[key])
        try:
            yield
        finally:
            with self._lock:
                self.now[key] -= 1
                self.runs[key] += 1


def wait_for(predicate, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def run_in_thread(fn, *args, **kwargs):
    """Starts fn in a thread; returns (thread, result dict filled when it ends)."""
    out = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the test
            out["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


def job_messages(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.name == "joblock" and r.levelno == level]


# -- keys ---------------------------------------------------------------------------------


def test_default_key_is_one_per_argument_set(locks, raw):
    seen = []

    @locks.job(ttl=5)
    def report(x, flag=False):
        lease = current_lease()
        assert raw.get(lease.key) == lease.token
        seen.append(lease.key)
        return x

    assert report(1) == 1
    assert report(x=1) == 1
    assert report(1, False) == 1
    assert report(1, flag=False) == 1
    assert len(set(seen)) == 1
    assert seen[0] == locks.key(report.__qualname__, 1, False)
    assert seen[0].startswith(f"{locks.prefix}:{report.__qualname__}:")
    assert report.lock_key(x=1) == report.lock_key(1) == seen[0]
    # Different arguments: different locks.
    assert report.lock_key(2) != seen[0]
    assert report.lock_key(1, True) != seen[0]
    assert report.lock_key("1") != seen[0]
    assert raw.exists(seen[0]) == 0


def test_keyword_only_defaults_are_part_of_the_key(locks):
    @locks.job(ttl=5)
    def sync(repo_id, *, full=False):
        return current_lease().key

    assert sync(7) == sync(7, full=False) == sync(repo_id=7)
    assert sync(7, full=True) != sync(7)


def test_argument_sets_lock_independently(locks):
    ran = []
    inner = [((1,), {}), ((1, False), {}), ((), {"x": 1}), ((2,), {}), ((1, True), {})]

    @locks.job(ttl=5)
    def job(x, flag=False):
        ran.append((x, flag))
        if len(ran) == 1:
            return [job(*args, **kwargs) for args, kwargs in inner]
        return "ran"

    # While job(1) runs: the same argument set (however it is spelled) is skipped,
    # other sets run.
    assert job(1) == [None, None, None, "ran", "ran"]
    assert ran == [(1, False), (2, False), (1, True)]


def test_name_sets_the_job_part_of_the_key(locks):
    @locks.job(ttl=5, name="ProductSalesJob")
    def fetch(product_id):
        return current_lease().key

    assert fetch(42) == f"{locks.prefix}:ProductSalesJob:42" == locks.key("ProductSalesJob", 42)
    assert fetch.__name__ == "fetch"  # the function keeps its own name


def test_identifier_none_gives_one_lock_for_the_whole_job(locks):
    @locks.job(ttl=5, name="UpdateNetworkGraph", identifier=lambda repo_id, nested=None: None)
    def update(repo_id, nested=None):
        if nested is not None:
            return update(nested)
        return current_lease().key

    assert update(1) == update(2) == f"{locks.prefix}:UpdateNetworkGraph"
    assert update(1, nested=2) is None  # another repo, same lock: busy


def test_identifier_value_and_tuple(locks):
    @locks.job(ttl=5, name="J", identifier=lambda account, day, verbose=False: account)
    def by_account(account, day, verbose=False):
        return current_lease().key

    assert by_account("acme", "mon") == by_account("acme", "tue", verbose=True) == f"{locks.prefix}:J:acme"

    @locks.job(ttl=5, name="J", identifier=lambda account, day, verbose=False: (account, day))
    def by_day(account, day, verbose=False):
        return current_lease().key

    assert by_day("acme", "mon") == by_day("acme", "mon", True) == locks.key("J", "acme", "mon")
    assert by_day("acme", "mon") == f"{locks.prefix}:J:acme-mon"
    assert by_day("acme", "tue") != by_day("acme", "mon")
    assert by_day.lock_key("acme", "mon") == locks.key("J", "acme", "mon")


def test_identifier_lock_is_shared_by_calls_with_the_same_identifier(locks):
    @locks.job(ttl=5, identifier=lambda account, day: account)
    def bill(account, day):
        if day == "mon":
            return bill(account, "tue"), bill("other", "tue")
        return "billed"

    assert bill("acme", "mon") == (None, "billed")


def test_key_overrides_the_whole_key(locks, raw):
    @locks.job(ttl=5, key=lambda user_id: f"cleanup_data_job_lock:{user_id}")
    def cleanup(user_id):
        lease = current_lease()
        assert raw.get("cleanup_data_job_lock:7") == lease.token
        return lease.key

    try:
        assert cleanup(7) == "cleanup_data_job_lock:7"  # no prefix, no job name
        assert cleanup.lock_key(7) == "cleanup_data_job_lock:7"
        holder = locks.acquire("cleanup_data_job_lock:7", 5)
        assert cleanup(7) is None
        assert holder.release() is True
    finally:
        raw.delete("cleanup_data_job_lock:7")


def test_key_override_may_be_bytes(locks, raw):
    key = f"{locks.prefix}:raw\xff".encode("latin-1")

    @locks.job(ttl=5, key=lambda: key)
    def job():
        assert raw.get(key) == current_lease().token
        return current_lease().key

    assert job() == key
    assert raw.exists(key) == 0


def test_invalid_options_are_refused(locks):
    with pytest.raises(ValueError, match="ttl"):
        locks.job(ttl=0)
    with pytest.raises(TypeError, match="ttl"):
        locks.job(ttl="5")
    with pytest.raises(ValueError, match="wait"):
        locks.job(ttl=5, wait=-1)
    with pytest.raises(ValueError, match="on_locked"):
        locks.job(ttl=5, on_locked="retry")
    with pytest.raises(TypeError, match="identifier"):
        locks.job(ttl=5, identifier="repo_id")
    with pytest.raises(TypeError, match="on_expired"):
        locks.job(ttl=5, on_expired=1)
    with pytest.raises(ValueError, match="identifier or key"):
        locks.job(ttl=5, identifier=lambda: 1, key=lambda: "k")


# -- on_locked ---------------------------------------------------------------------------


def test_on_locked_skip_logs_and_returns_none(locks, caplog):
    caplog.set_level(logging.INFO, logger="joblock")
    ran = []

    @locks.job(ttl=5, name="ProductSalesJob")
    def fetch(product_id, currency="EUR"):
        ran.append(product_id)
        return "fetched"

    holder = locks.acquire(fetch.lock_key(101), 5)
    try:
        assert fetch(101) is None
        assert fetch(101, currency="EUR") is None
        assert fetch(102) == "fetched"
    finally:
        holder.release()
    assert ran == [102]
    assert job_messages(caplog) == [
        "Job already running: ProductSalesJob with 101",
        "Job already running: ProductSalesJob with 101, currency='EUR'",
    ]


def test_on_locked_skip_logs_a_job_without_arguments(locks, caplog):
    caplog.set_level(logging.INFO, logger="joblock")

    @locks.job(ttl=5, name="Nightly", on_locked="skip")
    def nightly():
        return nightly()

    assert nightly() is None
    assert job_messages(caplog) == ["Job already running: Nightly with no arguments"]


def test_on_locked_raise(locks):
    ran = []

    @locks.job(ttl=5, on_locked="raise")
    def job(x):
        ran.append(x)

    holder = locks.acquire(job.lock_key(1), 5)
    try:
        with pytest.raises(LockNotAcquired) as info:
            job(1)
        assert isinstance(info.value, joblock.JoblockError)
        job(2)
    finally:
        holder.release()
    assert ran == [2]
    job(1)
    assert ran == [2, 1]


def test_on_locked_callable_gets_the_arguments_and_its_result_is_returned(locks, caplog):
    caplog.set_level(logging.INFO, logger="joblock")
    calls = []

    def busy(*args, **kwargs):
        calls.append((args, kwargs))
        return "busy", args

    @locks.job(ttl=5, on_locked=busy)
    def job(x, flag=False):
        return "ran"

    holder = locks.acquire(job.lock_key(1, flag=True), 5)
    try:
        assert job(1, flag=True) == ("busy", (1,))
        assert job(1) == "ran"
    finally:
        holder.release()
    assert calls == [((1,), {"flag": True})]
    assert job_messages(caplog) == []  # the callable decides; nothing logged


def test_on_locked_callable_re_enqueues_the_job(locks):
    queue = []

    def reenqueue(user_id):
        queue.append(user_id)

    @locks.job(ttl=5, name="CleanupDataJob", identifier=lambda user_id: None, on_locked=reenqueue)
    def cleanup(user_id):
        return f"cleaned {user_id}"

    holder = locks.acquire(locks.key("CleanupDataJob"), 5)
    assert cleanup(1) is None
    assert cleanup(2) is None
    assert queue == [1, 2]
    holder.release()
    assert [cleanup(queue.pop(0)) for _ in range(2)] == ["cleaned 1", "cleaned 2"]
    assert queue == []


def test_wait_retries_until_the_holder_releases(locks):
    @locks.job(ttl=5, wait=3)
    def patient(x):
        return "ran"

    @locks.job(ttl=5, wait=0.1)
    def hasty(x):
        return "ran"

    holder = locks.acquire(patient.lock_key(1), 5)
    assert hasty.lock_key(1) != patient.lock_key(1)
    assert locks.acquire(hasty.lock_key(1), 5) is not None  # held until it expires
    assert hasty(1) is None  # gave up after 0.1 s
    timer = threading.Timer(0.2, holder.release)
    timer.start()
    try:
        assert patient(1) == "ran"
        assert holder.held is False
    finally:
        timer.join()


# -- release and on_expired --------------------------------------------------------------


def test_lock_is_released_when_the_job_returns(locks, raw):
    keys = []

    @locks.job(ttl=5)
    def job(x):
        keys.append(current_lease().key)
        assert raw.exists(keys[-1]) == 1
        return x * 2

    assert job(21) == 42
    assert raw.exists(keys[0]) == 0
    assert job(21) == 42  # free again


def test_lock_is_released_when_the_job_raises(locks, raw):
    expired = []

    @locks.job(ttl=5, on_expired=lambda *a: expired.append(a))
    def job(x):
        raise RuntimeError(f"failed {x}")

    with pytest.raises(RuntimeError, match="failed 3"):
        job(3)
    assert raw.exists(job.lock_key(3)) == 0
    assert expired == []
    lease = locks.acquire(job.lock_key(3), 5)
    assert lease is not None
    lease.release()


def test_on_expired_called_when_the_lock_expired_before_release(locks, raw, caplog):
    expired = []

    @locks.job(ttl=0.2, on_expired=lambda *args, **kwargs: expired.append((args, kwargs)))
    def slow(x, flag=False):
        key = current_lease().key
        assert wait_for(lambda: raw.exists(key) == 0)
        return "done"

    assert slow(5, flag=True) == "done"
    assert expired == [((5,), {"flag": True})]
    assert job_messages(caplog, logging.WARNING) == []  # the callback replaces the warning


def test_on_expired_called_when_another_holder_took_the_lock_and_its_lock_survives(make_locks, raw):
    locks = make_locks()
    other = make_locks()
    expired = []
    theirs = []

    @locks.job(ttl=5, on_expired=expired.append)
    def job(x):
        key = current_lease().key
        raw.delete(key)  # as if it had expired
        theirs.append(other.acquire(key, 5))
        assert theirs[0] is not None
        return "done"

    assert job(9) == "done"
    assert expired == [9]
    # The job's release did not delete the other holder's lock.
    assert raw.get(theirs[0].key) == theirs[0].token
    assert theirs[0].release() is True


def test_expired_without_callback_logs_a_warning(locks, raw, caplog):
    @locks.job(ttl=0.2, name="Slow")
    def slow():
        key = current_lease().key
        assert wait_for(lambda: raw.exists(key) == 0)

    slow()
    warnings = job_messages(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert "Slow" in warnings[0] and "expired or was taken" in warnings[0]


def test_on_expired_also_runs_when_the_job_raises(locks, raw):
    expired = []

    @locks.job(ttl=0.2, on_expired=expired.append)
    def slow(x):
        key = current_lease().key
        assert wait_for(lambda: raw.exists(key) == 0)
        raise KeyError(x)

    with pytest.raises(KeyError):
        slow(1)
    assert expired == [1]


# -- methods ------------------------------------------------------------------------------


def test_methods_key_on_their_arguments_not_on_self(locks, caplog):
    caplog.set_level(logging.INFO, logger="joblock")

    class Repo:
        def __init__(self, name):
            self.name = name

        @locks.job(ttl=5)
        def sync(self, repo_id, full=False):
            return self.name, current_lease().key

    name = Repo.sync.__qualname__
    assert name.endswith("Repo.sync")
    a, b = Repo("a"), Repo("b")
    assert a.sync(7) == ("a", locks.key(name, 7, False))
    assert b.sync(7) == ("b", locks.key(name, 7, False))
    holder = locks.acquire(Repo.sync.lock_key(a, 7), 5)
    try:
        assert b.sync(7) is None  # another instance, same arguments: same lock
        assert b.sync(8) == ("b", locks.key(name, 8, False))
    finally:
        holder.release()
    assert job_messages(caplog) == [f"Job already running: {name} with 7"]


def test_classmethods_key_on_their_arguments_not_on_cls(locks):
    class Feed:
        @classmethod
        @locks.job(ttl=5, name="Feed.refresh")
        def refresh(cls, feed_id):
            return cls.__name__, current_lease().key

    class SubFeed(Feed):
        pass

    assert Feed.refresh(3) == ("Feed", f"{locks.prefix}:Feed.refresh:3")
    assert SubFeed.refresh(3) == ("SubFeed", f"{locks.prefix}:Feed.refresh:3")


def test_method_on_locked_callable_gets_self(locks):
    class Importer:
        def __init__(self):
            self.requeued = []

        def later(self, source):
            self.requeued.append(source)
            return "later"

        @locks.job(ttl=5, on_locked=lambda self, source: self.later(source))
        def run(self, source):
            return "imported"

    importer = Importer()
    holder = locks.acquire(Importer.run.lock_key(importer, "s3"), 5)
    try:
        assert importer.run("s3") == "later"
    finally:
        holder.release()
    assert importer.requeued == ["s3"]
    assert importer.run("s3") == "imported"


# -- current_lease and fencing -----------------------------------------------------------


def test_current_lease_inside_and_outside_a_job(locks):
    assert current_lease() is None
    seen = []

    @locks.job(ttl=5)
    def job(x):
        lease = current_lease()
        seen.append(lease)
        assert lease.held is True
        assert lease.key == job.lock_key(x)
        return lease

    lease = job(1)
    assert seen == [lease]
    assert lease.held is False
    assert current_lease() is None


def test_nested_jobs_restore_the_outer_lease(locks):
    @locks.job(ttl=5, name="Inner")
    def inner():
        return current_lease().key

    @locks.job(ttl=5, name="Failing")
    def failing():
        raise ValueError

    @locks.job(ttl=5, name="Outer")
    def outer():
        mine = current_lease()
        assert mine.key == locks.key("Outer")
        assert inner() == locks.key("Inner")
        assert current_lease() is mine
        with pytest.raises(ValueError):
            failing()
        assert current_lease() is mine
        return True

    assert outer() is True
    assert current_lease() is None


def test_current_lease_belongs_to_the_running_thread(locks):
    other = []

    @locks.job(ttl=5)
    def job():
        thread = threading.Thread(target=lambda: other.append(current_lease()))
        thread.start()
        thread.join()
        return current_lease()

    assert job() is not None
    assert other == [None]


def test_fence_exposes_a_growing_fencing_number(locks):
    @locks.job(ttl=5, fence=True)
    def write(x):
        return current_lease().fence

    first = write(1)
    second = write(1)
    assert isinstance(first, int) and isinstance(second, int)
    assert second > first
    other = write(2)  # another key: a number from its own slot's counter
    assert isinstance(other, int) and other >= 1

    @locks.job(ttl=5)
    def unfenced():
        return current_lease().fence

    assert unfenced() is None


# -- auto_renew ---------------------------------------------------------------------------


def renewers():
    return [t for t in threading.enumerate() if t.name == "joblock-renewer"]


@pytest.mark.parametrize("ttl", [0.5, timedelta(milliseconds=500)], ids=["seconds", "timedelta"])
def test_auto_renew_keeps_the_lock_alive_past_its_ttl(locks, raw, ttl):
    expired = []
    samples = []

    @locks.job(ttl=ttl, auto_renew=True, on_expired=expired.append)
    def long_job(x):
        lease = current_lease()
        end = time.monotonic() + 1.6  # over three ttls
        while time.monotonic() < end:
            samples.append((raw.get(lease.key) == lease.token, raw.pttl(lease.key)))
            time.sleep(0.05)
        return lease

    lease = long_job(1)
    assert len(samples) > 5
    assert all(ours for ours, _ in samples)
    assert all(0 < pttl <= 500 for _, pttl in samples)
    assert expired == []
    assert lease.held is False
    assert raw.exists(lease.key) == 0


def test_without_auto_renew_the_same_job_loses_its_lock(locks, raw):
    expired = []

    @locks.job(ttl=0.3, on_expired=expired.append)
    def long_job(x):
        key = current_lease().key
        assert wait_for(lambda: raw.exists(key) == 0)

    long_job(1)
    assert expired == [1]


def test_one_renewer_thread_serves_many_auto_renewed_jobs(locks, raw):
    workers = 10
    before_renewers = set(renewers())
    before_threads = len(threading.enumerate())
    started = threading.Semaphore(0)
    finish = threading.Event()
    keys = []

    @locks.job(ttl=0.5, auto_renew=True)
    def long_job(i):
        keys.append(current_lease().key)
        started.release()
        assert finish.wait(10)
        return raw.pttl(current_lease().key)

    threads = [run_in_thread(long_job, i) for i in range(workers)]
    try:
        for _ in range(workers):
            assert started.acquire(timeout=10)
        counts = []
        end = time.monotonic() + 1.2  # several renewals of every lease
        while time.monotonic() < end:
            counts.append(len([t for t in renewers() if t not in before_renewers]))
            assert len(threading.enumerate()) <= before_threads + workers + 1
            time.sleep(0.05)
        assert set(counts) == {1}
        assert all(raw.pttl(key) > 0 for key in keys)
    finally:
        finish.set()
        for thread, _ in threads:
            thread.join()
    results = [out for _, out in threads]
    assert all("error" not in out for out in results), results
    assert all(out["value"] > 0 for out in results)
    assert all(raw.exists(key) == 0 for key in keys)


def test_on_lost_called_and_warning_logged_when_the_lock_is_deleted(locks, raw, caplog):
    lost = threading.Event()
    lost_args = []
    expired = []

    def on_lost(*args, **kwargs):
        lost_args.append((args, kwargs))
        lost.set()

    # A ttl long enough for a renewal to find the key gone before the lease's deadline
    # passes on a busy machine: lost by its deadline, the lease would still say held.
    @locks.job(ttl=1.5, auto_renew=True, on_lost=on_lost, on_expired=lambda *a, **k: expired.append(a))
    def long_job(x, flag=False):
        lease = current_lease()
        raw.delete(lease.key)  # `joblock release`, or an operator's DEL
        assert lost.wait(3)
        assert lease.held is False  # marked lost
        return "finished"

    assert long_job(4, flag=True) == "finished"
    assert lost_args == [((4,), {"flag": True})]
    assert expired == [(4,)]
    warnings = [m for m in job_messages(caplog, logging.WARNING) if "lost the lock" in m]
    assert len(warnings) == 1
    assert repr(long_job.lock_key(4, flag=True)) in warnings[0]


def test_on_lost_when_another_holder_takes_the_lock_which_survives(make_locks, raw):
    locks = make_locks()
    other = make_locks()
    lost = threading.Event()
    theirs = []

    @locks.job(ttl=0.3, auto_renew=True, on_lost=lambda x: lost.set())
    def long_job(x):
        key = current_lease().key
        raw.delete(key)
        theirs.append(other.acquire(key, 5))
        assert lost.wait(3)

    long_job(1)
    assert raw.get(theirs[0].key) == theirs[0].token
    assert theirs[0].release() is True


def test_auto_renew_stops_after_the_job(locks, raw):
    @locks.job(ttl=0.3, auto_renew=True)
    def short(x):
        return current_lease()

    lease = short(1)
    assert lease.held is False
    # A later holder of the same key is not extended by the finished job's renewer.
    other = locks.acquire(lease.key, 0.3)
    assert wait_for(lambda: raw.exists(lease.key) == 0)
    assert other.release() is False


# -- real concurrency: threads -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["skip", "wait"])
def test_threads_hammering_one_job_run_at_most_once_per_argument_set(locks, mode):
    workers, calls, products = 6, 12, (101, 102, 103)
    witness = Witness()
    skipped = Counter()
    gate = threading.Barrier(workers)

    skip_lock = threading.Lock()

    def on_locked(product_id):
        with skip_lock:
            skipped[product_id] += 1
        return "skipped"

    @locks.job(ttl=5, name="ProductSalesJob", on_locked=on_locked, wait=10 if mode == "wait" else None)
    def fetch(product_id):
        with witness.inside(product_id):
            time.sleep(0.002)
        return "ran"

    results = []
    results_lock = threading.Lock()

    def worker(n):
        gate.wait()
        for i in range(calls):
            result = fetch(products[(n + i) % len(products)])
            with results_lock:
                results.append(result)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == workers * calls
    assert max(witness.most.values()) == 1
    assert sum(witness.runs.values()) + sum(skipped.values()) == workers * calls
    assert results.count("ran") == sum(witness.runs.values())
    if mode == "wait":
        assert skipped == Counter()
        assert sum(witness.runs.values()) == workers * calls
    else:
        assert all(witness.runs[p] >= 1 for p in products)


# -- real concurrency: processes ---------------------------------------------------------


def contend(url, prefix, twin, calls, wait):
    """A worker process: its own Locks on the named twin; the witness lives in Redis."""
    locks = locks_class(TWINS[twin])(url, prefix=prefix)
    client = redis.Redis.from_url(url)

    def skipped(product_id):
        client.incr(f"{prefix}:skipped")

    @locks.job(ttl=5, name="ProcJob", on_locked=skipped, wait=wait)
    def job(product_id):
        if client.incr(f"{prefix}:inside:{product_id}") > 1:
            client.incr(f"{prefix}:overlaps")
        time.sleep(0.005)
        client.decr(f"{prefix}:inside:{product_id}")
        client.incr(f"{prefix}:runs")
        client.rpush(f"{prefix}:pids", os.getpid())

    for i in range(calls):
        job(i % 2)
    locks.close()
    client.close()


def check_contention(raw, prefix, processes, calls, wait):
    runs = int(raw.get(f"{prefix}:runs") or 0)
    skipped = int(raw.get(f"{prefix}:skipped") or 0)
    assert raw.get(f"{prefix}:overlaps") is None
    assert runs + skipped == processes * calls
    assert runs >= 1
    if wait is not None:
        assert runs == processes * calls
        assert len(set(raw.lrange(f"{prefix}:pids", 0, -1))) == processes
    assert raw.keys(f"{prefix}:ProcJob*") == []


@pytest.mark.parametrize(("method", "wait"), [("fork", 10), ("fork", None), ("spawn", 10)])
def test_processes_contending_run_at_most_once_per_argument_set(locks, raw, redis_server, twin, method, wait):
    processes, calls = 3, 8
    context = multiprocessing.get_context(method)
    children = [
        context.Process(target=contend, args=(redis_server.url, locks.prefix, twin, calls, wait))
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [child.exitcode for child in children] == [0] * processes
    check_contention(raw, locks.prefix, processes, calls, wait)


def test_forked_children_share_their_parents_locks_object(locks, raw):
    """os.fork after the parent used its Locks: each child reuses the object safely."""
    processes, calls = 3, 8
    prefix = locks.prefix

    @locks.job(ttl=5, name="ProcJob", wait=10)
    def job(product_id):
        if raw.incr(f"{prefix}:inside:{product_id}") > 1:
            raw.incr(f"{prefix}:overlaps")
        time.sleep(0.005)
        raw.decr(f"{prefix}:inside:{product_id}")
        raw.incr(f"{prefix}:runs")
        raw.rpush(f"{prefix}:pids", os.getpid())
        return current_lease()

    parent_lease = job(0)  # the parent's pool now holds a connection
    raw.delete(f"{prefix}:runs", f"{prefix}:pids")
    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                raw.connection_pool.reset()  # redis-py's own fork handling, made explicit
                for i in range(calls):
                    job(i % 2)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    check_contention(raw, prefix, processes, calls, 10)
    # The parent's own connections were not disturbed by the children.
    assert job(1).key == locks.key("ProcJob", 1)
    assert parent_lease.held is False


def auto_renewed_child(url, prefix, twin, started):
    locks = locks_class(TWINS[twin])(url, prefix=prefix)

    # A ttl that a renewal a few hundred ms late (a busy machine) still outlives.
    @locks.job(ttl=1, name="Long", auto_renew=True)
    def long_job():
        started.set()
        time.sleep(30)

    long_job()


def test_a_crashed_workers_lock_expires_at_its_ttl(locks, raw, redis_server, twin):
    """resque-lock-timeout's point: a killed worker's lock frees itself; nothing renews it."""
    started = multiprocessing.get_context("fork").Event()
    child = multiprocessing.get_context("fork").Process(
        target=auto_renewed_child, args=(redis_server.url, locks.prefix, twin, started)
    )
    child.start()
    try:
        assert started.wait(10)
        key = locks.key("Long")
        time.sleep(1.2)  # past the ttl
        assert raw.exists(key) == 1  # renewed while the worker lives
        child.kill()
        child.join(10)
        assert wait_for(lambda: raw.exists(key) == 0, timeout=5)
    finally:
        child.kill()
        child.join(10)

    @locks.job(ttl=5, name="Long")
    def long_job():
        return "ran"

    assert long_job() == "ran"


def crashing_parent(url, prefix, twin):
    """Holds an auto-renewed lock and forks a child that runs its own auto-renewed job."""
    locks = locks_class(TWINS[twin])(url, prefix=prefix)
    client = redis.Redis.from_url(url)

    # Ttls that a renewal a few hundred ms late (a busy machine) still outlives.
    @locks.job(ttl=1, name="Child", auto_renew=True)
    def child_job():
        time.sleep(10)

    @locks.job(ttl=1, name="Parent", auto_renew=True)
    def parent_job():
        pid = os.fork()
        if pid == 0:  # the grandchild
            try:
                child_job()
            finally:
                os._exit(0)
        client.set(f"{prefix}:grandchild", pid)
        time.sleep(30)

    parent_job()


def test_a_forked_child_does_not_renew_its_parents_locks(locks, raw, redis_server, twin):
    """The renewer forgets inherited leases: a crashed parent's lock expires though its child lives."""
    parent = os.fork()
    if parent == 0:  # pragma: no cover - the parent worker, killed below
        try:
            crashing_parent(redis_server.url, locks.prefix, twin)
        finally:
            os._exit(1)
    grandchild = None
    try:
        assert wait_for(lambda: raw.exists(f"{locks.prefix}:grandchild"), timeout=10)
        grandchild = int(raw.get(f"{locks.prefix}:grandchild"))
        assert wait_for(lambda: raw.exists(locks.key("Child")) == 1)
        time.sleep(1.2)  # past both ttls: each process renews its own lock
        assert raw.exists(locks.key("Parent")) == 1
        os.kill(parent, signal.SIGKILL)
        os.waitpid(parent, 0)
        parent = None
        assert wait_for(lambda: raw.exists(locks.key("Parent")) == 0, timeout=5)
        assert raw.exists(locks.key("Child")) == 1  # the child still renews its own lock
    finally:
        for pid in (parent, grandchild):
            if pid is not None:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if parent is not None:
            os.waitpid(parent, 0)


# -- the Rails article's two problems ----------------------------------------------------


class DelayQueue:
    """A small delayed job queue with worker threads, standing in for Sidekiq."""

    def __init__(self):
        self.cond = threading.Condition()
        self.items = []
        self.busy = 0

    def put(self, fn, *args, delay=0.0):
        with self.cond:
            self.items.append((time.monotonic() + delay, fn, args))
            self.cond.notify_all()

    def work(self):
        while True:
            with self.cond:
                while True:
                    now = time.monotonic()
                    ready = [item for item in self.items if item[0] <= now]
                    if ready:
                        item = min(ready, key=lambda item: item[0])
                        self.items.remove(item)
                        self.busy += 1
                        break
                    if not self.items and not self.busy:
                        self.cond.notify_all()
                        return
                    self.cond.wait(0.02)
            try:
                item[1](*item[2])
            finally:
                with self.cond:
                    self.busy -= 1
                    self.cond.notify_all()

    def run(self, workers):
        threads = [threading.Thread(target=self.work) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)


def test_cleanup_data_job_runs_one_at_a_time_and_re_enqueues(locks):
    """Problem 1: one user's cleanup at a time; a busy run comes back later."""
    queue = DelayQueue()
    witness = Witness()
    cleaned = []
    requeued = Counter()

    def reenqueue(user_id):
        requeued[user_id] += 1
        queue.put(cleanup_data_job, user_id, delay=0.05)  # the article: 2 minutes

    @locks.job(ttl=300, name="CleanupDataJob", identifier=lambda user_id: None, on_locked=reenqueue)
    def cleanup_data_job(user_id):
        with witness.inside("all"):
            time.sleep(0.05)
            cleaned.append(user_id)

    # Deterministic part: while someone holds the cleanup lock, a run is re-enqueued.
    holder = locks.acquire(locks.key("CleanupDataJob"), 5)
    assert cleanup_data_job(99) is None
    assert requeued == Counter({99: 1})
    holder.release()
    queue.items.clear()
    requeued.clear()

    for user_id in range(1, 6):
        queue.put(cleanup_data_job, user_id)
    queue.run(workers=5)
    assert sorted(cleaned) == [1, 2, 3, 4, 5]  # every user cleaned exactly once, in the end
    assert witness.most["all"] == 1


def test_product_sales_job_skips_duplicates_per_product(locks, caplog):
    """Problem 2: one run per product at a time; duplicates are skipped, not retried."""
    caplog.set_level(logging.INFO, logger="joblock")
    witness = Witness()
    entered = threading.Event()
    finish = threading.Event()

    @locks.job(ttl=300, name="ProductSalesJob")
    def product_sales_job(product_id, block=False):
        with witness.inside(product_id):
            if block:
                entered.set()
                assert finish.wait(10)
            else:
                time.sleep(0.002)
        return product_id

    # Deterministic part: product 101 is running; 101 is skipped, 102 runs.
    thread, out = run_in_thread(product_sales_job, 101, block=True)
    try:
        assert entered.wait(10)
        assert product_sales_job(101, block=True) is None
        assert product_sales_job(102) == 102
    finally:
        finish.set()
        thread.join()
    assert out == {"value": 101}
    assert job_messages(caplog) == ["Job already running: ProductSalesJob with 101, block=True"]

    # A burst of 100 jobs for 3 products on 8 worker threads.
    caplog.clear()
    queue = DelayQueue()
    for i in range(100):
        queue.put(product_sales_job, (101, 102, 103)[i % 3], delay=i * 0.001)
    witness.runs.clear()
    queue.run(workers=8)
    skipped = job_messages(caplog)
    assert max(witness.most.values()) == 1
    assert sum(witness.runs.values()) + len(skipped) == 100
    assert set(skipped) <= {f"Job already running: ProductSalesJob with {p}" for p in (101, 102, 103)}
