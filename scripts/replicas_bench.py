#!/usr/bin/env python3
"""Confirmed batches against unconfirmed ones: ``min_replicas=1`` over ``min_replicas=0``.

    python scripts/replicas_bench.py                     # both builds, 100,000 keys, 7 rounds
    python scripts/replicas_bench.py --build c -n 20000 --rounds 5

Starts a primary and its replica on this machine, then, round after round, times
``acquire_many`` and ``dedupe`` of fresh keys with and without confirmation, the two
sides interleaved (so a neighbour's load falls on both alike), and prints the medians,
the ratio of the medians (confirmed rate / unconfirmed rate) and how many WAITs the
primary ran per confirmed batch (``INFO commandstats``). ``--build both`` runs the
compiled build, then the pure one (``JOBLOCK_NO_EXTENSIONS=1``), each in a process of
its own. Prints; asserts nothing about speed.

Each call starts, untimed, from an empty keyspace with the replica caught up: a WAIT
would count an earlier batch's backlog too, and a call made on the keys of the calls
before it ran at a speed set by its place in the round (the one taking the keyspace from
200,000 to 300,000 keys ran 1.4-2.2x slower than the one after it, either side: likely
Redis growing its dicts past 262,144 keys, on the primary and on the replica).

Each side of a call comes, in every round, two calls after the same side of the other
call (the confirmed ``dedupe`` after the confirmed ``acquire_many``, the confirmed
``acquire_many`` after the unconfirmed ``dedupe``), whose result is let go of as the
call between ends: what a call leaves behind weighs on one side only. Until a confirmed
call let go of its result (5676449), the compiled build's confirmed calls left their
leases in memory: the confirmed ``dedupe`` took 1.6x the page faults of the unconfirmed
one, the confirmed ``acquire_many`` 0.6x, the way their ratios leaned (0.79x, 0.96x).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

if importlib.util.find_spec("joblock") is None:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import redis

import joblock
from joblock._tools.servers import RedisServer

NO_DELAY = ("--repl-diskless-sync-delay", "0")


def waits(client: Any) -> int:
    return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def in_sync(client: Any) -> bool:
    client.set("probe", 1)
    return client.execute_command("WAIT", 1, 100) == 1  # type: ignore[no-any-return]


def caught_up(client: Any) -> None:
    client.set("probe", 1)
    if client.execute_command("WAIT", 1, 60_000) != 1:
        raise RuntimeError("the replica fell a minute behind")


def emptied(client: Any) -> None:
    """An empty keyspace on the primary and the replica, as every timed call starts."""
    client.flushall()
    caught_up(client)


def measure(n: int, rounds: int, replica_timeout: float) -> None:
    with (
        RedisServer(*NO_DELAY) as primary,
        RedisServer(*NO_DELAY, "--replicaof", "127.0.0.1", str(primary.port)),
        redis.Redis(port=primary.port) as client,
    ):
        deadline = time.monotonic() + 30
        while not in_sync(client):
            assert time.monotonic() < deadline, "the replica did not come online"
        with joblock.Locks(primary.url, prefix="bench", replica_timeout=replica_timeout) as locks:
            calls: dict[str, Callable[[int, int], list[Any]]] = {
                "acquire_many": lambda r, replicas: locks.acquire_many(
                    (f"many:{r}:{replicas}:{i}" for i in range(n)), 60, min_replicas=replicas
                ),
                "dedupe": lambda r, replicas: locks.dedupe(
                    f"Dedupe{r}x{replicas}", ((i,) for i in range(n)), 60, min_replicas=replicas
                ),
            }
            # Seconds by round, for each call and side.
            times: dict[tuple[str, int], dict[int, float]] = {(name, r): {} for name in calls for r in (0, 1)}
            wait_calls: dict[str, list[int]] = {name: [] for name in calls}
            refused = dict.fromkeys(calls, 0)
            for r in range(-1, rounds):  # round -1 warms up
                for name, call in calls.items():
                    # Alternating which side goes first, so neither always follows the other.
                    for replicas in (0, 1) if r % 2 else (1, 0):
                        emptied(client)
                        before = waits(client)
                        start = time.perf_counter()
                        try:
                            leases = call(r, replicas)
                        except joblock.ReplicationError as e:  # a replica starved past the timeout
                            print(f"  round {r} {name}: {e}", file=sys.stderr)
                            refused[name] += 1
                            continue
                        elapsed = time.perf_counter() - start
                        ran = waits(client) - before
                        assert len(leases) == n and all(leases), "fresh keys must all be granted"
                        if r >= 0:
                            times[name, replicas][r] = elapsed
                            if replicas:
                                wait_calls[name].append(ran)
    print(
        f"{joblock.implementation} build: {n:,} fresh keys, {rounds} interleaved rounds (medians),"
        f" replica_timeout={replica_timeout}"
    )
    for name in calls:
        unconfirmed = statistics.median(times[name, 0].values())
        confirmed = statistics.median(times[name, 1].values())
        ratios = [times[name, 0][r] / times[name, 1][r] for r in times[name, 1] if r in times[name, 0]]
        print(
            f"  {name:13} unconfirmed {unconfirmed * 1000:8.1f} ms ({n / unconfirmed:9,.0f}/s)"
            f"  min_replicas=1 {confirmed * 1000:8.1f} ms ({n / confirmed:9,.0f}/s)"
            f"  ratio {unconfirmed / confirmed:.2f}x"
            f"  (rounds {min(ratios):.2f}-{max(ratios):.2f}x)"
            f"  WAITs per batch {statistics.median(wait_calls[name]):g}"
            + (f"  ({refused[name]} rounds raised ReplicationError)" if refused[name] else "")
        )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=100_000, help="keys per batch (default 100,000)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--build", choices=["c", "python", "both"], default="both")
    parser.add_argument(
        "--replica-timeout", type=float, default=0.5, help="seconds (default 0.5, the client's default)"
    )
    args = parser.parse_args()
    if args.build != "both":
        if joblock.implementation != args.build:
            sys.exit(f"asked for the {args.build} build, running the {joblock.implementation} one")
        measure(args.n, args.rounds, args.replica_timeout)
        return
    for build in ("c", "python"):
        env = dict(os.environ, JOBLOCK_NO_EXTENSIONS="1" if build == "python" else "0")
        options = [
            "-n",
            str(args.n),
            "--rounds",
            str(args.rounds),
            "--replica-timeout",
            str(args.replica_timeout),
        ]
        options += ["--build", build]
        subprocess.run([sys.executable, __file__, *options], env=env, check=True)


if __name__ == "__main__":
    main()
