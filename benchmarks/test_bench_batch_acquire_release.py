"""Batch acquire, then release, of 1000 fresh keys per round."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="batch acquire + release of 1000")
@pytest.mark.parametrize("contender", bench.one_call_contenders("acquire_release"))
def test_acquire_release(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("acquire_release", contender)
