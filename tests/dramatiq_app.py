"""The Dramatiq broker and actors of tests/test_dramatiq.py, imported by the test and by its workers.

The broker, its queues on db 4 of the Redis in JOBLOCK_TEST_REDIS, is set up at import,
so the test sets that variable before importing this module. Locks and events live on
db 0. The test process swaps in Locks on its own core twin with ``use_locks``; workers
pick their twin with JOBLOCK_NO_EXTENSIONS. Actors write what they do to the Redis list
``events:<run>``, ``run`` being a per-test id.
"""

from __future__ import annotations

import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.results import Results
from dramatiq.results.backends.redis import RedisBackend

import joblock
from job_state import JobState
from joblock import current_lease
from joblock.dramatiq import LockMiddleware
from joblock.frameworks import Reschedule

PREFIX = "jd"
URL = os.environ["JOBLOCK_TEST_REDIS"]

_state = JobState(PREFIX)
configure, use_locks, get_locks, note = _state.configure, _state.use_locks, _state.get_locks, _state.note
gate = _state.gate
configure(URL)

middleware = LockMiddleware(get_locks)
broker = RedisBroker(url=URL.rsplit("/", 1)[0] + "/4", namespace="joblock-dramatiq")
# No socket timeout for the results: redis-py 8.2 reads with 5 s unless told otherwise,
# and a test waiting longer for a result (a busy machine's reschedules) met its TimeoutError.
results = redis.Redis.from_url(URL.rsplit("/", 1)[0] + "/4", socket_timeout=None)
broker.add_middleware(Results(backend=RedisBackend(client=results)))
broker.add_middleware(middleware)
dramatiq.set_broker(broker)


@dramatiq.actor
def ping(run: str) -> None:
    note(run, joblock.implementation)


# -- the article ---------------------------------------------------------------------------


@dramatiq.actor(
    lock_ttl=30,
    lock_name="CleanupDataJob",
    lock_identifier=lambda user_id, run, seconds: run,  # one at a time (per test run)
    lock_on_conflict=Reschedule(delay=0.5, factor=2, max_delay=1, max_attempts=30),
    store_results=True,
)
def cleanup_data(user_id: int, run: str, seconds: float) -> str:
    note(run, "start", user_id)
    time.sleep(seconds)
    note(run, "end", user_id)
    return f"cleaned {user_id}"


@dramatiq.actor(lock_ttl=30, lock_name="ProductSalesJob", lock_lifetime="until_executed")
def product_sales(product_id: int, run: str, seconds: float) -> None:
    note(run, "start", product_id)
    time.sleep(seconds)
    note(run, "end", product_id)


# -- lifetimes -----------------------------------------------------------------------------


def _hold(run: str, seconds: float) -> None:
    lease = current_lease()
    note(run, "start", "-" if lease is None else lease.token.decode())
    time.sleep(seconds)
    note(run, "end")


def _lifetime(name: str, ttl: float = 30, **options: object) -> dramatiq.Actor[[str, float], None]:
    return dramatiq.actor(_hold, actor_name=name, lock_ttl=ttl, **options)


while_executing = _lifetime("while_executing")
until_executing = _lifetime("until_executing", lock_lifetime="until_executing")
until_executed = _lifetime("until_executed", lock_lifetime="until_executed")
until_expired = _lifetime("until_expired", 2, lock_lifetime="until_expired")

# -- strategies at the worker --------------------------------------------------------------


def _busy(run: str, seconds: float) -> str:
    note(run, "busy")
    return "busy"


raising = _lifetime("raising", lock_on_conflict="raise")
calling = _lifetime("calling", lock_on_conflict=_busy)


# -- retries, crashes, expiry, bursts ------------------------------------------------------


@dramatiq.actor(lock_ttl=30, max_retries=1, min_backoff=1500, max_backoff=1500)
def retrying(run: str) -> None:
    tries = _state.events.incr(f"tries:{run}") - 1
    note(run, "try", tries, current_lease().token.decode())
    if tries == 0:
        raise RuntimeError("first try fails")


@dramatiq.actor(lock_ttl=3, max_retries=0, queue_name="kill")  # a worker of its own, killed
def sleeper(run: str) -> None:
    note(run, "start", current_lease().token.decode())
    time.sleep(60)


def _expired(run: str, seconds: float) -> None:
    note(run, "expired")


@dramatiq.actor(lock_ttl=1, lock_on_expired=_expired, max_retries=0)
def outlives_its_lock(run: str, seconds: float) -> None:
    note(run, "start")
    time.sleep(seconds)
    note(run, "end")


@dramatiq.actor(lock_ttl=30, lock_lifetime="until_executed", max_retries=0)
def unique(n: int, run: str) -> None:
    _state.until_gate(run)  # held until the whole burst is out
    note(run, "run", n)


@dramatiq.actor(lock_ttl=30, lock_lifetime="until_executed", lock_on_conflict="raise")
def unique_raising(run: str) -> None:
    note(run, "run")


# -- debounce and limit --------------------------------------------------------------------


def _reindex(run: str, rev: int) -> int:
    note(run, "run", rev)
    return rev


def _debounced(name: str, **options: object) -> dramatiq.Actor[[str, int], int]:
    return dramatiq.actor(
        _reindex,
        actor_name=name,
        lock_ttl=30,
        lock_lifetime="debounce",
        lock_debounce=1,
        lock_identifier=lambda run, rev: run,  # one run per test run, of the last send's revision
        store_results=True,
        **options,
    )


debounced = _debounced("debounced")
capped = _debounced("capped", lock_debounce_max=1.5)  # a steady stream runs 1.5 s after it began
# Two copies of one key queued or running at once; the others dropped at send.
limited_queued = _lifetime("limited_queued", lock_lifetime="until_executed", lock_limit=2)
# Two runs of one key at once; a third meeting them is skipped at the worker.
limited_running = _lifetime("limited_running", lock_limit=2)


# -- a lost lock stops the actor -----------------------------------------------------------


# Its lock lives 1 s: the run outlives it, and is interrupted at its deadline.
@dramatiq.actor(lock_ttl=1, lock_on_lost="interrupt", max_retries=0)
def interrupted(run: str) -> None:
    _state.until_stopped(run)


@dramatiq.actor(lock_ttl=30, lock_on_lost="interrupt", max_retries=0)
def released(run: str) -> None:
    _state.until_stopped(run)
