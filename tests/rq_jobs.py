"""The RQ jobs of tests/test_rq.py, imported by the test and by its RQ workers.

Locks and events live on db 0 of the Redis in JOBLOCK_TEST_REDIS (RQ's queues on
db 3). The test process swaps in Locks on its own core twin with ``use_locks``;
workers pick their twin with JOBLOCK_NO_EXTENSIONS. Jobs write what they do to the
Redis list ``events:<run>``, ``run`` being a per-test id.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from job_state import JobState
from joblock import current_lease
from joblock.frameworks import Reschedule
from joblock.rq import locked

PREFIX = "jr"

_state = JobState(PREFIX)
configure, use_locks, get_locks, note = _state.configure, _state.use_locks, _state.get_locks, _state.note


if os.environ.get("JOBLOCK_TEST_REDIS"):
    configure(os.environ["JOBLOCK_TEST_REDIS"])
    # RQ's command line sets up only its own loggers; the tests read joblock's lines.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("joblock").addHandler(handler)
    logging.getLogger("joblock").setLevel(logging.INFO)


def ping() -> str:
    return "pong"


# -- the article ---------------------------------------------------------------------------


@locked(
    get_locks,
    ttl=30,
    name="CleanupDataJob",
    identifier=lambda user_id, run, seconds: run,  # one at a time (per test run)
    on_conflict=Reschedule(delay=0.5, factor=2, max_delay=1, max_attempts=30),
)
def cleanup_data(user_id: int, run: str, seconds: float) -> str:
    note(run, "start", user_id)
    time.sleep(seconds)
    note(run, "end", user_id)
    return f"cleaned {user_id}"


@locked(get_locks, ttl=30, name="ProductSalesJob", lifetime="until_executed")
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


def _named(name: str, **options: Any) -> Any:
    def hold(run: str, seconds: float) -> str:
        return _hold(run, seconds)

    hold.__name__ = hold.__qualname__ = name  # RQ imports the job by this name
    return locked(get_locks, ttl=options.pop("ttl", 30), **options)(hold)


while_executing = _named("while_executing")
until_executing = _named("until_executing", lifetime="until_executing")
until_executed = _named("until_executed", lifetime="until_executed")
until_expired = _named("until_expired", lifetime="until_expired", ttl=2)

# -- strategies ----------------------------------------------------------------------------


def busy(run: str, seconds: float) -> str:
    note(run, "busy")
    return f"busy {run}"


_capped = {"delay": 0.2, "factor": 2, "max_delay": 0.5, "jitter": 0.5, "max_attempts": 3}
raising = _named("raising", on_conflict="raise")
calling = _named("calling", on_conflict=busy)
unique_raising = _named("unique_raising", lifetime="until_executed", on_conflict="raise")
capped_skip = _named("capped_skip", on_conflict=Reschedule(**_capped, then="skip"))
capped_raise = _named("capped_raise", on_conflict=Reschedule(**_capped, then="raise"))
queued_reschedule = _named(
    "queued_reschedule",
    lifetime="until_executed",
    on_conflict=Reschedule(delay=0.5, factor=1, max_delay=0.5, max_attempts=100),
)


# -- bursts -------------------------------------------------------------------------------


gate = _state.gate


@locked(get_locks, ttl=30, name="GatedJob", lifetime="until_executed")
def gated(item: str, run: str) -> str:
    _state.until_gate(run)  # held until the whole burst is out
    note(run, "run", item)
    return item


# -- retries and crashes -------------------------------------------------------------------


@locked(get_locks, ttl=30)
def retrying(run: str) -> str:
    tries = _state.events.incr(f"tries:{run}") - 1
    note(run, "try", tries, current_lease().token.decode())
    if tries == 0:
        raise RuntimeError("first try fails")
    return "retried"


@locked(get_locks, ttl=3)
def sleeper(run: str) -> None:
    note(run, "start", current_lease().token.decode())
    time.sleep(60)


# -- debounce and limit --------------------------------------------------------------------


# One run per test run (the identifier), with the last enqueue's revision.
@locked(get_locks, ttl=30, lifetime="debounce", debounce=1, identifier=lambda run, rev: run)
def debounced(run: str, rev: int) -> int:
    note(run, "run", rev)
    return rev


# Two copies of one key queued or running at once; the others dropped at enqueue.
@locked(get_locks, ttl=30, lifetime="until_executed", limit=2, identifier=lambda run, seconds: run)
def limited(run: str, seconds: float) -> str:
    note(run, "start")
    time.sleep(seconds)
    note(run, "end")
    return "done"


# -- a lost lock stops the job -------------------------------------------------------------


# The forking Worker's work horse exits; a SimpleWorker's job is interrupted.
@locked(get_locks, ttl=30, on_lost="exit")
def exits(run: str) -> str:
    return _state.until_stopped(run)


@locked(get_locks, ttl=30, on_lost="interrupt")
def interrupted(run: str) -> str:
    return _state.until_stopped(run)
