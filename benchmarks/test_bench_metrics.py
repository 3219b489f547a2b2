"""Batch acquire, then release, of 1000 fresh keys per round: uninstrumented (as shipped),
without the metrics layer at all, and instrumented into an OpenTelemetry SDK meter."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="batch acquire + release of 1000, metrics")
@pytest.mark.parametrize("contender", bench.one_call_contenders("metrics"))
def test_metrics(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("metrics", contender)
