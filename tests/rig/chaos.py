"""The chaos run: many processes take locks while faults come together, for minutes.

    bash scripts/chaos.sh --duration 90      # what CI runs (PYTHONPATH=tests python -m rig.chaos)
    bash scripts/chaos.sh --duration 600     # the 10-minute run of docs/guarantees.md
    bash scripts/chaos.sh --cluster --duration 600   # the same on a Redis Cluster

Two deployments run side by side, each with its own worker processes
(``chaos_work``): a single Redis, and a primary with a replica watched by three
sentinels (``redis+sentinel://`` clients). Every Redis server is behind a
``FaultProxy``: clients, the sentinels and the replication all go through it. The
servers persist every write before answering it (AOF, ``appendfsync always``): a
restart without persistence forgets granted locks and fencing counters, which no
client can make safe (docs/guarantees.md).

Two threads per deployment inject faults, so that they overlap:

- the network: latency with jitter for a few seconds, stalls that hold all traffic for
  seconds, resets in the middle of a reply;
- the server: SIGSTOP then SIGCONT, a restart (SIGKILL, then the AOF is loaded), and
  on the Sentinel deployment failovers. A coordinated one pauses the primary's writes
  (``CLIENT PAUSE WRITE``), waits for the replica to have every write, has the
  sentinels promote it (``SENTINEL FAILOVER``) and makes the old primary its replica
  at once: ``SENTINEL FAILOVER`` alone does not wait for the replica, and the old
  primary would go on granting locks for seconds that the new one never sees. The
  primary is also SIGKILLed, and the sentinels promote the replica on their own: the
  Sentinel clients use ``min_replicas=1`` (grants and extends confirmed by ``WAIT``),
  without which such a failover loses locks (``--min-replicas 0`` shows it).

Stalls and stops stay shorter than the sentinels' ``down-after-milliseconds``, so the
only failovers are the ones injected.

With ``--cluster`` the deployment is a Redis Cluster instead (``Cluster``: 3 primaries
with a replica each, persistent), used through ``ClusterLocks`` and ``AsyncClusterLocks``
with ``min_replicas=1``. Every node is behind two proxies, one for its clients and its
replica, one for its cluster bus; the server faults come in shuffled rounds of each kind:
a primary SIGSTOPped, restarted, failed over by ``CLUSTER FAILOVER`` on its replica,
SIGKILLed for the cluster to promote its replica on its own (then started again: it
rejoins as a replica), and a slot holding locks migrated to another primary
(``SETSLOT``, ``MIGRATE``) while the clients use it.

Every holder writes its fencing number to a guarded resource
(``chaos_work.GUARD_SCRIPT``); the run counts operations, faults, and three numbers that
must be 0, defined in ``silent_losses`` and docs/guarantees.md. It prints them as
Markdown tables and exits 1 if one is not 0 (2 if the run itself failed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue
import random
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from joblock import errors
from joblock._core import compiled, core
from joblock._engine.sync import call
from joblock._tools.servers import LocalCluster, RedisServer
from joblock.settings import Settings
from rig.chaos_work import MARGIN, LeaseRecord, Plan, Tally, work
from rig.faults import FaultProxy
from rig.migration import Migration
from rig.sentinels import LocalSentinels

__all__ = ["main"]

# Every write on disk before its reply: a restart loses nothing that was acknowledged.
PERSISTENT = ("--appendonly", "yes", "--appendfsync", "always")
# The sentinels call a primary down after this long without an answer: well above the
# longest stall plus the longest stop, so that only injected failovers happen.
DOWN_AFTER_MS = 8000
LONGEST_STALL = 2.5
LONGEST_STOP = 1.5
# Seconds a worker's calls may run past the end, and the parent waits for them.
GRACE = 60.0
# A Cluster's nodes call one failed after this long without an answer on the bus, and
# its replica takes over: above the longest stall plus the longest stop.
NODE_TIMEOUT_MS = 5000
SETTLE = 60.0  # seconds a deployment may take to be whole again after a server fault


def log(start: float, message: str) -> None:
    print(f"[{time.monotonic() - start:6.1f} s] {message}", file=sys.stderr, flush=True)


class Standalone:
    """One Redis, persistent, behind a proxy."""

    name = "standalone"
    server_faults = ("stop", "restart")

    def __init__(self, seed: int) -> None:
        self.server = RedisServer(*PERSISTENT)
        self.proxies = [FaultProxy(self.server.port, seed=seed)]
        self.bus_proxies: list[FaultProxy] = []
        self.url = self.proxies[0].url

    def start(self) -> Standalone:
        self.server.start()
        return self

    def primary(self) -> RedisServer:
        return self.server

    def layout(self) -> object:
        """Who serves what: a change between two faults is a failover nobody injected."""
        return self.server

    def restart(self, server: RedisServer) -> None:
        server.kill()
        server.start()

    def settle(self, timeout: float) -> None:
        pass  # start() returned once the server answered

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        resume(self.server)
        self.server.close()


class Sentinels(LocalSentinels):
    """LocalSentinels with both servers persistent and behind proxies: the servers tell
    their proxy's address (``replica-announce-port``), the sentinels watch the primary
    at its proxy's, so clients, sentinels and replication all go through the proxies."""

    name = "sentinel"

    def __init__(self, seed: int, kill_failovers: bool, coordinated: bool) -> None:
        super().__init__()
        self.coordinated = coordinated
        self.server_faults = ("stop", "restart", "failover", *(("kill-failover",) if kill_failovers else ()))
        self.front: dict[int, FaultProxy] = {}
        for n, server in enumerate(self.servers):
            proxy = self.front[server.port] = FaultProxy(server.port, seed=seed + n)
            announce = ["--replica-announce-ip", "127.0.0.1", "--replica-announce-port", str(proxy.port)]
            server.args += [*PERSISTENT, *announce]
        self.proxies = list(self.front.values())
        self.bus_proxies: list[FaultProxy] = []
        self.replica_of(self.servers[1], self.servers[0])
        for sentinel in self.sentinels:
            sentinel.lines = [self._config(line) for line in sentinel.lines]

    def _config(self, line: str) -> str:
        service, quorum = self.service, len(self.sentinels) // 2 + 1
        if line.startswith("sentinel monitor "):
            return f"sentinel monitor {service} 127.0.0.1 {self.at(self.servers[0])} {quorum}"
        if line.startswith("sentinel down-after-milliseconds "):
            return f"sentinel down-after-milliseconds {service} {DOWN_AFTER_MS}"
        if line.startswith("sentinel failover-timeout "):
            return f"sentinel failover-timeout {service} 10000"
        return line

    def at(self, server: RedisServer) -> int:
        """The port the server is reached at: its proxy's."""
        return self.front[server.port].port

    def layout(self) -> object:
        return self.primary()

    def server_at(self, port: int) -> RedisServer:
        return next(s for s in self.servers if port in (s.port, self.at(s)))

    def replica_of(self, server: RedisServer, primary: RedisServer | None) -> None:
        """Sets how ``server`` starts next: a replica of ``primary``, or a primary (None)."""
        args = server.args
        if "--replicaof" in args:
            i = args.index("--replicaof")
            del args[i : i + 3]
        if primary is not None:
            args += ["--replicaof", "127.0.0.1", str(self.at(primary))]

    def restart(self, server: RedisServer) -> None:
        self.replica_of(server, None)
        server.kill()
        server.start()

    def named(self, server: RedisServer, timeout: float) -> None:
        """Until every sentinel names ``server`` as the primary."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(errors.JoblockError, StopIteration):
                if all(self.primary(i) is server for i in range(len(self.sentinels))):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the sentinels did not name 127.0.0.1:{self.at(server)} within {timeout} s"
                )
            time.sleep(0.05)

    def offset(self, server: RedisServer) -> int:
        info = self.call(server, "INFO", "replication").decode()
        return int(
            next(line for line in info.splitlines() if line.startswith("master_repl_offset:")).split(":")[1]
        )

    def failover(self) -> str:
        """A coordinated failover (see the module's docstring), or with ``coordinated``
        False only ``SENTINEL FAILOVER``; what happened."""
        old, new = self.primary(), self.replica()
        if not self.coordinated:
            self.sentinels[0].call("SENTINEL", "FAILOVER", self.service)
            self.named(new, 30)
            return f"127.0.0.1:{self.at(old)} -> 127.0.0.1:{self.at(new)}"
        self.call(old, "CLIENT", "PAUSE", 30000, "WRITE")
        try:
            deadline = time.monotonic() + 15
            while self.offset(new) < self.offset(old):
                if time.monotonic() > deadline:
                    return "abandoned: the replica did not catch up within 15 s"
                time.sleep(0.02)
            try:
                self.sentinels[0].call("SENTINEL", "FAILOVER", self.service)
            except errors.ReplyError as e:
                return f"abandoned: {e}"
            self.named(new, 30)
            self.call(old, "REPLICAOF", "127.0.0.1", self.at(new))
        finally:
            self.call(old, "CLIENT", "UNPAUSE")
        return f"127.0.0.1:{self.at(old)} -> 127.0.0.1:{self.at(new)}"

    def kill_failover(self) -> str:
        """SIGKILLs the primary; the sentinels promote the replica on their own."""
        old, new = self.primary(), self.replica()
        old.kill()
        self.named(new, DOWN_AFTER_MS / 1000 + 40)
        self.replica_of(old, new)
        old.start()
        return f"127.0.0.1:{self.at(old)} killed, 127.0.0.1:{self.at(new)} promoted"

    def settle(self, timeout: float) -> None:
        self.wait_ready(timeout)

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        for server in self.servers:
            resume(server)
        super().close()


class Cluster(LocalCluster):
    """A LocalCluster of 3 primaries with a replica each, persistent, every node behind two
    proxies: one for clients and replication (``cluster-announce-port``: CLUSTER SLOTS and
    the replicas name it) and one for the cluster bus (``cluster-announce-bus-port``: the
    nodes' gossip, failure reports and elections go through it).

    Nodes are called failed after ``NODE_TIMEOUT_MS`` without an answer on the bus: above
    the longest stall plus the longest stop, so the cluster fails over on its own only
    after a SIGKILL (or, counted apart, when faults happen to add up).
    """

    name = "cluster"
    server_faults = ("stop", "restart", "failover", "kill-failover", "migrate")

    def __init__(self, seed: int) -> None:
        # cluster-replica-validity-factor 0: a replica whose link was down for long (its
        # primary restarted, stalled) may still be promoted; else a SIGKILL soon after
        # could leave the primary's slots unserved until it is started again.
        settings = ("--cluster-replica-validity-factor", "0", *PERSISTENT)
        super().__init__(primaries=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS, args=settings)
        self.front: dict[int, FaultProxy] = {}
        self.bus_proxies: list[FaultProxy] = []
        for n, node in enumerate(self.nodes):
            front = self.front[node.port] = FaultProxy(node.port, seed=seed + 2 * n)
            bus = FaultProxy(node.port + 10000, seed=seed + 2 * n + 1)  # the default bus port
            self.bus_proxies.append(bus)
            node.args += [
                "--cluster-announce-ip", "127.0.0.1", "--cluster-announce-port", str(front.port),
                "--cluster-announce-bus-port", str(bus.port),
            ]  # fmt: skip
        self.proxies = [*self.front.values(), *self.bus_proxies]
        self.seeds = [proxy.url for proxy in self.front.values()]  # the clients know every node

    @property
    def url(self) -> str:
        return self.seeds[0]

    def at(self, server: RedisServer) -> int:
        return self.front[server.port].port

    def primary(self) -> RedisServer:
        """A primary, at random: the one a fault goes to."""
        return random.choice(self.primaries())

    def layout(self) -> object:
        return frozenset(node.port for node in self.primaries())

    def replica_of(self, primary: RedisServer) -> RedisServer:
        return next(
            node for node in self.alive()
            if node is not primary and f"master_port:{self.at(primary)}\r".encode()
            in self.call(node, "INFO", "replication")
        )  # fmt: skip

    def restart(self, server: RedisServer) -> None:
        server.kill()
        server.start()

    def promoted(self, node: RedisServer, timeout: float) -> bool:
        """Whether ``node`` became a primary within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(errors.JoblockError):
                if self.call(node, "ROLE")[0] == b"master":
                    return True
            time.sleep(0.05)
        return False

    def failover(self) -> tuple[str, str]:
        """``CLUSTER FAILOVER`` on a primary's replica: the primary pauses its clients
        until the replica has every write, then the replica takes over (the old primary
        becomes its replica). The kind of fault, and what happened."""
        old = self.primary()
        new = self.replica_of(old)
        self.call(new, "CLUSTER", "FAILOVER")
        if not self.promoted(new, 15):  # a manual failover gives up after 5 s (a stall)
            return "cluster failover abandoned", f"CLUSTER FAILOVER on 127.0.0.1:{self.at(new)} abandoned"
        return "cluster failover", f"CLUSTER FAILOVER: 127.0.0.1:{self.at(old)} -> 127.0.0.1:{self.at(new)}"

    def kill_failover(self) -> tuple[str, str]:
        """SIGKILLs a primary; the cluster promotes its replica on its own; the killed
        node is started again and rejoins as the new primary's replica."""
        old = self.primary()
        new = self.replica_of(old)
        old.kill()
        if not self.promoted(new, NODE_TIMEOUT_MS / 1000 * 4 + 30):
            raise RuntimeError(f"the cluster did not promote 127.0.0.1:{self.at(new)}")
        self.wait_ok(SETTLE)
        old.start()
        return "cluster kill-failover", f"127.0.0.1:{self.at(old)} killed, 127.0.0.1:{self.at(new)} promoted"

    def migrate(self) -> tuple[str, str]:
        """Moves the slot of a key the clients wrote (a lock, its fencing counter, a wait
        queue) to another primary while they use it."""
        key = None
        for _ in range(100):  # a primary with keys: the clients write all the time
            key = self.call(self.primary(), "RANDOMKEY")
            if key is not None:
                break
        if key is None:
            return "migrate skipped", "no key to migrate a slot of"
        slot = int(self.call(self.alive()[0], "CLUSTER", "KEYSLOT", key))
        migration = Migration(self, slot)
        migration.begin()
        moved = migration.move_all()
        migration.finish()
        return "migrate", (
            f"slot {slot} ({key.decode(errors='replace')}, {moved} keys) migrated: "
            f"127.0.0.1:{self.at(migration.source)} -> 127.0.0.1:{self.at(migration.target)}"
        )

    def settle(self, timeout: float) -> None:
        self.wait_ok(timeout)
        self.wait_replicated(timeout)

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        for node in self.nodes:
            resume(node)
        super().close()


Deployment = Standalone | Sentinels | Cluster


def resume(server: RedisServer) -> None:
    """SIGCONT, in case a stop was cut short: a stopped server cannot be terminated."""
    if server.process is not None and server.process.poll() is None:
        with contextlib.suppress(OSError):
            os.kill(server.process.pid, signal.SIGCONT)


class Faults:
    """The two fault threads of one deployment, and what they injected."""

    def __init__(self, deployment: Deployment, seed: int, start: float, stop: threading.Event) -> None:
        self.deployment = deployment
        self.start = start
        self.stop = stop
        self.counts: Counter[str] = Counter()
        self.problems: list[str] = []
        self.threads = [
            threading.Thread(
                target=self._guarded, args=(body, random.Random(f"{seed}.{body.__name__}")), daemon=True
            )
            for body in (self.network, self.servers)
        ]

    def run(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self.problems.append(
                    f"{self.deployment.name}: a fault thread was still busy {timeout} s after the end"
                )

    def _guarded(self, body: Callable[[random.Random], None], rng: random.Random) -> None:
        try:
            body(rng)
        except Exception as e:  # the run itself failed: reported, and the exit status says so
            self.problems.append(f"{self.deployment.name} {body.__name__} faults: {type(e).__name__}: {e}")
            log(self.start, self.problems[-1])

    def _primary_proxy(self) -> FaultProxy | None:
        # None while the sentinels cannot say (busy failing over).
        with contextlib.suppress(errors.JoblockError, StopIteration):
            port = self.deployment.primary().port
            return next(p for p in self.deployment.proxies if p.upstream == port)
        return None

    def network(self, rng: random.Random) -> None:
        while not self.stop.wait(rng.uniform(1, 4)):
            # The primary's proxy more often: most traffic goes there. A Cluster's bus
            # proxies a quarter of the time (a stall there delays failure reports).
            bus = self.deployment.bus_proxies
            if bus and rng.random() < 0.25:
                proxy: FaultProxy | None = rng.choice(bus)
            else:
                proxy = self._primary_proxy() if rng.random() < 0.75 else None
            proxy = proxy or rng.choice(self.deployment.proxies)
            kind = rng.choices(("latency", "stall", "reset"), weights=(2, 1, 2))[0]
            if kind == "latency":
                mean = rng.uniform(0.002, 0.05)
                proxy.delay(mean, mean * rng.uniform(0.3, 1.0))
                self.stop.wait(rng.uniform(2, 8))
                proxy.delay(0)
            elif kind == "stall":
                seconds = rng.uniform(0.5, LONGEST_STALL)
                proxy.stall(seconds)
                self.stop.wait(seconds)
            else:
                self.counts["resets armed"] += proxy.reset(rng.randint(1, 3))

    def _kind(self, rng: random.Random, last_failover: float, bag: list[str]) -> str:
        """The next server fault. A Cluster's come from a bag of each kind, shuffled and
        refilled when empty, so that even a short run sees every kind."""
        if isinstance(self.deployment, Cluster):
            if not bag:
                bag += rng.sample(self.deployment.server_faults, len(self.deployment.server_faults))
            return bag.pop()
        kinds: list[str] = list(self.deployment.server_faults)
        if "kill-failover" in kinds and time.monotonic() - last_failover < 25:
            kinds.remove("kill-failover")  # the sentinels refuse a second failover too soon
        return rng.choice(kinds)

    def servers(self, rng: random.Random) -> None:
        deployment = self.deployment
        last_failover = 0.0
        bag: list[str] = []
        expected = deployment.layout()
        while not self.stop.wait(rng.uniform(4, 10)):
            kind = self._kind(rng, last_failover, bag)
            if deployment.layout() != expected:  # failed over on its own: counted, shown
                self.counts["unplanned failover"] += 1
                log(self.start, f"{deployment.name}: failed over on its own")
            primary = deployment.primary()
            began = time.monotonic()
            if kind == "stop":
                assert primary.process is not None
                os.kill(primary.process.pid, signal.SIGSTOP)
                try:
                    time.sleep(rng.uniform(0.3, LONGEST_STOP))
                finally:
                    os.kill(primary.process.pid, signal.SIGCONT)
                what = f"SIGSTOP, SIGCONT after {time.monotonic() - began:.1f} s"
            elif kind == "restart":
                deployment.restart(primary)
                what = f"restarted (SIGKILL, AOF) in {time.monotonic() - began:.1f} s"
            elif isinstance(deployment, Cluster):
                action = {
                    "failover": deployment.failover,
                    "kill-failover": deployment.kill_failover,
                    "migrate": deployment.migrate,
                }[kind]
                kind, what = action()
            else:
                assert isinstance(deployment, Sentinels)
                last_failover = time.monotonic()
                if kind == "kill-failover":
                    what = "SIGKILL failover: " + deployment.kill_failover()
                else:
                    what = (
                        ("coordinated" if deployment.coordinated else "plain")
                        + " failover "
                        + deployment.failover()
                    )
                    if "abandoned" in what:
                        kind = "failover abandoned"
                    elif not deployment.coordinated:
                        kind = "plain failover"
            self.counts[kind] += 1
            deployment.settle(SETTLE)
            expected = deployment.layout()
            log(self.start, f"{deployment.name}: {what}; whole again after {time.monotonic() - began:.1f} s")


# -- the counts --------------------------------------------------------------------------


def silent_losses(leases: Iterable[LeaseRecord]) -> list[str]:
    """The leases that ended without their holder being told.

    A lease is *kept* when its holder was never told otherwise: every extend and
    remaining said it held, and its release returned True. A lease is *surely held* from
    the return of its grant to the start of its last call that said it held (a lock
    held at both ends, under one token, was held in between). Silent losses are:

    - a kept lease a write of which the resource refused as stale: a higher fencing
      number had been written during its hold;
    - more leases of a key surely held at one moment than its ``limit`` (1 for a plain
      lock): at least one of them had lost the lock without being told;
    - a kept lease of a plain lock while a lease with a higher fencing number (so
      granted after it) was known granted before its release started, which found it
      still held. Fencing numbers follow the grants only while none is handed out
      twice: a key with a duplicate (an exclusion violation) is left to the other two.

    The stamps are ``time.monotonic()``, one clock for all processes; each is taken on
    the side that cannot make a lease look longer than it was.
    """
    by_key: dict[tuple[str, str], list[LeaseRecord]] = defaultdict(list)
    for lease in leases:
        by_key[lease.deployment, lease.key].append(lease)
    found: list[str] = []
    for (deployment, key), held in by_key.items():
        where = f"{deployment} {key}"
        found += [
            f"{where}: {lease.lease} (fence {lease.fence}) wrote stale"
            for lease in held
            if lease.kept and lease.stale
        ]
        found += _over_limit(where, held)
        if held[0].limit == 1 and len({lease.fence for lease in held}) == len(held):
            held.sort(key=lambda lease: lease.fence)
            first_after = float("inf")  # the earliest known grant among higher fences
            for lease in reversed(held):
                if lease.kept and lease.released is not None and first_after < lease.released:
                    found.append(f"{where}: {lease.lease} (fence {lease.fence}) kept past a later grant")
                first_after = min(first_after, lease.granted)
    return found


def _over_limit(where: str, held: Sequence[LeaseRecord]) -> list[str]:
    """The moments more leases than the limit were surely held (a lease ends before the
    next begins when both stamps are equal)."""
    surely = [lease for lease in held if lease.confirmed > lease.granted]
    events = sorted([(lease.granted, 1) for lease in surely] + [(lease.confirmed, -1) for lease in surely])
    found, inside = [], 0
    for at, step in events:
        inside += step
        if inside > held[0].limit:
            found.append(f"{where}: {inside} leases surely held at once (limit {held[0].limit}) at {at:.3f}")
    return found


def merge(tallies: Iterable[Tally]) -> Tally:
    total = Tally()
    for tally in tallies:
        for name in ("calls", "grants", "busy", "documented", "undocumented", "told", "failures"):
            getattr(total, name).update(getattr(tally, name))
        total.examples += tally.examples
        total.leases += tally.leases
        total.hung += tally.hung
    return total


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> list[str]:
    def cell(value: object) -> str:
        return f"{value:,}" if isinstance(value, int) else str(value)

    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return [*lines, ""]


def report(result: dict[str, Any]) -> str:
    """The run's Markdown tables."""
    by = result["deployments"]
    names = list(by)

    def total(counts: str, call: str | None = None) -> int:
        """A count summed over the deployments: of one call, or of all."""
        return sum(by[n][counts].get(call, 0) if call else sum(by[n][counts].values()) for n in names)

    lines = [
        f"Chaos run: {result['duration']:.0f} s, seed {result['seed']}, {result['processes']} processes "
        f"of {result['threads']} threads and {result['tasks']} asyncio tasks, ttl {result['ttl']} s, "
        f"Redis {result['redis']}, {result['setup']}",
        "",
    ]
    lines += table(
        [
            ("Exclusion violations among fenced writes", result["violations"]),
            ("Silent losses (leases that ended without their holder being told)", result["silent_losses"]),
            ("Undocumented errors", result["undocumented"]),
        ],
        ("Must be 0", "Count"),
    )
    calls = sorted({c for d in by.values() for c in d["calls"]})
    rows = [
        (f"`{c}`", *(total(counts, c) for counts in ("calls", "grants", "busy", "failures"))) for c in calls
    ]
    rows.append(("all", *(total(counts) for counts in ("calls", "grants", "busy", "failures"))))
    lines += table(rows, ("Call", "calls", "leases granted", "busy (None)", "documented errors"))
    faults = sorted({f for d in by.values() for f in d["faults"]})
    rows = [(f, *(by[n]["faults"].get(f, 0) for n in names)) for f in faults]
    rows.append(("calls made", *(sum(by[n]["calls"].values()) for n in names)))
    lines += table(rows, ("Faults injected", *names))
    documented = sorted({e for d in by.values() for e in d["documented"]})
    lines += table(
        [(f"`{e}`", *(by[n]["documented"].get(e, 0) for n in names)) for e in documented],
        ("Documented errors", *names),
    )
    writes = result["writes"]
    lines += table(
        [
            ("leases", result["leases"]),
            ("kept (every call said held, release True)", result["kept"]),
            *((f"told: {why}", n) for why, n in sorted(result["told"].items())),
            ("fenced writes accepted", writes.get("accepted", 0)),
            ("fenced writes refused as stale", writes.get("stale", 0)),
            ("fenced writes with a duplicate fencing number", writes.get("duplicate", 0)),
        ],
        ("Leases and writes", "Count"),
    )
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------


def ask(server: RedisServer, *command: Any) -> Any:
    """One command to a server, on a connection of its own (not through its proxy)."""
    return call(Settings(port=server.port, retries=0, socket_timeout=30), core, [command])[0]


def redis_version(server: RedisServer) -> str:
    info: str = ask(server, "INFO", "server").decode()
    return next(line.split(":")[1] for line in info.splitlines() if line.startswith("redis_version:"))


def start_deployments(args: argparse.Namespace, stack: contextlib.ExitStack) -> list[Deployment]:
    """The run's deployments, started (and closed by ``stack``): a Redis Cluster with
    ``--cluster``, else a single Redis and a Sentinel deployment side by side."""
    made: list[Deployment] = []
    if args.cluster:
        cluster = Cluster(args.seed)
        stack.callback(cluster.close)
        cluster.start()
        cluster.wait_replicated()
        made.append(cluster)
        return made
    standalone = Standalone(args.seed)
    stack.callback(standalone.close)
    made.append(standalone.start())
    sentinel = Sentinels(args.seed + 10, args.kill_failovers, args.failovers == "coordinated")
    stack.callback(sentinel.close)
    sentinel.start()
    made.append(sentinel)
    return made


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Runs the chaos; its counts, and the problems of the run itself."""
    start = time.monotonic()
    problems: list[str] = []
    with contextlib.ExitStack() as stack:
        guard = stack.enter_context(RedisServer())
        deployments = start_deployments(args, stack)
        log(start, "deployments up: " + ", ".join(f"{d.name} at {d.url}" for d in deployments))

        base = {"socket_timeout": 2.0, "connect_timeout": 2.0}
        cores = ["c", "python"] if compiled() is not None else ["python"]
        deadline = time.monotonic() + args.duration
        plans = []
        for index in range(args.processes):
            deployment = deployments[index % len(deployments)]
            options = dict(base)
            if not isinstance(deployment, Standalone) and args.min_replicas:
                options |= {"min_replicas": args.min_replicas, "replica_timeout": 0.5}
            core_name = cores[index // len(deployments) % len(cores)]
            url = deployment.seeds if isinstance(deployment, Cluster) else deployment.url
            plans.append(
                Plan(
                    index, deployment.name, url, guard.port, core_name, options,
                    args.seed * 1000 + index, deadline, args.ttl, args.threads, args.tasks,
                    cluster=isinstance(deployment, Cluster),
                )
            )  # fmt: skip
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        processes = [
            context.Process(
                target=work, args=(plan, results, GRACE), name=f"chaos-worker-{plan.index}", daemon=True
            )
            for plan in plans
        ]
        for process in processes:
            process.start()
            stack.callback(_end, process)
        stop = threading.Event()
        faults = [Faults(d, args.seed + n, start, stop) for n, d in enumerate(deployments)]
        for fault in faults:
            fault.run()
        log(start, f"{len(processes)} workers and the faults started; the run ends in {args.duration:.0f} s")
        while not stop.wait(min(1.0, max(0.0, deadline - time.monotonic()))) and time.monotonic() < deadline:
            if any(process.exitcode is not None for process in processes):  # a worker died: no use going on
                problems.append("a worker process ended before the run did (its error is above)")
                log(start, problems[-1])
                break
        stop.set()
        for fault in faults:
            fault.join(SETTLE + 60)
            problems += fault.problems
        for deployment in deployments:
            for proxy in deployment.proxies:
                proxy.heal()
        log(start, "faults stopped and healed; waiting for the workers' last calls")

        tallies: dict[int, Tally] = {}
        wait_until = time.monotonic() + GRACE + 30
        while len(tallies) < len(processes) and time.monotonic() < wait_until:
            with contextlib.suppress(queue.Empty):
                index, tally = results.get(timeout=1)
                tallies[index] = tally
        for plan, process in zip(plans, processes):
            if plan.index not in tallies:
                lost = Tally()
                lost.undocumented["worker ended without its counts"] += 1
                lost.examples.append(f"worker {plan.index} ({plan.deployment}) exit code {process.exitcode}")
                tallies[plan.index] = lost
        guard_totals = ask(guard, "HGETALL", "chaos:totals")
        duplicates = ask(guard, "LRANGE", "chaos:duplicates", 0, 20)
        redis = redis_version(guard)

    totals = {k.decode(): int(v) for k, v in zip(guard_totals[0::2], guard_totals[1::2])}
    everything = merge(tallies.values())
    losses = silent_losses(everything.leases)
    by_deployment: dict[str, Any] = {}
    for deployment, fault in zip(deployments, faults):
        mine = merge(tallies[plan.index] for plan in plans if plan.deployment == deployment.name)
        injected: Counter[str] = Counter(fault.counts)
        for proxy in deployment.proxies:
            bus = "bus " if proxy in deployment.bus_proxies else ""
            injected.update({bus + kind: n for kind, n in proxy.injected.items()})
        by_deployment[deployment.name] = {
            "calls": dict(mine.calls), "grants": dict(mine.grants), "busy": dict(mine.busy),
            "failures": dict(mine.failures), "documented": dict(mine.documented),
            "faults": _fault_names(injected),
        }  # fmt: skip
    result = {
        "duration": args.duration, "seed": args.seed, "processes": args.processes, "threads": args.threads,
        "tasks": args.tasks, "ttl": args.ttl, "redis": redis, "min_replicas": args.min_replicas,
        "setup": f"min_replicas={args.min_replicas} on the "
        + (
            f"Cluster clients, cluster-node-timeout {NODE_TIMEOUT_MS} ms"
            if args.cluster
            else f"Sentinel clients, {args.failovers} failovers"
        ),
        "violations": totals.get("duplicate", 0), "silent_losses": len(losses),
        "undocumented": sum(everything.undocumented.values()), "deployments": by_deployment,
        "writes": totals, "told": dict(everything.told), "leases": len(everything.leases),
        "kept": sum(lease.kept for lease in everything.leases),
        "details": {
            "duplicates": [d.decode() for d in duplicates], "silent_losses": losses[:20],
            "undocumented": dict(everything.undocumented), "examples": everything.examples,
        },
    }  # fmt: skip
    return result, problems


FAULT_NAMES = {
    "latency": "latency with jitter (periods of 2-8 s)",
    "stall": f"stalls: all traffic held 0.5-{LONGEST_STALL} s",
    "reset": "connections reset mid-reply",
    "resets armed": "resets armed (a connection that never answered again is not reset)",
    "refused": "connections refused while the server was down",
    "stop": f"SIGSTOP, SIGCONT 0.3-{LONGEST_STOP} s later",
    "restart": "restarts (SIGKILL, then the AOF reloaded)",
    "failover": "coordinated failovers (CLIENT PAUSE WRITE, SENTINEL FAILOVER)",
    "failover abandoned": "coordinated failovers abandoned (replica behind, or the sentinels refused)",
    "plain failover": "failovers by SENTINEL FAILOVER alone (--failovers plain: not safe)",
    "kill-failover": "SIGKILLed primaries promoted by the sentinels",
    "unplanned failover": "failovers made on their own (none is planned)",
    "cluster failover": "CLUSTER FAILOVER on a replica (its primary pauses until it caught up)",
    "cluster failover abandoned": "CLUSTER FAILOVER abandoned (the replica did not catch up within 5 s)",
    "cluster kill-failover": "SIGKILLed primaries promoted by the cluster, then restarted as replicas",
    "migrate": "slots migrated (SETSLOT, MIGRATE) with the locks in them",
    "migrate skipped": "slot migrations skipped (no key found)",
    "bus latency": "cluster bus: latency with jitter (periods of 2-8 s)",
    "bus stall": f"cluster bus: all traffic held 0.5-{LONGEST_STALL} s",
    "bus reset": "cluster bus: connections reset",
    "bus refused": "cluster bus: connections refused while the node was down",
}


def _fault_names(injected: Counter[str]) -> dict[str, int]:
    return {FAULT_NAMES.get(kind, kind): n for kind, n in injected.items() if kind != "resets armed"}


def _end(process: multiprocessing.process.BaseProcess) -> None:
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/chaos.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of chaos (default 180)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the faults' and the callers' choices")
    parser.add_argument(
        "--processes", type=int, default=4, help="worker processes, shared by the deployments (default 4)"
    )
    parser.add_argument("--threads", type=int, default=2, help="threaded callers per process (default 2)")
    parser.add_argument("--tasks", type=int, default=3, help="asyncio callers per process (default 3)")
    parser.add_argument(
        "--ttl",
        type=float,
        default=6.0,
        help="the longest leases' ttl in seconds; others get a half or a quarter (default 6)",
    )
    parser.add_argument(
        "--min-replicas", type=int, choices=(0, 1), default=1,
        help="the Sentinel clients' min_replicas (default 1; 0 shows what SIGKILL failovers lose without it)",
    )  # fmt: skip
    parser.add_argument(
        "--failovers", choices=("coordinated", "plain"), default="coordinated",
        help="plain: SENTINEL FAILOVER alone, which loses what the old primary grants meanwhile",
    )  # fmt: skip
    parser.add_argument(
        "--kill-failovers", choices=("on", "off"), default="on",
        help="SIGKILL the Sentinel primary and let the sentinels promote the replica (default on)",
    )  # fmt: skip
    parser.add_argument(
        "--cluster", action="store_true",
        help="a Redis Cluster (3 primaries, a replica each) instead of the single Redis and the Sentinels",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write the counts as JSON")
    args = parser.parse_args(argv)
    args.kill_failovers = args.kill_failovers == "on"
    if args.ttl < 4 * (MARGIN + 0.5):
        parser.error(f"--ttl must be at least {4 * (MARGIN + 0.5)}: a quarter of it is the shortest lease")
    if args.processes < 2:
        parser.error("--processes must be at least 2 (one per deployment, or one per core with --cluster)")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so every server and worker is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result, problems = run(args)
    except KeyboardInterrupt:
        print("chaos run interrupted: servers and workers stopped", file=sys.stderr)
        return 130
    print(report(result))
    details = result["details"]
    for title, items in (
        ("Duplicate fencing numbers", details["duplicates"]),
        ("Silent losses", details["silent_losses"]),
        ("Undocumented errors", details["examples"]),
        ("Problems of the run itself", problems),
    ):
        if items:
            print(f"\n{title}:", *(f"- {item}" for item in items), sep="\n")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**result, "problems": problems}, out, indent=2)
    if problems:
        return 2
    return 1 if result["violations"] or result["silent_losses"] or result["undocumented"] else 0


if __name__ == "__main__":
    sys.exit(main())
