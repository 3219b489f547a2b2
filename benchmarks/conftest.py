"""pytest-benchmark: the cases of ``joblock bench``, one benchmark group per operation.

The contenders (joblock on each twin of its core, redis-py's Lock and pipeline and
their asyncio forms, python-redis-lock, pottery's Redlock) come from
:mod:`joblock._tools.bench`, so this suite and the ``joblock bench`` command time the very
same code. A peer that is not installed is skipped. Nothing here asserts on speed:
the checks only make sure each contender really took and released its locks.

    python -m pytest benchmarks                       # timings, grouped by operation
    python -m pytest benchmarks --benchmark-disable   # a quick smoke run, once each
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from joblock._tools import bench
from joblock._tools.servers import RedisServer

# Rounds per benchmark: the peers that lock one key at a time get few, as a round
# of 1000 of their locks takes a second or more.
FAST = (
    "joblock-c",
    "joblock-c-unmeasured",
    "joblock-c-instrumented",
    "joblock-py",
    "redis-py-pipeline",
    "redis-py-asyncio-pipeline",
    "handwritten",
)


def rounds(group: str, contender: str) -> int:
    if bench.GROUPS[group].batch == 1:
        return 300 if contender in FAST else 100
    return 40 if contender in FAST else 3


@pytest.fixture(scope="session")
def arena() -> Iterator[bench.Arena]:
    """One throwaway redis-server for the session, and this run's key namespace."""
    with RedisServer() as server, bench.Arena(server.url) as arena:
        yield arena


@pytest.fixture
def run_case(benchmark: Any, arena: bench.Arena) -> Iterator[Callable[[str, str], None]]:
    """Times one contender of one group: each round does ``group.batch`` operations."""

    def run(group: str, contender: str) -> None:
        try:
            case = bench.make_case(arena, group, contender)
        except bench.Unavailable as e:
            pytest.skip(f"{bench.label(group, contender)}: {e}")
        n = bench.GROUPS[group].batch
        benchmark.extra_info.update(
            contender=bench.label(group, contender), unit=bench.GROUPS[group].unit, operations_per_round=n
        )
        results = benchmark.pedantic(
            case.run, setup=lambda: ((case.prepare(n),), {}), rounds=rounds(group, contender), warmup_rounds=1
        )
        assert bench.succeeded(results) == bench.GROUPS[group].expected(n)

    yield run
    arena.purge()
