"""Batch extend (compare-and-set of the ttl) of 1000 held locks per round; acquiring them is untimed."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="batch extend of 1000")
@pytest.mark.parametrize("contender", bench.one_call_contenders("extend"))
def test_extend(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("extend", contender)
