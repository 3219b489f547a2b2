"""Forced failovers of a local Redis Cluster, counting the locks each kind of grant lost.

    python scripts/failovers.py --rounds 20

Each round, threads take fresh locks on a 3-primary Cluster (one replica each) with
``min_replicas=1`` and without, while a random primary is SIGKILLed; once a replica
took its slots, every lease handed out before the kill is looked up: a lock whose key
now holds another value, or none, was lost (a second holder could take it). The killed
node then restarts and rejoins as a replica, and the next round begins. Exits 1 if a
confirmed lock was lost. The unconfirmed column shows what the confirmation is for.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from typing import Any

import joblock
from joblock._tools.servers import LocalCluster

TTL = 600  # far beyond the run: nothing expires on its own
TAKERS = 4  # threads per kind of grant


class Takers:
    """Threads taking fresh keys until stopped; the leases they were handed, by kind."""

    def __init__(self, url: str, round_no: int) -> None:
        self.confirmed = joblock.ClusterLocks(url, prefix="", min_replicas=1, replica_timeout=0.5, retries=1)
        self.unconfirmed = joblock.ClusterLocks(url, prefix="", retries=1)
        self.held: dict[str, list[Any]] = {"confirmed": [], "unconfirmed": []}
        self.errors: dict[str, int] = {}
        self.stop = threading.Event()
        self.round = round_no
        self.threads = [
            threading.Thread(target=self._take, args=(kind, n), daemon=True)
            for kind in self.held
            for n in range(TAKERS)
        ]

    def _take(self, kind: str, n: int) -> None:
        locks = self.confirmed if kind == "confirmed" else self.unconfirmed
        i = 0
        while not self.stop.is_set():
            i += 1
            key = f"r{self.round}:{kind}:{n}:{i}"
            try:
                lease = locks.acquire(key, TTL)
            except (joblock.ConnectionError, joblock.ReplicationError, joblock.ReplyError) as e:
                # The documented errors of a failover: the primary gone, its slots not yet
                # served (CLUSTERDOWN), a grant its replica could not confirm.
                name = type(e).__name__
                self.errors[name] = self.errors.get(name, 0) + 1
                time.sleep(0.01)
                continue
            if lease is None:
                raise AssertionError(f"{key}, a fresh key, was not granted")
            self.held[kind].append(lease)

    def __enter__(self) -> Takers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()
        self.confirmed.close()
        self.unconfirmed.close()


def lost(cluster: LocalCluster, leases: list[Any]) -> int:
    """How many of ``leases`` no longer hold their key."""
    checker = joblock.ClusterLocks(cluster.alive()[0].url, prefix="")
    try:
        # A second holder's try: None where the lock is still someone's (its own holder's).
        taken = checker.acquire_many([lease.key for lease in leases], TTL)
        return sum(lease is not None for lease in taken)
    finally:
        checker.close()


def wait(check: Any, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (joblock.JoblockError, RuntimeError):  # a node not answering yet; not yet ready
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def served(cluster: LocalCluster) -> bool:
    cluster.wait_ok(timeout=0.5)
    alive = cluster.alive()
    return all(primary in alive for primary in cluster.primaries())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None)
    options = parser.parse_args()
    rng = random.Random(options.seed)
    totals = {"confirmed": [0, 0], "unconfirmed": [0, 0]}  # handed out, lost
    errors: dict[str, int] = {}
    started = time.monotonic()
    with LocalCluster(primaries=3, replicas=1, args=("--repl-diskless-sync-delay", "0")) as cluster:
        cluster.wait_replicated()
        for round_no in range(1, options.rounds + 1):
            victim = rng.choice(cluster.primaries())
            survivor = next(node for node in cluster.alive() if node is not victim)
            with Takers(survivor.url, round_no) as takers:
                time.sleep(rng.uniform(0.3, 0.8))  # grants in flight when the primary dies
                victim.kill()
                wait(lambda: served(cluster), "a replica to take the killed primary's slots")
                time.sleep(0.3)
            for kind, leases in takers.held.items():
                totals[kind][0] += len(leases)
                totals[kind][1] += lost(cluster, leases)
            for name, count in takers.errors.items():
                errors[name] = errors.get(name, 0) + count
            victim.start()  # rejoins as a replica of the node that took its slots
            wait(lambda: served(cluster) and _replicated(cluster), "the killed node to rejoin as a replica")
            print(
                f"round {round_no}: killed :{victim.port}; confirmed lost {totals['confirmed'][1]}"
                f" of {totals['confirmed'][0]}, unconfirmed lost {totals['unconfirmed'][1]}"
                f" of {totals['unconfirmed'][0]}",
                flush=True,
            )
    print(
        f"\n{options.rounds} forced failovers (SIGKILLed primaries) in {time.monotonic() - started:.0f} s\n"
    )
    print("| grants | handed out | lost to a second holder |")
    print("|---|---:|---:|")
    for kind, (handed, gone) in totals.items():
        label = "`min_replicas=1`" if kind == "confirmed" else "default (unconfirmed)"
        print(f"| {label} | {handed} | {gone} |")
    print(
        "\nerrors raised meanwhile (documented): "
        + (", ".join(f"{k} {v}" for k, v in errors.items()) or "none")
    )
    return 1 if totals["confirmed"][1] else 0


def _replicated(cluster: LocalCluster) -> bool:
    cluster.wait_replicated(timeout=0.5)
    return True


if __name__ == "__main__":
    sys.exit(main())
