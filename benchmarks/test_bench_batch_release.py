"""Batch release (compare-and-delete) of 1000 held locks per round; acquiring them is untimed."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="batch release of 1000")
@pytest.mark.parametrize("contender", bench.one_call_contenders("release"))
def test_release(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("release", contender)
