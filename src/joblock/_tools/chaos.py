"""The chaos run: many processes take locks while faults come together, for minutes.

    python -m joblock._tools.chaos --duration 120     # what CI runs (scripts/chaos.sh)
    python -m joblock._tools.chaos --duration 600     # the 10-minute run of docs/guarantees.md

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
only failovers are the ones injected. Every holder writes its fencing number to a
guarded resource (``chaos_work.GUARD_SCRIPT``); the run counts operations, faults, and
three numbers that must be 0, defined in ``silent_losses`` and docs/guarantees.md. It
prints them as Markdown tables and exits 1 if one is not 0 (2 if the run itself failed).
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

from .. import errors
from .._core import compiled, core
from .._engine.sync import call
from ..settings import Settings
from .chaos_work import MARGIN, LeaseRecord, Plan, Tally, work
from .faults import FaultProxy
from .sentinels import LocalSentinels
from .servers import RedisServer

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
        self.url = self.proxies[0].url

    def start(self) -> Standalone:
        self.server.start()
        return self

    def primary(self) -> RedisServer:
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


Deployment = Standalone | Sentinels


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
            # The primary's proxy more often: most traffic goes there.
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

    def servers(self, rng: random.Random) -> None:
        deployment = self.deployment
        last_failover = 0.0
        expected = deployment.primary()
        while not self.stop.wait(rng.uniform(4, 10)):
            kinds = list(deployment.server_faults)
            if "kill-failover" in kinds and time.monotonic() - last_failover < 25:
                kinds.remove("kill-failover")  # the sentinels refuse a second failover too soon
            kind = rng.choice(kinds)
            primary = deployment.primary()
            if primary is not expected:  # the sentinels failed over on their own: counted, shown
                self.counts["unplanned failover"] += 1
                log(self.start, f"{deployment.name}: the sentinels failed over on their own")
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
            expected = deployment.primary()
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
        f"Redis {result['redis']}, min_replicas={result['min_replicas']} on the Sentinel clients, "
        f"{result['failovers']} failovers",
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


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Runs the chaos; its counts, and the problems of the run itself."""
    start = time.monotonic()
    problems: list[str] = []
    with contextlib.ExitStack() as stack:
        guard = stack.enter_context(RedisServer())
        deployments: list[Deployment] = []
        standalone = Standalone(args.seed)
        stack.callback(standalone.close)
        deployments.append(standalone.start())
        sentinel = Sentinels(args.seed + 10, args.kill_failovers, args.failovers == "coordinated")
        stack.callback(sentinel.close)
        sentinel.start()
        deployments.append(sentinel)
        log(start, f"deployments up: standalone at {standalone.url}, Sentinel at {sentinel.url}")

        base = {"socket_timeout": 2.0, "connect_timeout": 2.0}
        cores = ["c", "python"] if compiled() is not None else ["python"]
        deadline = time.monotonic() + args.duration
        plans = []
        for index in range(args.processes):
            deployment = deployments[index % 2]
            options = dict(base)
            if deployment is sentinel and args.min_replicas:
                options |= {"min_replicas": args.min_replicas, "replica_timeout": 0.5}
            plans.append(
                Plan(
                    index, deployment.name, deployment.url, guard.port, cores[index // 2 % len(cores)],
                    options, args.seed * 1000 + index, deadline, args.ttl, args.threads, args.tasks,
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
            injected.update(proxy.injected)
        by_deployment[deployment.name] = {
            "calls": dict(mine.calls), "grants": dict(mine.grants), "busy": dict(mine.busy),
            "failures": dict(mine.failures), "documented": dict(mine.documented),
            "faults": _fault_names(injected),
        }  # fmt: skip
    result = {
        "duration": args.duration, "seed": args.seed, "processes": args.processes, "threads": args.threads,
        "tasks": args.tasks, "ttl": args.ttl, "redis": redis, "min_replicas": args.min_replicas,
        "failovers": args.failovers,
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
    "unplanned failover": "failovers the sentinels made on their own (none is planned)",
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
        "--processes", type=int, default=4, help="worker processes, half per deployment (default 4)"
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
    parser.add_argument("--json", metavar="PATH", help="also write the counts as JSON")
    args = parser.parse_args(argv)
    args.kill_failovers = args.kill_failovers == "on"
    if args.ttl < 4 * (MARGIN + 0.5):
        parser.error(f"--ttl must be at least {4 * (MARGIN + 0.5)}: a quarter of it is the shortest lease")
    if args.processes < 2:
        parser.error("--processes must be at least 2 (one per deployment)")
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
