"""Single acquire + release: two round trips per lock (joblock's floor is the network)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="single acquire + release")
@pytest.mark.parametrize("contender", bench.one_call_contenders("single"))
def test_single(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("single", contender)
