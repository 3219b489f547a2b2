"""Dedupe: 1000 argument tuples per round (one in ten a duplicate), keys built from them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="dedupe of 1000 with key building")
@pytest.mark.parametrize("contender", bench.one_call_contenders("dedupe"))
def test_dedupe(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("dedupe", contender)
