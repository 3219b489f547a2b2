"""The Celery app of tests/test_celery.py, imported by the test and by its worker processes.

The worker finds Redis in JOBLOCK_TEST_REDIS (locks and events on db 0, the broker on
db 1, results on db 2). The test process swaps in Locks on its own core twin with
``use_locks``; workers pick their twin with JOBLOCK_NO_EXTENSIONS. Tasks write what
they do to the Redis list ``events:<run>``, ``run`` being a per-test id, so tests
sharing a worker never see each other's jobs.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from job_state import JobState
from joblock import current_lease
from joblock.celery import LockedTask
from joblock.frameworks import Reschedule

PREFIX = "jc"
QUEUE = "joblock-celery"

app = Celery("celery_app")
app.conf.update(
    task_default_queue=QUEUE,
    # One message per process at a time: a second one waits in Redis, not in a
    # busy process's prefetch buffer.
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    task_track_started=False,
    worker_hijack_root_logger=True,
)

_state = JobState(PREFIX)
use_locks, get_locks, note = _state.use_locks, _state.get_locks, _state.note


def configure(url: str) -> None:
    base = url.rsplit("/", 1)[0]
    app.conf.update(broker_url=f"{base}/1", result_backend=f"{base}/2")
    _state.configure(url)


if os.environ.get("JOBLOCK_TEST_REDIS"):
    configure(os.environ["JOBLOCK_TEST_REDIS"])


class ShopTask(LockedTask):
    """The shop's defaults for its locked tasks, as a user would set them once."""

    locks = staticmethod(get_locks)
    lock_ttl = 30


@app.task
def ping() -> str:
    return "pong"


# -- the article ---------------------------------------------------------------------------


@app.task(
    base=ShopTask,
    lock_name="CleanupDataJob",
    # One cleanup at a time whatever the user (per test run, so tests stay apart).
    lock_identifier=lambda user_id, run, seconds: run,
    lock_on_conflict=Reschedule(delay=0.2, factor=2, max_delay=0.8, max_attempts=30),
)
def cleanup_data(user_id: int, run: str, seconds: float) -> str:
    note(run, "start", user_id)
    time.sleep(seconds)
    note(run, "end", user_id)
    return f"cleaned {user_id}"


@app.task(base=ShopTask, lock_name="ProductSalesJob", lock_lifetime="until_executed")
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


while_executing = app.task(base=ShopTask, name="while_executing")(_hold)
until_executing = app.task(base=ShopTask, name="until_executing", lock_lifetime="until_executing")(_hold)
until_executed = app.task(base=ShopTask, name="until_executed", lock_lifetime="until_executed")(_hold)
until_expired = app.task(base=ShopTask, name="until_expired", lock_lifetime="until_expired", lock_ttl=2)(
    _hold
)

# -- strategies ----------------------------------------------------------------------------


def busy(run: str, seconds: float) -> str:
    note(run, "busy")
    return f"busy {run}"


raising = app.task(base=ShopTask, name="raising", lock_on_conflict="raise")(_hold)
calling = app.task(base=ShopTask, name="calling", lock_on_conflict=busy)(_hold)
unique_raising = app.task(
    base=ShopTask, name="unique_raising", lock_lifetime="until_executed", lock_on_conflict="raise"
)(_hold)
_capped = {"delay": 0.2, "factor": 2, "max_delay": 0.5, "jitter": 0.5, "max_attempts": 3}
capped_skip = app.task(
    base=ShopTask, name="capped_skip", lock_on_conflict=Reschedule(**_capped, then="skip")
)(_hold)
capped_raise = app.task(
    base=ShopTask, name="capped_raise", lock_on_conflict=Reschedule(**_capped, then="raise")
)(_hold)
queued_reschedule = app.task(
    base=ShopTask,
    name="queued_reschedule",
    lock_lifetime="until_executed",
    lock_on_conflict=Reschedule(delay=0.2, factor=1, max_delay=0.2, max_attempts=100),
)(_hold)


# -- bursts -------------------------------------------------------------------------------


gate = _state.gate


@app.task(base=ShopTask, name="gated", lock_name="GatedJob", lock_lifetime="until_executed")
def gated(item: str, run: str) -> str:
    _state.until_gate(run)  # held until the whole burst is out
    note(run, "run", item)
    return item


@app.task
def collect(results: list[str]) -> list[str]:
    """A chord's body: the results of its header."""
    return sorted(results)


# -- retries and crashes -------------------------------------------------------------------


@app.task(bind=True, base=ShopTask, lock_lifetime="until_executed")
def retrying(self: LockedTask, run: str, pause: float) -> str:
    token = current_lease().token.decode()
    note(run, "try", self.request.retries, token)
    if self.request.retries == 0:
        raise self.retry(countdown=pause, max_retries=1)
    return "retried"


@app.task(base=ShopTask, name="sleeper", lock_ttl=3)
def sleeper(run: str) -> None:
    note(run, "start", current_lease().token.decode())
    time.sleep(60)


# -- debounce ------------------------------------------------------------------------------


def _reindex(run: str, rev: int) -> int:
    note(run, "run", rev)
    return rev


# One run per test run (the identifier), with the last enqueue's revision.
debounced = app.task(
    base=ShopTask,
    name="debounced",
    lock_lifetime="debounce",
    lock_debounce=1,
    lock_identifier=lambda run, rev: run,
)(_reindex)
# A steady stream still runs, at most 1.5 s after its burst began.
capped = app.task(
    base=ShopTask,
    name="capped",
    lock_lifetime="debounce",
    lock_debounce=1,
    lock_debounce_max=1.5,
    lock_identifier=lambda run, rev: run,
)(_reindex)


# -- a lost lock stops the task ------------------------------------------------------------


@app.task(base=ShopTask, name="exits", lock_on_lost="exit")
def exits(run: str) -> str:
    return _state.until_stopped(run)


@app.task(base=ShopTask, name="interrupted", lock_on_lost="interrupt")
def interrupted(run: str) -> str:
    return _state.until_stopped(run)
