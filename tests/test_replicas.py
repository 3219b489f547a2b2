"""min_replicas: grants and extends confirmed by replicas (WAIT), on real primaries and replicas.

Every test runs on each twin of the core. What a confirmation promises is checked
where it matters: the moment a call returns a lease, the replica already has it; a
grant too few replicas acknowledged is gone from the primary when ReplicationError
is raised; and a primary SIGKILLed right after grants loses none of the confirmed
ones to a second holder, where the unconfirmed can be lost (Sentinel and Cluster).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis

import joblock
from conftest import locks_class
from joblock._tools.servers import LocalCluster, RedisServer
from joblock.aio import AsyncLocks
from joblock.cluster import ClusterLocks
from rig.faults import FaultProxy
from rig.sentinels import LocalSentinels

# Full syncs start at once (Redis 7 waits 5 s for more replicas by default).
NO_DELAY = ("--repl-diskless-sync-delay", "0")
FAILOVER_WAIT = 60.0
# Where a confirmation must succeed, a replica just online may take up to its once-a-second
# report to acknowledge: WAIT returns as soon as it does, so a long timeout costs nothing.
PATIENT = 3


def wait_until(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def in_sync(primary: RedisServer) -> bool:
    """Whether the replica acknowledges writes (a replica just online may not yet)."""
    with redis.Redis(port=primary.port) as client:
        client.set("rep:probe", 1)
        return client.execute_command("WAIT", 1, 100) == 1  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and its replica."""
    with (
        RedisServer(*NO_DELAY) as primary,
        RedisServer(*NO_DELAY, "--replicaof", "127.0.0.1", str(primary.port)) as replica,
    ):
        wait_until(lambda: in_sync(primary), "the replica to sync")
        yield primary, replica


@pytest.fixture
def clients(pair: tuple[RedisServer, RedisServer]) -> Iterator[tuple[Any, Any]]:
    primary, replica = pair
    with redis.Redis(port=primary.port) as on_primary, redis.Redis(port=replica.port) as on_replica:
        yield on_primary, on_replica


def async_class(core: ModuleType) -> type[AsyncLocks]:
    return type("AsyncLocks", (AsyncLocks,), {"_core": core})


def test_a_confirmed_grant_is_on_the_replica_when_the_call_returns(core, pair, clients):
    primary, _ = pair
    _, on_replica = clients
    locks = locks_class(core)(primary.url + f"?min_replicas=1&replica_timeout={PATIENT}", prefix="")
    try:
        lease = locks.acquire("rep:one", 30)
        assert lease is not None and on_replica.get("rep:one") == lease.token
        assert lease.extend(60) and on_replica.pttl("rep:one") > 30_000
        fenced = locks.acquire("{rep}:fenced", 30, fence=True)
        assert fenced is not None and on_replica.get("{rep}:fenced") == fenced.token
        counting = locks.acquire("{rep}:counted", 30, limit=2)
        assert counting is not None and on_replica.zscore("{rep}:counted", counting._value) is not None
        keys = [f"rep:many:{i}" for i in range(2500)]  # three windows
        leases = locks.acquire_many(keys, 30)
        assert all(leases) and on_replica.mget(keys) == [lease.token for lease in leases]
        assert locks.extend_many(leases, 90) == [True] * len(keys)
        assert on_replica.pttl(keys[-1]) > 60_000
        deduped = locks.dedupe("RepJob", [(1,), (2,), (1,)], 30)
        assert deduped[0] is not None and deduped[2] is None
        assert on_replica.get(deduped[1].key) == deduped[1].token
        waited = locks.acquire("rep:waited", 30, wait=1)  # the wait path confirms by an extend
        assert waited is not None and on_replica.get("rep:waited") == waited.token
        locks.release_many([lease, fenced, counting, waited, *leases, *deduped])
    finally:
        locks.close()


def test_asyncio_grants_are_confirmed_too(core, pair, clients):
    primary, _ = pair
    _, on_replica = clients

    async def main() -> None:
        locks = async_class(core)(primary.url, prefix="", min_replicas=1, replica_timeout=PATIENT)
        try:
            lease = await locks.acquire("rep:async", 30)
            assert lease is not None and on_replica.get("rep:async") == lease.token
            assert await lease.extend(60)
            leases = await locks.acquire_many([f"rep:amany:{i}" for i in range(10)], 30)
            assert all(leases) and await locks.extend_many(leases, 30) == [True] * 10
            with pytest.raises(joblock.ReplicationError):
                await locks.acquire("rep:async-two", 30, min_replicas=2)
            await locks.release_many([lease, *leases])
        finally:
            await locks.close()

    asyncio.run(main())
    assert not clients[0].exists("rep:async-two")


def test_callers_confirmed_together_share_one_wait(core, pair, clients):
    """Redis holds a connection while its WAIT waits: one WAIT at the end of a write
    covers every grant in it, so a lagging replica delays the connection's other callers
    by one replica_timeout per write, not one per confirming caller."""
    primary, _ = pair
    on_primary, _ = clients

    def waits() -> int:
        return int(on_primary.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))

    async def main() -> None:
        locks = async_class(core)(primary.url, prefix="", min_replicas=1, replica_timeout=PATIENT)
        try:
            await locks.acquire("rep:together:warm", 30)  # connected, scripts loaded
            before = waits()
            leases = await asyncio.gather(*(locks.acquire(f"rep:together:{i}", 30) for i in range(12)))
            # The first caller on an idle connection writes at once, the eleven others together.
            assert all(leases) and waits() - before == 2
            await locks.release_many(leases)
        finally:
            await locks.close()

    asyncio.run(main())


def waits(on_primary: Any) -> int:
    """How many WAITs the primary ran so far."""
    return int(on_primary.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def test_a_confirmed_batch_waits_once_per_connection_behind_its_last_window(core, pair, clients):
    """A batch's leases are handed out together: one WAIT behind its last window confirms
    every window before it (one WAIT per window stalled the connection as many times)."""
    primary, _ = pair
    on_primary, on_replica = clients
    locks = locks_class(core)(primary.url, prefix="", min_replicas=1, replica_timeout=PATIENT)
    try:
        locks.acquire("rep:once:warm", 30).release()  # connected, scripts loaded
        keys = [f"rep:once:{i}" for i in range(2500)]  # three windows
        before = waits(on_primary)
        leases = locks.acquire_many(keys, 30)
        assert waits(on_primary) - before == 1
        assert all(leases) and on_replica.mget(keys) == [lease.token for lease in leases]

        before = waits(on_primary)
        assert locks.extend_many(leases, 90) == [True] * len(keys)
        assert waits(on_primary) - before == 1
        assert min(on_replica.pttl(key) for key in keys[::499]) > 60_000

        before = waits(on_primary)
        deduped = locks.dedupe("RepOnce", ((i % 2000,) for i in range(2500)), 30)  # a generator
        assert waits(on_primary) - before == 1
        assert all(deduped[:2000]) and not any(deduped[2000:])
        assert on_replica.mget([lease.key for lease in deduped[:2000]]) == [
            lease.token for lease in deduped[:2000]
        ]

        before = waits(on_primary)
        assert locks.release_many(leases + deduped) == [True] * 4500 + [False] * 500
        assert waits(on_primary) == before  # releases ask for no confirmation
    finally:
        locks.close()


def test_a_confirmed_call_leaves_its_result_to_the_caller_alone(core, pair, clients):
    """Once its WAIT answered, a confirmed call keeps no reference to what it returned:
    the leases go with the caller's last reference, as an unconfirmed call's do, not at
    the cyclic GC's next full collection (the operation and its confirmation referred
    to each other, and a batch's operation holds the list of leases it returned)."""
    primary, _ = pair
    locks = locks_class(core)(primary.url, prefix="", min_replicas=1, replica_timeout=PATIENT)
    collecting = gc.isenabled()
    gc.disable()  # nothing collected meanwhile: a cycle would still hold the result
    try:
        leases = locks.acquire_many([f"rep:alone:{i}" for i in range(2500)], 30)  # three windows
        deduped = locks.dedupe("RepAlone", ((i,) for i in range(2500)), 30)
        lease = locks.acquire("rep:alone", 30)
        assert all(leases) and all(deduped) and lease
        assert sys.getrefcount(leases) == 2  # its name here, and getrefcount's argument
        assert sys.getrefcount(deduped) == 2
        assert sys.getrefcount(lease) == 2
        assert locks.release_many([*leases, *deduped, lease]) == [True] * 5001
    finally:
        if collecting:
            gc.enable()
        locks.close()


def test_a_batch_that_goes_on_writing_waits_now_and_then(core, pair, clients, monkeypatch):
    """A long batch asks for a WAIT on a server once SPACING times replica_timeout passed
    since the first window it has not confirmed: a replica that cannot keep up is never
    far behind when the last WAIT waits for it, and a missing one is found out early."""
    from joblock._engine import batches

    now = [0.0]  # the batches' clock, moved on by the generator
    monkeypatch.setattr(batches, "monotonic", lambda: now[0])

    def generated(prefix: str, n: int, pulled: list[int] | None = None) -> Iterator[str]:
        for i in range(n):
            if i in (1000, 2000):  # past SPACING times replica_timeout: a WAIT is due
                now[0] += 100
            if pulled is not None:
                pulled.append(i)
            yield f"{prefix}:{i}"

    primary, _ = pair
    on_primary, on_replica = clients
    locks = locks_class(core)(primary.url, prefix="", min_replicas=1, replica_timeout=PATIENT, window=500)
    try:
        locks.acquire("rep:long:warm", 30).release()
        keys = list(generated("rep:long", 3000))
        before = waits(on_primary)
        leases = locks.acquire_many(generated("rep:long", 3000), 30)
        assert waits(on_primary) - before == 3  # once each time the clock moved, once at the end
        assert all(leases) and on_replica.mget(keys) == [lease.token for lease in leases]
        locks.release_many(leases)
    finally:
        locks.close()

    # Too few replicas: the batch stops at the first WAIT that says so, not at its end.
    pulled: list[int] = []
    short = locks_class(core)(primary.url, prefix="", min_replicas=2, replica_timeout=0.1, window=500)
    try:
        with pytest.raises(joblock.ReplicationError) as raised:
            short.acquire_many(generated("rep:short", 20_000, pulled), 30)
        assert raised.value.released and raised.value.needed == 2
        assert len(pulled) < 5000
        assert not list(on_primary.scan_iter(match="rep:short:*", count=1000))
    finally:
        short.close()


def test_crowds_of_threads_and_tasks_each_get_a_confirmed_lease(core, pair, clients):
    """Single calls sharing a connection still wait for their own confirmation."""
    primary, _ = pair
    _, on_replica = clients
    locks = locks_class(core)(primary.url, prefix="", min_replicas=1, replica_timeout=PATIENT)
    seen: list[bool] = []

    def take(i: int) -> None:
        for j in range(20):
            lease = locks.acquire(f"rep:crowd:{i}:{j}", 30)
            assert lease is not None
            seen.append(on_replica.get(lease.key) == lease.token)  # before anything else
            assert lease.release()

    try:
        threads = [threading.Thread(target=take, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        locks.close()
    assert len(seen) == 16 * 20 and all(seen)

    async def main() -> list[bool]:
        alocks = async_class(core)(primary.url, prefix="", min_replicas=1, replica_timeout=PATIENT)
        with redis.Redis(port=pair[1].port) as replica:

            async def one(i: int) -> bool:
                lease = await alocks.acquire(f"rep:acrowd:{i}", 30)
                assert lease is not None
                here = replica.get(lease.key) == lease.token  # no await between: nothing ran since
                assert await lease.release()
                return here

            try:
                return await asyncio.gather(*(one(i) for i in range(64)))
            finally:
                await alocks.close()

    assert all(asyncio.run(main()))


def test_a_batch_whose_wait_reply_was_cut_is_confirmed_again(core, pair, clients):
    """The windows' replies came, the WAIT's was lost with the connection: the batch's
    leases are confirmed by an extend and a WAIT on the new connection."""
    primary, _ = pair
    _, on_replica = clients
    proxy = FaultProxy(primary.port)
    locks = locks_class(core)(proxy.url, prefix="", min_replicas=1, replica_timeout=PATIENT)
    try:
        locks.acquire("rep:bcut:warm", 30).release()
        keys = [f"rep:bcut:{i}" for i in range(3)]
        proxy.cut_after(3 * len(b"$-1\r\n"))  # the SET NX GET replies pass; the WAIT reply is cut
        leases = locks.acquire_many(keys, 30)
        assert proxy.cut == 1
        assert all(leases) and on_replica.mget(keys) == [lease.token for lease in leases]
        assert locks.release_many(leases) == [True] * 3
    finally:
        locks.close()
        proxy.close()


def test_a_confirm_where_the_batch_wrote_nothing_is_unsure(core):
    """Without I/O: on a connection that carried the batch's windows, its Confirm becomes
    one WAIT at the end of the write; on one that did not (the first broke after the
    windows were answered), a WAIT would count none of them, so nothing is written and
    the count is unsure (the plan then confirms by an extend)."""
    from joblock._engine.ops import Operation
    from joblock._engine.replicas import Replicas, confirm
    from joblock._engine.requests import Request
    from joblock._engine.wire import Wire
    from joblock.settings import parse_url

    class Windows(Operation):
        def answer(self, request: Any, replies: list[Any]) -> None:
            self.got = replies

    def ready_wire() -> Any:
        wire = Wire(core, parse_url("redis://127.0.0.1:1/0", native_commands=False), set())
        wire.connected()  # nothing to say first: ready
        return wire

    op = Windows(0)
    replicas = Replicas(op, core, 1, 0.5, batched=True)
    op.replicas = replicas
    wire = ready_wire()
    for _ in range(2):
        wire.submit(Request(op, None, core.encode_command((b"GET", b"k")), 1))
    wire.submit(confirm(replicas, None))
    wait = core.encode_command((b"WAIT", 1, 500))
    assert wire.output() == core.encode_command((b"GET", b"k")) * 2 + wait
    assert replicas.pending == 1
    wire.feed(b"$-1\r\n$-1\r\n:1\r\n")
    assert replicas.pending == 0 and replicas.confirmed

    elsewhere = Replicas(op, core, 1, 0.5, batched=True)
    op.replicas = elsewhere
    fresh = ready_wire()
    fresh.submit(confirm(elsewhere, None))
    assert fresh.output() is None
    assert elsewhere.pending == 0 and elsewhere.unsure and not elsewhere.confirmed


def test_too_few_replicas_releases_the_grant_and_raises(core, pair, clients):
    primary, _ = pair
    on_primary, _ = clients
    locks = locks_class(core)(primary.url, prefix="", replica_timeout=0.1)
    try:
        with pytest.raises(joblock.ReplicationError) as raised:
            locks.acquire("rep:two", 30, min_replicas=2)
        error = raised.value
        assert (error.key, error.acknowledged, error.needed, error.released) == ("rep:two", 1, 2, True)
        assert not error.extend and error.more == 0
        assert "'rep:two'" in str(error) and "min_replicas=2" in str(error)
        assert not on_primary.exists("rep:two")  # given up before the error was raised

        keys = [f"rep:batch:{i}" for i in range(1500)]
        before = waits(on_primary)
        with pytest.raises(joblock.ReplicationError) as raised:
            locks.acquire_many(keys, 30, min_replicas=2)
        assert waits(on_primary) - before == 1  # one replica_timeout, not one per window
        # (One replica, if it caught up within the tenth of a second.)
        assert (raised.value.needed, raised.value.released, raised.value.more) == (2, True, 1499)
        assert on_primary.exists(*keys) == 0
        with pytest.raises(joblock.ReplicationError):
            locks.dedupe("RepJob2", [(1,), (2,)], 30, min_replicas=2)
        assert on_primary.exists("RepJob2:1", "RepJob2:2") == 0

        # An extend too few replicas acknowledged keeps its lock: the holder still has it, and
        # the replicas the expiry they last acknowledged (giving it up would lose it for sure).
        lease = locks.acquire("rep:extended", 30)  # the client's default: no confirmation
        assert lease is not None
        with pytest.raises(joblock.ReplicationError) as raised:
            lease.extend(60, min_replicas=2)
        assert (raised.value.extend, raised.value.released) == (True, False)
        assert "still held" in str(raised.value)
        assert lease.held and on_primary.pttl("rep:extended") > 30_000
        # Its deadline is the one the replicas acknowledged, not the unconfirmed extend's.
        assert 0 < lease.valid_for() <= 30
        leases = locks.acquire_many(["rep:e1", "rep:e2"], 30)
        with pytest.raises(joblock.ReplicationError) as raised:
            locks.extend_many(leases, 60, min_replicas=2)
        assert raised.value.more == 1 and "and 1 more" in str(raised.value)
        assert on_primary.exists("rep:e1", "rep:e2") == 2 and all(lease.held for lease in leases)
        assert all(0 < lease.valid_for() <= 30 for lease in leases)
        assert locks.release_many([lease, *leases]) == [True] * 3

        # A batch whose every key is taken already grants nothing: there is nothing to confirm.
        taken = locks.acquire_many(["rep:t1", "rep:t2"], 30)
        assert locks.acquire_many(["rep:t1", "rep:t2"], 30, min_replicas=2) == [None, None]
        assert locks.dedupe("RepJob3", [(1,), (1,)], 30, min_replicas=0)[1] is None
        locks.release_many(taken)
    finally:
        locks.close()


def test_a_stopped_replica_acknowledges_nothing(core, pair, clients):
    primary, replica = pair
    on_primary, _ = clients
    locks = locks_class(core)(primary.url, prefix="", min_replicas=1, replica_timeout=0.2)
    assert replica.process is not None
    os.kill(replica.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(joblock.ReplicationError) as raised:
            locks.acquire("rep:stopped", 30)
        assert raised.value.acknowledged == 0
        assert not on_primary.exists("rep:stopped")
    finally:
        os.kill(replica.process.pid, signal.SIGCONT)
        locks.close()
    resumed: list[Any] = []
    wait_until(lambda: resumed.append(locks.acquire("rep:resumed", 30)) or resumed[-1], "acknowledgements")
    resumed[-1].release()


def test_a_caller_that_stops_while_its_lock_is_confirmed_gives_it_back(core, pair, clients):
    """A waiting (or fair) acquire's grant is confirmed by an extend after it: a task
    cancelled during that confirmation leaves no lock behind."""
    primary, replica = pair
    on_primary, _ = clients
    assert replica.process is not None

    async def main() -> None:
        locks = async_class(core)(primary.url, prefix="", min_replicas=1, replica_timeout=1)
        try:
            for options in ({"wait": 5}, {"fair": True}, {}):
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(locks.acquire("rep:cancelled", 30, **options), 0.2)
                await asyncio.sleep(1.5)  # the WAIT times out, then the grant is given back
                assert not on_primary.exists("rep:cancelled"), options
        finally:
            await locks.close()

    os.kill(replica.process.pid, signal.SIGSTOP)
    try:
        asyncio.run(main())
    finally:
        os.kill(replica.process.pid, signal.SIGCONT)


def test_a_connection_cut_before_the_wait_reply_is_confirmed_again(core, pair, clients):
    """The grant's reply came, WAIT's was lost with the connection: a WAIT on a new
    connection would count nothing of the grant, so an extend (a write there) goes first."""
    primary, _ = pair
    _, on_replica = clients
    proxy = FaultProxy(primary.port)
    locks = locks_class(core)(proxy.url, prefix="", min_replicas=1, replica_timeout=PATIENT)
    try:
        warm = locks.acquire("rep:warm", 30)  # the handshake and script loads out of the way
        assert warm is not None and warm.release()
        proxy.cut_after(len(b"$-1\r\n"))  # the SET NX GET reply passes; the WAIT reply is cut
        lease = locks.acquire("rep:cut", 30)
        assert proxy.cut == 1
        assert lease is not None and on_replica.get("rep:cut") == lease.token
        assert lease.release()
    finally:
        locks.close()
        proxy.close()


def test_min_replicas_from_the_url_and_bad_values(core, pair, clients):
    primary, _ = pair
    on_primary, _ = clients
    locks = locks_class(core)(primary.url + "?min_replicas=1&replica_timeout=0.25", prefix="")
    try:
        assert (locks.settings.min_replicas, locks.settings.replica_timeout) == (1, 0.25)
        for bad, kind in ((True, TypeError), ("1", TypeError), (-1, ValueError), (101, ValueError)):
            with pytest.raises(kind, match="min_replicas"):
                locks.acquire("rep:bad", 30, min_replicas=bad)
            with pytest.raises(kind, match="min_replicas"):
                locks.acquire_many(["rep:bad"], 30, min_replicas=bad)
        assert not on_primary.exists("rep:bad")
    finally:
        locks.close()
    with pytest.raises(ValueError, match="min_replicas"):
        joblock.Locks(primary.url + "?min_replicas=many")
    with pytest.raises(ValueError, match="min_replicas"):
        joblock.Locks(primary.url + "?min_replicas=1000")
    with pytest.raises(ValueError, match="replica_timeout"):
        joblock.Locks(primary.url, replica_timeout=0)
    # A WAIT that outlasts the socket's timeout would end the connection of every caller:
    # refused when the client is made, if it asks for one, and else at the call that does.
    with pytest.raises(ValueError, match=r"replica_timeout \(2\.0 s\) .* socket_timeout \(1\.0 s\)"):
        locks_class(core)(primary.url, prefix="", min_replicas=1, replica_timeout=2, socket_timeout=1)
    slow = locks_class(core)(primary.url, prefix="", socket_timeout=0.4)  # the default replica_timeout: 0.5
    try:
        with pytest.raises(ValueError, match=r"replica_timeout \(0\.5 s\) .* socket_timeout \(0\.4 s\)"):
            slow.acquire("rep:slow", 30, min_replicas=1)
        assert not on_primary.exists("rep:slow")
        released = slow.acquire("rep:released", 30, min_replicas=0)
        assert released is not None and released.release()
        with pytest.raises(TypeError, match="min_replicas"):
            released.extend(30, min_replicas="x")
    finally:
        slow.close()


def test_cluster_grants_are_confirmed_by_each_primarys_replica(core, cluster, cluster_raw):
    cluster.wait_replicated()
    locks = type("ClusterLocks", (ClusterLocks,), {"_core": core})(
        cluster.url, prefix="", min_replicas=1, replica_timeout=PATIENT
    )
    try:
        lease = locks.acquire("rep:cluster", 30)
        assert lease is not None and lease.extend(30)
        primaries = [redis.Redis(port=node.port) for node in cluster.primaries()]
        before = sum(waits(node) for node in primaries)
        leases = locks.acquire_many([f"rep:cluster:{i}" for i in range(300)], 30)  # every primary
        assert sum(waits(node) for node in primaries) - before == len(primaries)  # one WAIT each
        for node in primaries:
            node.close()
        assert all(leases) and locks.extend_many(leases, 30) == [True] * 300
        with pytest.raises(joblock.ReplicationError):
            locks.acquire("rep:cluster:two", 30, min_replicas=2)
        assert not cluster_raw.exists("rep:cluster:two")
        locks.release_many([lease, *leases])
    finally:
        locks.close()


# -- failover ------------------------------------------------------------------------------------


def test_a_sigkilled_primary_loses_no_confirmed_lock_but_may_lose_the_others(core):
    """The replication link runs through a proxy, stalled before the last grants: the
    replica never sees them. Without min_replicas the grant is handed out and lost in
    the failover (a second holder gets it); with it, the grant is refused and given up.
    Locks confirmed before the stall survive."""
    proxies: list[FaultProxy] = []

    def through_proxy(port: int) -> int:
        proxies.append(FaultProxy(port))
        return proxies[0].port

    try:
        with LocalSentinels(replica_via=through_proxy) as deployment:
            holder = locks_class(core)(deployment.url, prefix="", replica_timeout=2)
            confirmed = [holder.acquire(f"fo:confirmed:{i}", 120, min_replicas=1) for i in range(20)]
            assert all(confirmed)
            proxies[0].stall(600)  # the replica hears nothing more
            unconfirmed = holder.acquire("fo:unconfirmed", 120)  # handed out: no confirmation asked
            assert unconfirmed is not None
            with pytest.raises(joblock.ReplicationError) as raised:
                holder.acquire("fo:refused", 120, min_replicas=1)
            assert raised.value.acknowledged == 0
            old = deployment.primary()
            old.kill()
            proxies[0].close()
            wait_until(lambda: deployment.primary() is not old, "the sentinels to fail over", FAILOVER_WAIT)

            second = locks_class(core)(deployment.url, prefix="")
            taken: list[Any] = []
            wait_until(lambda: _try(second, "fo:unconfirmed", taken), "the new primary", FAILOVER_WAIT)
            assert taken[0] is not None  # the documented loss: two holders of one lock
            assert not unconfirmed.extend(120)  # and the first learns it only now
            assert [second.acquire(f"fo:confirmed:{i}", 120) for i in range(20)] == [None] * 20
            assert all(lease.extend(120) for lease in confirmed)  # still theirs
            holder.close()
            second.close()
    finally:
        for proxy in proxies:
            proxy.close()


def _try(locks: Any, key: str, out: list[Any]) -> bool:
    try:
        out.append(locks.acquire(key, 120))
    except (joblock.ConnectionError, joblock.ReadOnlyError):
        return False
    return True


def test_a_cluster_primary_sigkilled_after_confirmed_grants_loses_none_of_them(core):
    with LocalCluster(primaries=3, replicas=1) as own:
        own.wait_replicated()
        cls = type("ClusterLocks", (ClusterLocks,), {"_core": core})
        holder = cls(own.url, prefix="", min_replicas=1, replica_timeout=PATIENT)
        keys = [f"fo:cluster:{i}" for i in range(600)]
        leases = holder.acquire_many(keys, 120)
        singles = [holder.acquire(f"fo:single:{i}", 120) for i in range(30)]
        assert all(leases) and all(singles)
        victim = own.primaries()[0]
        victim.kill()
        wait_until(lambda: _cluster_served(own), "the cluster to promote a replica", FAILOVER_WAIT)
        second = cls(own.alive()[0].url, prefix="")  # the first node may be the one killed
        assert second.acquire_many(keys, 120) == [None] * len(keys)
        assert [second.acquire(f"fo:single:{i}", 120) for i in range(30)] == [None] * 30
        # Still theirs (confirmed by nothing now: the promoted primary has no replica left).
        assert holder.extend_many(leases + singles, 120, min_replicas=0) == [True] * (len(keys) + 30)
        holder.close()
        second.close()


def _cluster_served(cluster: LocalCluster) -> bool:
    try:
        cluster.wait_ok(timeout=0.5)
    except RuntimeError:
        return False
    alive = cluster.alive()
    return all(primary in alive for primary in cluster.primaries())


def test_job_locks_are_confirmed_through_their_client(core, pair, clients):
    """A job decorator takes its lock with its client's min_replicas: a lock too few
    replicas acknowledged is not run under, and is given back."""
    primary, _ = pair
    on_primary, _ = clients
    ran: list[int] = []
    confirmed = locks_class(core)(primary.url, prefix="jobs", min_replicas=1, replica_timeout=PATIENT)
    unconfirmable = locks_class(core)(primary.url, prefix="jobs", min_replicas=2, replica_timeout=0.1)
    try:

        @confirmed.job(ttl=30, name="RepJob")
        def kept(n: int) -> int:
            ran.append(n)
            return n

        @unconfirmable.job(ttl=30, name="RepJob")
        def refused(n: int) -> int:
            ran.append(-n)
            return n

        assert kept(1) == 1
        with pytest.raises(joblock.ReplicationError):
            refused(2)
        assert ran == [1]
        assert not on_primary.exists("jobs:RepJob:2")
    finally:
        confirmed.close()
        unconfirmable.close()


def test_async_cluster_grants_are_confirmed(core, cluster, cluster_raw):
    from joblock.aio import AsyncClusterLocks

    cluster.wait_replicated()
    cls = type("AsyncClusterLocks", (AsyncClusterLocks,), {"_core": core})

    async def main() -> None:
        locks = cls(cluster.url, prefix="", min_replicas=1, replica_timeout=PATIENT)
        try:
            lease = await locks.acquire("rep:acluster", 30)
            assert lease is not None and await lease.extend(30)
            leases = await locks.acquire_many([f"rep:acluster:{i}" for i in range(100)], 30)
            assert all(leases)
            with pytest.raises(joblock.ReplicationError):
                await locks.acquire("rep:acluster:two", 30, min_replicas=2)
            await locks.release_many([lease, *leases])
        finally:
            await locks.close()

    asyncio.run(main())
    assert not cluster_raw.exists("rep:acluster:two")


def test_redlock_refuses_min_replicas(servers):
    with pytest.raises(ValueError, match="min_replicas"):
        joblock.Redlock([s.url for s in servers], min_replicas=1)
    with pytest.raises(ValueError, match="min_replicas"):
        joblock.Redlock([s.url + "?min_replicas=1" for s in servers])
