"""Key building alone: dedupe's keys for 1000 argument tuples per round, no server."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="key building of 1000 (dedupe's keys)")
@pytest.mark.parametrize("contender", bench.one_call_contenders("keys"))
def test_keys(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("keys", contender)
