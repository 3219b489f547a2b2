"""Many callers sharing one client: threads sharing a ``Locks``, tasks sharing an ``AsyncLocks``.

The cases are ``joblock bench``'s (``--only concurrency``): each round is ten
acquire + release pairs per caller, every caller on keys of its own, against redis-py's
``Lock`` (sync and asyncio) given the same number of threads or tasks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench

CROWDS = [
    (group, contender)
    for group in bench.GROUPS
    if group.startswith(("threads", "aio_tasks"))
    for contender in bench.one_call_contenders(group)
]


@pytest.mark.parametrize(("group", "contender"), CROWDS)
def test_crowd(run_case: Callable[[str, str], None], benchmark: object, group: str, contender: str) -> None:
    benchmark.group = bench.GROUPS[group].title  # type: ignore[attr-defined]
    run_case(group, contender)
