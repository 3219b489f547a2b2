"""What ``min_replicas=1`` costs: grants confirmed by a replica (WAIT) against unconfirmed.

A primary and its replica on this machine (the replica's acknowledgement is a round
trip between two local processes). Both sides run in one session, so their medians
compare:

    python -m pytest benchmarks/test_bench_replicas.py --benchmark-columns=median,ops

A confirmed batch sends one WAIT per connection, behind its last window, so its cost is
the replica catching up the batch's tail. ``scripts/replicas_bench.py`` times the batches
of both builds with the two sides interleaved round by round, which a shared machine
needs for a ratio worth quoting.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import joblock
from joblock._tools.servers import RedisServer

PAIRS = 200
BATCH = 100_000
_rounds = itertools.count()


@pytest.fixture(scope="module")
def primary() -> Iterator[RedisServer]:
    no_delay = ("--repl-diskless-sync-delay", "0")
    with (
        RedisServer(*no_delay) as primary,
        RedisServer(*no_delay, "--replicaof", "127.0.0.1", str(primary.port)),
    ):
        with redis.Redis(port=primary.port) as client:
            deadline = time.monotonic() + 30
            while client.set("probe", 1) and client.execute_command("WAIT", 1, 100) != 1:
                assert time.monotonic() < deadline, "the replica did not come online"
        yield primary


@pytest.fixture(scope="module")
def locks(primary: RedisServer) -> Iterator[joblock.Locks]:
    # A WAIT counts every write before it: the first confirmed round waits for the
    # unconfirmed rounds' backlog too, which a busy machine may take longer than the
    # default half second to replicate.
    with joblock.Locks(primary.url, prefix="bench", replica_timeout=2) as client:
        yield client


def pairs(locks: joblock.Locks, replicas: int) -> int:
    done = 0
    for _ in range(PAIRS):
        lease = locks.acquire("single", 30, min_replicas=replicas)
        assert lease is not None
        done += lease.release()
    return done


def batch(locks: joblock.Locks, keys: list[str], replicas: int) -> list[Any]:
    return locks.acquire_many(keys, 30, min_replicas=replicas)


def dedupe(locks: joblock.Locks, job: str, replicas: int) -> list[Any]:
    return locks.dedupe(job, ((i,) for i in range(BATCH)), 30, min_replicas=replicas)


@pytest.mark.benchmark(group="min_replicas: single acquire + release")
@pytest.mark.parametrize("replicas", [0, 1], ids=["unconfirmed", "min_replicas=1"])
def test_single_pairs(benchmark: Any, locks: joblock.Locks, replicas: int) -> None:
    benchmark.extra_info.update(operations_per_round=PAIRS)
    assert benchmark.pedantic(pairs, args=(locks, replicas), rounds=30, warmup_rounds=1) == PAIRS


@pytest.mark.benchmark(group="min_replicas: batch acquire")
@pytest.mark.parametrize("replicas", [0, 1], ids=["unconfirmed", "min_replicas=1"])
def test_batch_acquire(benchmark: Any, locks: joblock.Locks, replicas: int) -> None:
    benchmark.extra_info.update(operations_per_round=BATCH)

    def fresh_keys() -> tuple[tuple[Any, ...], dict[str, Any]]:
        n = next(_rounds)
        return (locks, [f"batch:{n}:{i}" for i in range(BATCH)], replicas), {}

    leases = benchmark.pedantic(batch, setup=fresh_keys, rounds=7, warmup_rounds=1)
    assert all(leases)


@pytest.mark.benchmark(group="min_replicas: dedupe")
@pytest.mark.parametrize("replicas", [0, 1], ids=["unconfirmed", "min_replicas=1"])
def test_dedupe(benchmark: Any, locks: joblock.Locks, replicas: int) -> None:
    benchmark.extra_info.update(operations_per_round=BATCH)

    def fresh_job() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (locks, f"Dedupe{next(_rounds)}", replicas), {}

    leases = benchmark.pedantic(dedupe, setup=fresh_job, rounds=7, warmup_rounds=1)
    assert all(leases)
