"""Batch acquire: 1000 fresh keys per round, one connection."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="batch acquire of 1000")
@pytest.mark.parametrize("contender", bench.one_call_contenders("acquire"))
def test_acquire(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("acquire", contender)
