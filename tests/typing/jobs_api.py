"""What a type checker tells a user of the job decorators and adapters (checked by mypy, never run).

A locked job keeps its function's parameters; what it returns gains what a busy lock
gives instead: None when skipped, on_locked's (or on_conflict's) result when that is
a callable, nothing more when it raises.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import rq
from rq.job import Job
from typing_extensions import assert_type

from joblock import Lease, Locks, current_lease
from joblock.aio import AsyncLease, AsyncLocks
from joblock.celery import LockedTask
from joblock.frameworks import Reschedule
from joblock.jobs import LockedJob, job
from joblock.rq import enqueue, enqueue_at, enqueue_in, locked


def the_shared_decorator(locks: Locks) -> None:
    # joblock.jobs.job is what Locks.job calls; Locks.job's overloads type the job.
    @job(locks, ttl=30)
    def plain(x: int) -> int:
        return x

    assert_type(plain.lock_key(1), str | bytes)


def threaded_jobs(locks: Locks) -> None:
    @locks.job(ttl=300)
    def product_sales(product_id: int, *, region: str = "eu") -> float:
        return 1.0

    assert_type(product_sales(42), float | None)
    assert_type(product_sales(42, region="us"), float | None)
    assert_type(product_sales.lock_key(42), str | bytes)
    product_sales("42")  # type: ignore[arg-type]
    product_sales.lock_key(42, colour="red")  # type: ignore[call-arg]

    @locks.job(ttl=3600, on_locked="raise", name="CleanupDataJob", identifier=lambda user_id: None)
    def cleanup(user_id: int) -> int:
        return user_id

    assert_type(cleanup(1), int)

    def retry_later(user_id: int) -> str:
        return "re-enqueued"

    @locks.job(ttl=300, on_locked=retry_later, auto_renew=True, on_lost=print, wait=1.5, fence=True)
    def sync_inventory(user_id: int) -> None:
        lease = current_lease()
        assert_type(lease, Lease | AsyncLease | None)
        if lease is not None:
            assert_type(lease.fence, int | None)

    assert_type(sync_inventory(7), str | None)
    locks.job(ttl=300, on_locked="sometimes")  # type: ignore[call-overload]
    locks.job(ttl=300, retries=3)  # type: ignore[call-overload]


def method_jobs(locks: Locks) -> None:
    class Reports:
        @locks.job(ttl=60)
        def build(self, day: str) -> bytes:
            return day.encode()

    reports = Reports()
    assert_type(reports.build("2026-12-03"), bytes | None)
    # The receiver is not part of the key; lock_key takes it from the class.
    assert_type(Reports.build.lock_key(reports, "2026-12-03"), str | bytes)
    reports.build(3)  # type: ignore[arg-type]


async def asyncio_jobs(locks: AsyncLocks) -> None:
    @locks.job(ttl=60)
    async def fetch(url: str) -> bytes:
        return b""

    call = fetch("https://example.com")
    _ = assert_type(call, Coroutine[Any, Any, bytes | None])
    assert_type(await call, bytes | None)
    assert_type(fetch.lock_key("https://example.com"), str | bytes)

    async def later(url: str) -> int:
        return 0

    @locks.job(ttl=60, on_locked=later)
    async def crawl(url: str) -> bytes:
        return b""

    assert_type(await crawl("u"), bytes | int)

    @locks.job(ttl=60, on_locked=lambda url: None, on_expired=print)
    async def ping(url: str) -> bool:
        return True

    assert_type(await ping("u"), bool | None)

    @locks.job(ttl=60, on_locked="raise")
    async def index(url: str) -> list[str]:
        return []

    assert_type(await index("u"), list[str])
    await index(3)  # type: ignore[arg-type]


def rq_jobs(locks: Locks, queue: rq.Queue) -> None:
    @locked(locks, ttl=300, lifetime="until_executed")
    def product_sales(product_id: int) -> float:
        return 1.0

    job: LockedJob[[int], float | None] = product_sales
    assert_type(job(42), float | None)
    assert_type(product_sales.lock_key(42), str | bytes)

    @locked(lambda: locks, ttl=300, on_conflict=Reschedule(delay=10, max_attempts=3))
    def cleanup(user_id: int) -> None:
        pass

    @locked(locks, ttl=300, on_conflict=lambda user_id: "busy")
    def report(user_id: int) -> int:
        return 0

    assert_type(report(1), int | str)
    sent = enqueue(queue, product_sales, 42, job_timeout=60)
    if isinstance(sent, Job):
        assert_type(sent.id, str)
    enqueue_in(queue, 30, cleanup, 1)
    enqueue_at(queue, __import__("datetime").datetime.now(), cleanup, 2)
    locked(locks, ttl="300")  # type: ignore[call-overload]


def celery_tasks(locks: Locks) -> None:
    class ShopTask(LockedTask):
        locks = locks
        lock_ttl = 300.0
        lock_lifetime = "until_executed"
        lock_on_conflict = Reschedule(delay=5)

    assert_type(LockedTask.lock_ttl, float | None)
    assert_type(ShopTask.lock_ttl, float)
    assert_type(ShopTask().joblock_key(42), str | bytes)

    class Broken(LockedTask):
        lock_ttl = "300"  # type: ignore[assignment]
