"""What a type checker tells a user of joblock.huey (checked by mypy, never run).

Huey ships no type information, so its tasks are ``Any``; what joblock types is its own
side: which client ``TaskLocks`` takes, that ``lock_ttl`` is required, what a key is.
"""

from __future__ import annotations

from huey import MemoryHuey
from typing_extensions import assert_type

from joblock import Locks
from joblock.aio import AsyncLocks
from joblock.huey import TaskLocks


def huey_tasks(locks: Locks, async_locks: AsyncLocks) -> None:
    huey = MemoryHuey("shop")
    tasks = TaskLocks(huey, locks)
    TaskLocks(huey, lambda: locks)  # the Locks looked up when a lock is needed
    TaskLocks(huey, async_locks)  # type: ignore[arg-type]

    @tasks.task(lock_ttl=300, lock_lifetime="until_executed", retries=2)
    def product_sales(product_id: int) -> str:
        return f"sales of {product_id}"

    assert_type(tasks.lock_key(product_sales, 42), str | bytes)
    tasks.task(lock_lifetime="until_executed")  # type: ignore[call-arg]
    tasks.periodic_task(lambda now: now.minute == 0, lock_ttl=600)
