"""Redis Cluster and Redlock: joblock against redis-py's cluster pipeline and pottery's Redlock.

The cases are ``joblock bench``'s (``--only cluster``): batch acquire on a local
3-primary cluster (with ``Locks`` on one server beside it), and Redlock over 3 servers,
single and batched (pottery's batch is a loop over its single locks).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from joblock._tools import bench


@pytest.mark.benchmark(group="Redis Cluster: batch acquire of 1000")
@pytest.mark.parametrize("contender", bench.one_call_contenders("cluster_acquire"))
def test_cluster_acquire(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("cluster_acquire", contender)


@pytest.mark.benchmark(group="Redlock, 3 servers: single acquire + release")
@pytest.mark.parametrize("contender", bench.one_call_contenders("redlock_single"))
def test_redlock_single(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("redlock_single", contender)


@pytest.mark.benchmark(group="Redlock, 3 servers: batch acquire of 1000")
@pytest.mark.parametrize("contender", bench.one_call_contenders("redlock_acquire"))
def test_redlock_acquire(run_case: Callable[[str, str], None], contender: str) -> None:
    run_case("redlock_acquire", contender)
