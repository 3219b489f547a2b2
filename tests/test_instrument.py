"""``joblock.instrument()``: OpenTelemetry metrics read back with the SDK's in-memory reader.

Every test runs on each twin of the core, against the suite's real redis-server. A lock
"expires" here by a real PEXPIRE of 1 ms and is "taken" by another client's SET: the
release script then finds the key gone or someone else's, as it would in production.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import joblock
from conftest import locks_class
from joblock import frameworks, metrics
from joblock._tools.servers import RedisServer
from joblock.aio import AsyncLocks
from joblock.cluster import ClusterLocks
from joblock.locks import Locks
from joblock.redlock import Redlock
from workers import wait_for


class Readings:
    """What the in-memory reader collected: one instrument's points by their attributes."""

    def __init__(self, reader: InMemoryMetricReader, provider: MeterProvider) -> None:
        self.reader = reader
        self.provider = provider

    def points(self, name: str) -> dict[frozenset[tuple[str, Any]], Any]:
        data = self.reader.get_metrics_data()
        found: dict[frozenset[tuple[str, Any]], Any] = {}
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        for point in metric.data.data_points:
                            found[frozenset(point.attributes.items())] = point
        return found

    def counts(self, name: str) -> dict[frozenset[tuple[str, Any]], int]:
        """A counter's values, or a histogram's number of recordings, by attributes."""
        return {k: getattr(p, "count", None) or p.value for k, p in self.points(name).items()}

    def total(self, name: str, **attributes: str) -> int:
        """The sum over the points whose attributes include ``attributes`` (``joblock.`` names)."""
        wanted = {(f"joblock.{k}", v) for k, v in attributes.items()}
        return sum(v for k, v in self.counts(name).items() if wanted <= k)


@pytest.fixture
def readings() -> Iterator[Readings]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    joblock.instrument(meter_provider=provider)
    try:
        yield Readings(reader, provider)
    finally:
        joblock.uninstrument()
        provider.shutdown()


def expire(raw: Any, key: str) -> None:
    """Lets Redis expire ``key`` now (PEXPIRE 1 ms) and waits until it has."""
    raw.pexpire(key, 1)
    while raw.exists(key):
        time.sleep(0.002)


def attrs(**attributes: str) -> frozenset[tuple[str, str]]:
    return frozenset((f"joblock.{k}", v) for k, v in attributes.items())


# -- single locks --------------------------------------------------------------------------


def test_an_acquire_counts_granted_or_busy_and_its_wait(locks: Locks, readings: Readings) -> None:
    key = locks.key("Report", 1)
    lease = locks.acquire(key, ttl=60)
    assert lease is not None
    assert locks.acquire(key, ttl=60) is None
    assert locks.acquire(key, ttl=60, wait=0.02) is None

    acquisitions = readings.counts("joblock.lock.acquisitions")
    assert acquisitions == {
        attrs(outcome="granted", operation="acquire"): 1,
        attrs(outcome="busy", operation="acquire"): 2,
    }
    waits = readings.points("joblock.lock.wait_time")
    assert waits[attrs(outcome="granted")].count == 1
    busy = waits[attrs(outcome="busy")]
    assert busy.count == 2
    assert busy.sum >= 0.02  # the wait=0.02 acquire waited that long before giving up
    assert list(busy.explicit_bounds) == list(metrics.SECONDS)
    assert lease.release() is True


def test_a_release_handing_the_lock_to_a_waiter_counts_a_handoff(locks: Locks, readings: Readings) -> None:
    key = locks.key("Handoff", 1)
    holder = locks.acquire(key, ttl=60)
    assert holder is not None
    threading.Timer(0.1, holder.release).start()
    with metrics.job("Handoff"):
        waiter = locks.acquire(key, ttl=60, wait=10)
    assert waiter is not None and waiter.release() is True
    expire_soon = locks.acquire(key, ttl=0.2)  # frees by expiry: the waiter finds it, no hand-off
    assert expire_soon is not None and locks.acquire(key, ttl=60, wait=10) is not None
    assert readings.counts("joblock.lock.handoffs") == {attrs(job="Handoff"): 1}


def test_a_counting_acquire_counts_like_a_plain_one(locks: Locks, readings: Readings) -> None:
    key = locks.key("Export", 1)
    holders = [locks.acquire(key, ttl=60, limit=2) for _ in range(3)]
    assert holders[2] is None  # the third finds both holders there
    leases = [lease for lease in holders if lease is not None]
    assert [lease.release() for lease in leases] == [True, True]

    assert readings.counts("joblock.lock.acquisitions") == {
        attrs(outcome="granted", operation="acquire"): 2,
        attrs(outcome="busy", operation="acquire"): 1,
    }
    assert readings.counts("joblock.lock.hold_time") == {attrs(outcome="released"): 2}
    assert readings.counts("joblock.lock.lost") == {}


def test_a_release_records_the_hold_time_and_no_loss(locks: Locks, readings: Readings) -> None:
    with locks.lock(locks.key("Report", 2), ttl=60):
        time.sleep(0.01)
    holds = readings.points("joblock.lock.hold_time")
    assert list(holds) == [attrs(outcome="released")]
    assert holds[attrs(outcome="released")].count == 1
    assert holds[attrs(outcome="released")].sum >= 0.01
    assert readings.counts("joblock.lock.lost") == {}


def test_a_release_after_expiry_counts_expired_and_after_another_holder_taken(
    locks: Locks, raw: Any, readings: Readings
) -> None:
    gone = locks.acquire(locks.key("Report", "gone"), ttl=60)
    taken = locks.acquire(locks.key("Report", "taken"), ttl=60)
    assert gone is not None and taken is not None
    expire(raw, gone.key)
    expire(raw, taken.key)
    raw.set(taken.key, b"another holder's token", ex=60)
    assert gone.release() is False
    assert taken.release() is False
    assert readings.counts("joblock.lock.lost") == {attrs(reason="expired"): 1, attrs(reason="taken"): 1}
    assert readings.total("joblock.lock.hold_time", outcome="lost") == 2
    # Already known to be gone: releasing again asks nothing of Redis and counts nothing.
    assert gone.release() is False
    assert readings.total("joblock.lock.lost") == 2


def test_extends_count_renewals_and_a_failed_one_as_lost(locks: Locks, raw: Any, readings: Readings) -> None:
    lease = locks.acquire(locks.key("Report", 3), ttl=60)
    assert lease is not None
    assert lease.extend(60) is True
    assert locks.extend_many([lease], 60) == [True]
    raw.set(lease.key, b"another holder's token", ex=60)
    assert lease.extend(60) is False
    assert readings.counts("joblock.lock.renewals") == {attrs(outcome="renewed"): 2, attrs(outcome="lost"): 1}
    assert readings.counts("joblock.lock.lost") == {attrs(reason="taken"): 1}
    assert readings.counts("joblock.lock.hold_time") == {attrs(outcome="lost"): 1}
    assert lease.release() is False  # lost already: no second loss, no second hold time
    assert readings.total("joblock.lock.lost") == 1
    assert readings.total("joblock.lock.hold_time") == 1


def test_an_unreachable_server_counts_an_error(core: ModuleType, down_url: str, readings: Readings) -> None:
    locks = locks_class(core)(down_url, retries=0, connect_timeout=1)
    try:
        with pytest.raises(joblock.ConnectionError):
            locks.acquire("k", ttl=60)
        with pytest.raises(joblock.BatchError):
            locks.acquire_many(["a", "b"], ttl=60)
    finally:
        locks.close()
    assert readings.counts("joblock.lock.acquisitions") == {
        attrs(outcome="error", operation="acquire"): 1,
        attrs(outcome="error", operation="acquire_many"): 1,
    }
    assert readings.counts("joblock.lock.wait_time") == {attrs(outcome="error"): 1}


# -- batches ---------------------------------------------------------------------------------


def test_batches_count_each_lock_and_record_their_size(locks: Locks, raw: Any, readings: Readings) -> None:
    keys = [locks.key("Sync", i) for i in range(10)]
    first = locks.acquire_many(keys[:4], ttl=60)
    leases = locks.acquire_many(iter(keys), ttl=60)  # a generator: its size is learnt as it goes
    assert [lease is None for lease in leases] == [True] * 4 + [False] * 6
    expire(raw, keys[4])
    raw.set(keys[5], b"another holder's token", ex=60)
    assert locks.release_many([*first, *leases, None]) == [True] * 4 + [False] * 6 + [True] * 4 + [False]

    assert readings.counts("joblock.lock.acquisitions") == {
        attrs(outcome="granted", operation="acquire_many"): 10,
        attrs(outcome="busy", operation="acquire_many"): 4,
    }
    sizes = readings.points("joblock.batch.size")
    assert {k: (p.count, p.sum) for k, p in sizes.items()} == {
        attrs(operation="acquire_many"): (2, 14),
        attrs(operation="release_many"): (1, 15),
    }
    assert readings.counts("joblock.lock.lost") == {attrs(reason="expired"): 1, attrs(reason="taken"): 1}
    assert readings.counts("joblock.lock.hold_time") == {
        attrs(outcome="released"): 8,
        attrs(outcome="lost"): 2,
    }


def test_dedupe_counts_for_its_job(locks: Locks, readings: Readings) -> None:
    leases = locks.dedupe("ProductSalesJob", [(1,), (2,), (1,)], ttl=60)
    assert [lease is None for lease in leases] == [False, False, True]
    locks.release_many(leases)
    assert readings.counts("joblock.lock.acquisitions") == {
        attrs(outcome="granted", operation="dedupe", job="ProductSalesJob"): 2,
        attrs(outcome="busy", operation="dedupe", job="ProductSalesJob"): 1,
    }
    assert readings.counts("joblock.lock.hold_time") == {attrs(outcome="released", job="ProductSalesJob"): 2}


# -- jobs ------------------------------------------------------------------------------------


def test_a_job_names_its_acquisitions_hold_time_and_loss(locks: Locks, raw: Any, readings: Readings) -> None:
    @locks.job(ttl=60, name="CleanupDataJob", identifier=lambda *args: None)
    def cleanup(inner: Callable[[], object] | None = None) -> object:
        return inner() if inner else None

    cleanup(cleanup)  # the inner run finds the outer one's lock busy
    cleanup(lambda: expire(raw, joblock.current_lease().key))  # type: ignore[union-attr]
    locks.acquire(locks.key("unrelated"), ttl=60)  # after the runs: no job of theirs

    assert readings.counts("joblock.lock.acquisitions") == {
        attrs(outcome="granted", operation="acquire", job="CleanupDataJob"): 2,
        attrs(outcome="busy", operation="acquire", job="CleanupDataJob"): 1,
        attrs(outcome="granted", operation="acquire"): 1,
    }
    assert readings.counts("joblock.lock.hold_time") == {
        attrs(outcome="released", job="CleanupDataJob"): 1,
        attrs(outcome="lost", job="CleanupDataJob"): 1,
    }
    assert readings.counts("joblock.lock.lost") == {attrs(reason="expired", job="CleanupDataJob"): 1}


def test_the_auto_renewer_counts_renewals_and_its_failures_to_reach_redis(
    core: ModuleType, readings: Readings
) -> None:
    with RedisServer() as server:
        locks = locks_class(core)(server.url, retries=0, connect_timeout=1)
        renewed = []

        # Renewed at a third of its ttl, about three times a second: a ttl that a renewal
        # late on a busy machine still outlives (a lease lost at its deadline is renewed
        # no more, and then no failure would ever be counted).
        @locks.job(ttl=1, name="LongJob", auto_renew=True)
        def long_job() -> None:
            wait_for(lambda: readings.total("joblock.lock.renewals", outcome="renewed") >= 2, 30, "renewals")
            renewed.append(True)
            server.stop()
            wait_for(lambda: readings.total("joblock.lock.renewals", outcome="error"), 30, "a failed renewal")

        with pytest.raises(joblock.ConnectionError):
            long_job()  # its release cannot reach the stopped server either
        locks.close()
    assert renewed == [True]
    counts = readings.counts("joblock.lock.renewals")
    assert counts[attrs(outcome="renewed", job="LongJob")] >= 2
    assert counts[attrs(outcome="error", job="LongJob")] >= 1
    assert set(counts) == {attrs(outcome="renewed", job="LongJob"), attrs(outcome="error", job="LongJob")}


def test_a_framework_policy_counts_for_its_job_at_enqueue_and_at_the_worker(
    locks: Locks, readings: Readings
) -> None:
    queued = frameworks.Policy(locks, ttl=60, name="export", lifetime=frameworks.UNTIL_EXECUTED)
    running = frameworks.Policy(locks, ttl=60, name="report")
    admission = frameworks.admit(queued, (1,), {})
    assert admission.lease is not None
    assert frameworks.admit(queued, (1,), {}).send is False  # a duplicate, dropped at enqueue
    run = frameworks.Run(running, None, (7,), {})
    assert run.begin() is None
    with run:
        pass
    admission.abandon()

    assert readings.counts("joblock.lock.acquisitions") == {
        attrs(outcome="granted", operation="acquire", job="export"): 1,
        attrs(outcome="busy", operation="acquire", job="export"): 1,
        attrs(outcome="granted", operation="acquire", job="report"): 1,
    }
    assert readings.counts("joblock.lock.hold_time") == {
        attrs(outcome="released", job="report"): 1,
        attrs(outcome="released", job="export"): 1,
    }


# -- asyncio, cluster, Redlock ---------------------------------------------------------------


def test_asyncio_clients_record_the_same(
    core: ModuleType, redis_server: RedisServer, readings: Readings
) -> None:
    async def main() -> None:
        locks = type("AsyncLocks", (AsyncLocks,), {"_core": core})(redis_server.url, prefix="aio-metrics")
        try:

            @locks.job(ttl=60, name="AsyncJob")
            async def job(x: int) -> None:
                assert await locks.acquire(locks.key("AsyncJob", x), ttl=60) is None

            await job(1)
            a, b = locks.key("a", core.__name__), locks.key("b", core.__name__)
            leases = await locks.acquire_many([a, b, a], ttl=60)
            assert await locks.extend_many(leases, 60) == [True, True, False]
            assert await locks.release_many(leases) == [True, True, False]
        finally:
            await locks.close()

    asyncio.run(main())
    assert readings.counts("joblock.lock.acquisitions") == {
        attrs(outcome="granted", operation="acquire", job="AsyncJob"): 1,
        attrs(outcome="busy", operation="acquire"): 1,  # the job's body's own acquire: no job
        attrs(outcome="granted", operation="acquire_many"): 2,
        attrs(outcome="busy", operation="acquire_many"): 1,
    }
    assert readings.counts("joblock.lock.renewals") == {attrs(outcome="renewed"): 2}
    assert readings.counts("joblock.lock.hold_time") == {
        attrs(outcome="released", job="AsyncJob"): 1,
        attrs(outcome="released"): 2,
    }


def test_cluster_locks_record_the_same(
    core: ModuleType, cluster: Any, cluster_raw: Any, readings: Readings
) -> None:
    locks = type("ClusterLocks", (ClusterLocks,), {"_core": core})(cluster.url, prefix="cluster-metrics")
    try:
        lease = locks.acquire(locks.key("one", core.__name__), ttl=60)
        assert lease is not None
        leases = locks.acquire_many(
            [locks.key("many", core.__name__, i) for i in range(30)], ttl=60
        )  # every primary gets some
        cluster_raw.set(lease.key, b"another holder's token", ex=60)
        assert lease.release() is False
        assert locks.release_many(leases) == [True] * 30
    finally:
        locks.close()
    assert readings.counts("joblock.lock.acquisitions") == {
        attrs(outcome="granted", operation="acquire"): 1,
        attrs(outcome="granted", operation="acquire_many"): 30,
    }
    assert readings.counts("joblock.lock.lost") == {attrs(reason="taken"): 1}
    assert readings.counts("joblock.lock.hold_time") == {
        attrs(outcome="released"): 30,
        attrs(outcome="lost"): 1,
    }


def test_redlock_counts_its_acquisitions(
    core: ModuleType, servers: list[RedisServer], readings: Readings
) -> None:
    redlock = type("Redlock", (Redlock,), {"_core": core})(
        [s.url for s in servers[:3]], prefix="redlock-metrics"
    )
    try:
        key = redlock.key("r", core.__name__)
        lease = redlock.acquire(key, ttl=60)
        assert lease is not None
        assert redlock.acquire(key, ttl=60) is None
        assert lease.release() is True
    finally:
        redlock.close()
    assert readings.counts("joblock.lock.acquisitions") == {
        attrs(outcome="granted", operation="acquire"): 1,
        attrs(outcome="busy", operation="acquire"): 1,
    }
    assert readings.counts("joblock.lock.hold_time") == {}  # a RedlockLease carries no grant time


# -- on and off ------------------------------------------------------------------------------


def test_nothing_is_recorded_after_uninstrument(locks: Locks, raw: Any, readings: Readings) -> None:
    before = locks.acquire(locks.key("before"), ttl=60)
    joblock.uninstrument()
    assert metrics.recorder is None
    meanwhile = locks.acquire(locks.key("meanwhile"), ttl=60)
    assert before is not None and meanwhile is not None
    assert before.release() is True
    assert locks.dedupe("J", [(1,)], ttl=60)[0] is not None
    assert readings.total("joblock.lock.acquisitions") == 1
    assert readings.total("joblock.lock.hold_time") == 0

    # On again: a lease granted meanwhile counts its loss, but has no grant time to hold from.
    joblock.instrument(meter_provider=readings.provider)
    expire(raw, meanwhile.key)
    assert meanwhile.release() is False
    assert readings.counts("joblock.lock.lost") == {attrs(reason="expired"): 1}
    assert readings.total("joblock.lock.hold_time") == 0


def test_instrument_says_what_to_install_when_opentelemetry_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # makes `import opentelemetry` fail
    with pytest.raises(ImportError, match=r"pip install 'joblock\[otel\]'"):
        joblock.instrument()
    assert metrics.recorder is None
