"""Batch acquire of held locks: 1000 keys per round whose locks are already taken, as a
dispatcher's duplicates are."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="batch acquire of 1000 held locks")
@pytest.mark.parametrize("contender", bench.one_call_contenders("acquire_held"))
def test_acquire_held(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("acquire_held", contender)
