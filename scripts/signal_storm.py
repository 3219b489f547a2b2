"""The signal storm: a SIGALRM handler raising in the main thread while threads share its client.

    python scripts/signal_storm.py                      # 5 runs of 3 s on the active core
    JOBLOCK_NO_EXTENSIONS=1 python scripts/signal_storm.py --runs 20

Every ``--interval`` seconds (0.7 ms) an alarm fires; while the main thread is inside a
joblock call its handler raises, so that call ends with the handler's exception, at
whatever point of the driver it was (writing for everyone, reading as the leader,
parsing replies, waiting for the mutex). ``--threads`` threads (31) share the main
thread's ``Locks`` and take and release keys of their own meanwhile. A run reports the
slowest call of those threads, the calls that went wrong (a fresh key found taken, a
release of a live lease answered False: replies given to the wrong caller or a lost
connection's retried release), errors raised, and threads still in a call 10 s after the
run ended (hung). Exits 1 when any run hung, went wrong, raised, or delayed a call of
another thread over ``--stall`` (0.1 s).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import joblock
from joblock._tools.servers import RedisServer


class Alarm(Exception):
    """What the handler raises in the main thread."""


def storm(locks: joblock.Locks, seconds: float, threads: int, interval: float) -> dict[str, object]:
    """One run on ``locks`` (closed at the end unless a thread hung in it); what it saw."""
    armed = [False]  # the handler raises only inside a joblock call of the main thread

    def handler(signum: int, frame: object) -> None:
        if armed[0]:
            armed[0] = False
            raise Alarm

    stop = threading.Event()
    guard = threading.Lock()
    slowest, wrong, errors, calls = [0.0], [], [], [0]

    def worker(i: int) -> None:
        n = 0
        while not stop.is_set():
            key = f"t{i}:{n % 4}"
            n += 1
            started = time.monotonic()
            try:
                lease = locks.acquire(key, 5)
                if lease is None:
                    wrong.append(f"fresh, yet taken: {key}")
                elif not lease.release():
                    wrong.append(f"a live lease's release answered False: {key}")
            except Exception as e:
                errors.append(repr(e))
            took = time.monotonic() - started
            with guard:
                slowest[0] = max(slowest[0], took)
                calls[0] += 1

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    alarms, n = 0, 0
    end = time.monotonic() + seconds
    while True:
        try:
            armed[0] = False
            if time.monotonic() > end:
                signal.setitimer(signal.ITIMER_REAL, 0, 0)
                break
            key = f"main:{n % 4}"
            n += 1
            armed[0] = True
            lease = locks.acquire(key, 5)
            if lease is not None:
                lease.release()
            armed[0] = False
        except Alarm:
            alarms += 1
        except joblock.JoblockError as e:
            errors.append(f"main: {e!r}")
    signal.signal(signal.SIGALRM, previous)
    stop.set()
    for w in workers:
        w.join(10)
    hung = sum(w.is_alive() for w in workers)
    if not hung:
        locks.close()
    return {
        "core": type(locks)._core.__name__.rpartition(".")[2],
        "calls": calls[0],
        "interrupted": alarms,
        "slowest_ms": round(slowest[0] * 1000, 1),
        "wrong": len(wrong),
        "errors": len(errors),
        "hung": hung,
        "first": (wrong + errors)[:2],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=31)
    parser.add_argument("--interval", type=float, default=0.0007)
    parser.add_argument("--stall", type=float, default=0.1)
    args = parser.parse_args()
    failed = 0
    with RedisServer() as server:
        for run in range(args.runs):
            locks = joblock.Locks(server.url, prefix=f"storm{os.getpid()}:{run}")
            got = storm(locks, args.seconds, args.threads, args.interval)
            bad = got["hung"] or got["wrong"] or got["errors"] or float(got["slowest_ms"]) > args.stall * 1000  # type: ignore[arg-type]
            failed += bool(bad)
            print(f"run {run + 1}: {got}{'  <- FAILED' if bad else ''}", flush=True)
            if got["hung"]:
                break  # its threads still hold the client: the next run would not be alone
    print(f"{failed} of {run + 1} runs failed on the {joblock.implementation} core")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
