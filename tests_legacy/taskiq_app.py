"""The taskiq broker and tasks of tests_legacy/test_taskiq.py, imported by the test and its worker.

Locks, events and results live on db 0 of the Redis in JOBLOCK_TEST_REDIS, the
queue (a taskiq-redis list, named in JOBLOCK_TEST_QUEUE) on db 4. Tasks write what
they do to ``events:<run>``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

from legacy import AsyncState
from taskiq import SimpleRetryMiddleware, SmartRetryMiddleware
from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend

from joblock import current_lease
from joblock.frameworks import Reschedule
from joblock.taskiq import LockMiddleware

PREFIX = "jt"
REDIS = os.environ.get("JOBLOCK_TEST_REDIS", "redis://127.0.0.1:6379/0")

_state = AsyncState(PREFIX)
configure, use_locks, get_locks, note = _state.configure, _state.use_locks, _state.get_locks, _state.note

if os.environ.get("JOBLOCK_TEST_REDIS"):
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("joblock").addHandler(handler)
    logging.getLogger("joblock").setLevel(logging.INFO)


def make_broker(url: str, queue: str, retry: str = "simple") -> ListQueueBroker:
    """The app's broker; ``retry``: which of taskiq's retry middlewares it has."""
    broker = ListQueueBroker(url.rsplit("/", 1)[0] + "/4", queue_name=queue)
    retries = SimpleRetryMiddleware() if retry == "simple" else SmartRetryMiddleware(default_delay=0.2)
    return broker.with_result_backend(RedisAsyncResultBackend(url)).with_middlewares(
        LockMiddleware(get_locks), retries
    )


broker = make_broker(
    REDIS, os.environ.get("JOBLOCK_TEST_QUEUE", "taskiq"), os.environ.get("JOBLOCK_TEST_RETRY", "simple")
)


# -- the article ---------------------------------------------------------------------------


@broker.task(
    task_name="CleanupDataJob",
    lock_ttl=30,
    lock_identifier=lambda user_id, run, seconds: run,  # one at a time (per test run)
    lock_on_conflict=Reschedule(delay=0.5, factor=2, max_delay=1, max_attempts=30),
)
async def cleanup_data(user_id: int, run: str, seconds: float) -> str:
    note(run, "start", user_id)
    await asyncio.sleep(seconds)
    note(run, "end", user_id)
    return f"cleaned {user_id}"


@broker.task(task_name="ProductSalesJob", lock_ttl=30, lock_lifetime="until_executed")
async def product_sales(product_id: int, run: str, seconds: float) -> str:
    note(run, "start", product_id)
    await asyncio.sleep(seconds)
    note(run, "end", product_id)
    return f"sales {product_id}"


# -- lifetimes -----------------------------------------------------------------------------


async def _hold(run: str, seconds: float) -> str:
    lease = current_lease()
    note(run, "start", "-" if lease is None else lease.token.decode())
    await asyncio.sleep(seconds)
    note(run, "end")
    return "done"


def _named(name: str, **labels: Any) -> Any:
    async def hold(run: str, seconds: float) -> str:
        return await _hold(run, seconds)

    hold.__name__ = hold.__qualname__ = name
    return broker.task(task_name=name, **labels)(hold)


async def busy(run: str, seconds: float) -> str:
    note(run, "busy")
    return f"busy {run}"


while_executing = _named("while_executing", lock_ttl=30)
until_executing = _named("until_executing", lock_ttl=30, lock_lifetime="until_executing")
until_executed = _named("until_executed", lock_ttl=30, lock_lifetime="until_executed")
until_expired = _named("until_expired", lock_ttl=2, lock_lifetime="until_expired")


async def expired(run: str, seconds: float) -> None:
    note(run, "expired")


calling = _named("calling", lock_ttl=30, lock_on_conflict=busy)
outlived = _named("outlived", lock_ttl=0.5, lock_on_expired=expired)
raising = _named("raising", lock_ttl=30, lock_on_conflict="raise")
plain = _named("plain")


# -- taskiq's retries -----------------------------------------------------------------------


def _retrying(name: str, **labels: Any) -> Any:
    async def retrying(run: str, tries: int) -> str:
        """Fails until try number ``tries``, which waits for the test's word to end."""
        if note(run, "try", current_lease().token.decode()) < tries:
            raise RuntimeError("try again")
        await _state.word(run)
        return "done"

    retrying.__name__ = retrying.__qualname__ = name
    return broker.task(task_name=name, lock_ttl=30, retry_on_error=True, **labels)(retrying)


retried_while_executing = _retrying("retried_while_executing", max_retries=3)
retried_until_executed = _retrying("retried_until_executed", lock_lifetime="until_executed", max_retries=3)
given_up = _retrying("given_up", max_retries=2)


@broker.task(task_name="sleeper", lock_ttl=3)
async def sleeper(run: str) -> None:
    note(run, "start", current_lease().token.decode())
    await asyncio.sleep(60)


# -- debounce and limit ---------------------------------------------------------------------


def _debounced(name: str, **labels: Any) -> Any:
    async def reindex(run: str, rev: int) -> int:
        note(run, "run", rev)
        return rev

    reindex.__name__ = reindex.__qualname__ = name
    # One run per test run (the identifier), with the last enqueue's revision.
    return broker.task(
        task_name=name, lock_ttl=30, lock_lifetime="debounce", lock_identifier=lambda run, rev: run, **labels
    )(reindex)


debounced = _debounced("debounced", lock_debounce=1)
# A steady stream still runs, at most 1.5 s after its burst began.
capped = _debounced("capped", lock_debounce=1, lock_debounce_max=1.5)


@broker.task(
    task_name="limited",
    lock_ttl=30,
    lock_lifetime="until_executed",
    lock_limit=2,
    lock_identifier=lambda run, n: run,
)
async def limited(run: str, n: int) -> int:
    """Notes its start, waits for the test's word, notes its end."""
    note(run, "start", n)
    await _state.word(run)
    note(run, "end", n)
    return n


# -- a lost lock cancels the task -----------------------------------------------------------


@broker.task(task_name="cancelled", lock_ttl=30, lock_on_lost="cancel")
async def cancelled(run: str) -> str:
    note(run, "start", current_lease().token.decode())
    await asyncio.sleep(60)  # cancelled once its lock is lost
    note(run, "end")
    return "not stopped"
