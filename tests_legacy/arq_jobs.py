"""The arq functions of tests_legacy/test_arq.py, imported by the test and by its arq worker.

Locks and events live on db 0 of the Redis in JOBLOCK_TEST_REDIS, arq's queue on db 3
(its name in JOBLOCK_TEST_QUEUE). Functions write what they do to ``events:<run>``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

from arq import Retry, func
from arq.connections import RedisSettings
from legacy import TIMEOUT, AsyncState

from joblock import current_lease
from joblock.arq import locked
from joblock.frameworks import Reschedule

PREFIX = "ja"

_state = AsyncState(PREFIX)
configure, use_locks, get_locks, note = _state.configure, _state.use_locks, _state.get_locks, _state.note

if os.environ.get("JOBLOCK_TEST_REDIS"):
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("joblock").addHandler(handler)
    logging.getLogger("joblock").setLevel(logging.INFO)


def arq_settings(url: str) -> RedisSettings:
    return RedisSettings.from_dsn(url.rsplit("/", 1)[0] + "/3")


# -- the article ---------------------------------------------------------------------------


@locked(
    get_locks,
    ttl=30,
    name="CleanupDataJob",
    identifier=lambda user_id, run, seconds: run,  # one at a time (per test run)
    on_conflict=Reschedule(delay=0.5, factor=2, max_delay=1, max_attempts=30),
)
async def cleanup_data(ctx: dict[str, Any], user_id: int, run: str, seconds: float) -> str:
    note(run, "start", user_id)
    await asyncio.sleep(seconds)
    note(run, "end", user_id)
    return f"cleaned {user_id}"


@locked(get_locks, ttl=30, name="ProductSalesJob", lifetime="until_executed")
async def product_sales(ctx: dict[str, Any], product_id: int, run: str, seconds: float) -> str:
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


def _named(name: str, **options: Any) -> Any:
    async def hold(ctx: dict[str, Any], run: str, seconds: float) -> str:
        return await _hold(run, seconds)

    hold.__name__ = hold.__qualname__ = name  # arq names the function by this
    return locked(get_locks, ttl=options.pop("ttl", 30), **options)(hold)


async def busy(run: str, seconds: float) -> str:
    note(run, "busy")
    return f"busy {run}"


while_executing = _named("while_executing")
until_executing = _named("until_executing", lifetime="until_executing")
until_executed = _named("until_executed", lifetime="until_executed")
until_expired = _named("until_expired", lifetime="until_expired", ttl=2)


async def expired(run: str, seconds: float) -> None:
    note(run, "expired")


calling = _named("calling", on_conflict=busy)
outlived = _named("outlived", ttl=0.5, on_expired=expired)
raising = _named("raising", on_conflict="raise")


# -- arq's retries --------------------------------------------------------------------------


def _retrying(name: str, **options: Any) -> Any:
    async def retrying(ctx: dict[str, Any], run: str, tries: int) -> str:
        """Raises Retry until try number ``tries``, which waits for the test's word to end."""
        note(run, "try", ctx["job_try"], current_lease().token.decode())
        if ctx["job_try"] < tries:
            raise Retry(defer=0.2)
        await ctx["redis"].blpop(f"go:{run}", timeout=TIMEOUT)
        return "done"

    retrying.__name__ = retrying.__qualname__ = name
    return locked(get_locks, ttl=30, **options)(retrying)


retried_while_executing = _retrying("retried_while_executing")
retried_until_executed = _retrying("retried_until_executed", lifetime="until_executed")
# arq gives it 2 tries (arq.func below), and so does its lock.
given_up = _retrying("given_up", max_tries=2)


@locked(get_locks, ttl=3)
async def sleeper(ctx: dict[str, Any], run: str) -> None:
    note(run, "start", current_lease().token.decode())
    await asyncio.sleep(60)


# -- debounce and limit ---------------------------------------------------------------------


async def _reindex(ctx: dict[str, Any], run: str, rev: int) -> int:
    note(run, "run", rev)
    return rev


def _debounced(name: str, **options: Any) -> Any:
    async def reindex(ctx: dict[str, Any], run: str, rev: int) -> int:
        return await _reindex(ctx, run, rev)

    reindex.__name__ = reindex.__qualname__ = name
    # One run per test run (the identifier), with the last enqueue's revision.
    return locked(get_locks, ttl=30, lifetime="debounce", identifier=lambda run, rev: run, **options)(reindex)


debounced = _debounced("debounced", debounce=1)
# A steady stream still runs, at most 1.5 s after its burst began.
capped = _debounced("capped", debounce=1, debounce_max=1.5)


@locked(get_locks, ttl=30, lifetime="until_executed", limit=2, identifier=lambda run, n: run)
async def limited(ctx: dict[str, Any], run: str, n: int) -> int:
    """Notes its start, waits for the test's word, notes its end."""
    note(run, "start", n)
    await _state.word(run)
    note(run, "end", n)
    return n


# -- a lost lock cancels the job ------------------------------------------------------------


@locked(get_locks, ttl=30, on_lost="cancel")
async def cancelled(ctx: dict[str, Any], run: str) -> str:
    note(run, "start", current_lease().token.decode())
    await asyncio.sleep(60)  # cancelled once its lock is lost
    note(run, "end")
    return "not stopped"


class WorkerSettings:
    functions = [
        cleanup_data, product_sales, while_executing, until_executing, until_executed, until_expired,
        calling, raising, outlived, sleeper, retried_while_executing, retried_until_executed,
        func(given_up, max_tries=2), debounced, capped, limited, cancelled,
    ]  # fmt: skip
    redis_settings = arq_settings(os.environ.get("JOBLOCK_TEST_REDIS", "redis://127.0.0.1:6379/0"))
    queue_name = os.environ.get("JOBLOCK_TEST_QUEUE", "arq:queue")
    max_jobs = 20
    poll_delay = 0.05
    keep_result = 60
