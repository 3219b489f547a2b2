"""asyncio: joblock's AsyncLocks (each twin) against redis.asyncio's Lock and pipeline.

The cases are ``joblock bench``'s asyncio groups (``--only asyncio``): each round is
one call run to its end on the arena's event loop.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="asyncio: single acquire + release")
@pytest.mark.parametrize("contender", bench.one_call_contenders("aio_single"))
def test_aio_single(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("aio_single", contender)


@pytest.mark.benchmark(group="asyncio: batch acquire of 1000")
@pytest.mark.parametrize("contender", bench.one_call_contenders("aio_acquire"))
def test_aio_acquire(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("aio_acquire", contender)
