"""The Huey instances and tasks of tests/test_huey.py, imported by the test and by its consumers.

Huey's queues live on db 6 of the Redis in JOBLOCK_TEST_REDIS, set up at import (so the
test sets that variable before importing this module); locks and events on db 0. The
test process swaps in Locks on its own core twin with ``use_locks``; consumers pick their
twin with JOBLOCK_NO_EXTENSIONS. Tasks write what they do to the Redis list
``events:<run>``, ``run`` being a per-test id.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from huey import RedisHuey

import joblock
from job_state import JobState
from joblock import current_lease
from joblock.frameworks import Reschedule
from joblock.huey import TaskLocks

PREFIX = "jh"
URL = os.environ["JOBLOCK_TEST_REDIS"]
HUEY_URL = URL.rsplit("/", 1)[0] + "/6"

_state = JobState(PREFIX)
configure, use_locks, get_locks, note = _state.configure, _state.use_locks, _state.get_locks, _state.note
configure(URL)

# store_none: a run skipped at the consumer has the result None, which tests wait for.
huey = RedisHuey("joblock-huey", url=HUEY_URL, store_none=True)
tasks = TaskLocks(huey, get_locks)
# The queue of the consumer that a test kills.
kill_huey = RedisHuey("joblock-huey-kill", url=HUEY_URL)
kill_tasks = TaskLocks(kill_huey, get_locks)

if os.environ.get("JOBLOCK_TEST_CONSUMER"):
    # huey_consumer sets up only Huey's loggers; the tests read joblock's lines.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("joblock").addHandler(handler)
    logging.getLogger("joblock").setLevel(logging.INFO)


@huey.task()
def ping() -> str:
    return joblock.implementation


@huey.task()
def collect(results: list[Any]) -> list[Any]:
    return sorted(results)


# -- the article ---------------------------------------------------------------------------


@tasks.task(
    lock_ttl=30,
    lock_name="CleanupDataJob",
    lock_identifier=lambda user_id, run, seconds: run,  # one at a time (per test run)
    lock_on_conflict=Reschedule(delay=0.5, factor=2, max_delay=1, max_attempts=30),
)
def cleanup_data(user_id: int, run: str, seconds: float) -> str:
    note(run, "start", user_id)
    time.sleep(seconds)
    note(run, "end", user_id)
    return f"cleaned {user_id}"


@tasks.task(lock_ttl=30, lock_name="ProductSalesJob", lock_lifetime="until_executed")
def product_sales(product_id: int, run: str, seconds: float) -> str:
    note(run, "start", product_id)
    time.sleep(seconds)
    note(run, "end", product_id)
    return f"sales {product_id}"


# -- lifetimes -----------------------------------------------------------------------------


def _hold(run: str, seconds: float) -> str:
    lease = current_lease()
    note(run, "start", "-" if lease is None else lease.token.decode())
    time.sleep(seconds)
    note(run, "end")
    return "done"


def _lifetime(name: str, ttl: float = 30, **options: Any) -> Any:
    return tasks.task(lock_ttl=ttl, name=name, **options)(_hold)


while_executing = _lifetime("while_executing")
until_executing = _lifetime("until_executing", lock_lifetime="until_executing")
until_executed = _lifetime("until_executed", lock_lifetime="until_executed")
until_expired = _lifetime("until_expired", 2, lock_lifetime="until_expired")

# -- strategies ----------------------------------------------------------------------------


def _busy(run: str, seconds: float) -> str:
    note(run, "busy")
    return "busy"


_capped = {"delay": 0.2, "factor": 2, "max_delay": 0.5, "jitter": 0.5, "max_attempts": 3}
raising = _lifetime("raising", lock_on_conflict="raise")
calling = _lifetime("calling", lock_on_conflict=_busy)
unique_raising = _lifetime("unique_raising", lock_lifetime="until_executed", lock_on_conflict="raise")
capped_skip = _lifetime("capped_skip", lock_on_conflict=Reschedule(**_capped, then="skip"))
capped_raise = _lifetime("capped_raise", lock_on_conflict=Reschedule(**_capped, then="raise"))
queued_reschedule = _lifetime(
    "queued_reschedule",
    lock_lifetime="until_executed",
    lock_on_conflict=Reschedule(delay=0.5, factor=1, max_delay=0.5, max_attempts=100),
)

# -- bursts --------------------------------------------------------------------------------


gate = _state.gate


@tasks.task(lock_ttl=30, lock_name="GatedJob", lock_lifetime="until_executed")
def gated(item: str, run: str) -> str:
    _state.until_gate(run)  # held until the whole burst is out
    note(run, "run", item)
    return item


# -- retries, crashes, periodic tasks ------------------------------------------------------


# context=True: Huey passes the task itself, which the lock key leaves out.
@tasks.task(lock_ttl=30, retries=1, retry_delay=1, context=True)
def retrying(run: str, task: Any = None) -> str:
    tries = _state.events.incr(f"tries:{run}") - 1
    note(run, "try", tries, current_lease().token.decode(), task.id)
    if tries == 0:
        raise RuntimeError("first try fails")
    return "retried"


@kill_tasks.task(lock_ttl=3)
def sleeper(run: str) -> None:
    note(run, "start", current_lease().token.decode())
    time.sleep(60)


# Never due: the test enqueues its runs itself, as the scheduler would (with a run id).
@tasks.periodic_task(lambda now: False, lock_ttl=30, lock_lifetime="until_executed")
def nightly(run: str = "-") -> None:
    # Runs once the test has made its second enqueue: a run done at once would free its
    # lock before that, and the second would be admitted (the deadline only frees the
    # consumers of a failed test).
    if run != "-":
        _state.until_gate(run)
    note(run, "run", current_lease().token.decode())


# -- debounce and limit --------------------------------------------------------------------


# One run per test run (the identifier), with the last enqueue's revision.
@tasks.task(lock_ttl=30, lock_lifetime="debounce", lock_debounce=1, lock_identifier=lambda run, rev: run)
def debounced(run: str, rev: int) -> int:
    note(run, "run", rev)
    return rev


# Two copies of one key queued or running at once; the others dropped at enqueue.
limited = _lifetime(
    "limited", lock_lifetime="until_executed", lock_limit=2, lock_identifier=lambda run, s: run
)


# -- a lost lock stops the task ------------------------------------------------------------


# A process worker exits; a thread worker's task is interrupted.
@tasks.task(lock_ttl=30, lock_on_lost="exit")
def exits(run: str) -> str:
    return _state.until_stopped(run)


@tasks.task(lock_ttl=30, lock_on_lost="interrupt")
def interrupted(run: str) -> str:
    return _state.until_stopped(run)
