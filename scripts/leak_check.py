#!/usr/bin/env python3
"""A million real acquire/release cycles against a throwaway Redis, sampling the resident
set size: memory must stay flat once warm.

    python scripts/leak_check.py                     # 1,000,000 cycles, the active core
    python scripts/leak_check.py --core python -n 200000
    python scripts/leak_check.py --url redis://127.0.0.1:6379/0
    python scripts/leak_check.py --asyncio -n 200000    # on an AsyncLocks

Every tenth cycle takes a fenced lock (the fenced-acquire script), and every thousandth
adds a pipelined batch of 100 (acquire_many, extend_many, release_many). Prints one line
per sample and exits 1 when the resident set grew by more than ``--bound`` MiB between
the first sample (after the warm-up) and the last. Too slow for the test suite, which
runs 20,000 cycles per twin in tests/test_leaks.py.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import os
import resource
import sys
import time

if importlib.util.find_spec("joblock") is None:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import joblock
from joblock._tools.servers import RedisServer
from joblock.aio import AsyncLocks
from joblock.locks import Locks


def rss() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak, which grows with the current size
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def core_named(name: str):
    if name == "c":
        from joblock._core import compiled

        found = compiled()
        if found is None:
            sys.exit("leak_check: the compiled core is not built here")
        return found
    if name == "python-nohiredis":
        sys.modules["hiredis"] = None  # type: ignore[assignment]  # the pure reader
    from joblock import _core_py

    if name == "python-nohiredis":
        assert _core_py.Reader is _core_py.PyReader, "import this before anything imports hiredis"
    return _core_py


KEYS = [f"leak-check:{i}" for i in range(1000)]
BATCH = [f"leak-check:batch:{i}" for i in range(100)]


class Samples:
    """The resident set every ``every`` cycles after the warm-up, printed as it goes."""

    def __init__(self, every: int, warmup: int) -> None:
        self.every, self.warmup = every, warmup
        self.started = time.monotonic()
        self.taken: list[tuple[int, float, int]] = []

    def after(self, i: int) -> None:
        done = i + 1 - self.warmup
        if done >= 0 and done % self.every == 0:
            gc.collect()
            self.taken.append((done, time.monotonic() - self.started, rss()))
            _, elapsed, size = self.taken[-1]
            print(f"{done:>9} cycles  {elapsed:7.1f} s  rss {size / 2**20:8.2f} MiB", flush=True)


def cycles(locks: Locks, n: int, samples: Samples) -> None:
    for i in range(samples.warmup + n):
        lease = locks.acquire(KEYS[i % 1000], 30, fence=i % 10 == 0)
        if lease is None or lease.release() is not True:
            raise SystemExit(f"cycle {i}: the lock was not ours")
        if i % 1000 == 999:
            leases = locks.acquire_many(BATCH, 30)
            locks.extend_many(leases, 30)
            locks.release_many(leases)
        samples.after(i)


async def cycles_async(locks: AsyncLocks, n: int, samples: Samples) -> None:
    """``cycles`` on an AsyncLocks: the asyncio driver's engine."""
    for i in range(samples.warmup + n):
        lease = await locks.acquire(KEYS[i % 1000], 30, fence=i % 10 == 0)
        if lease is None or await lease.release() is not True:
            raise SystemExit(f"cycle {i}: the lock was not ours")
        if i % 1000 == 999:
            leases = await locks.acquire_many(BATCH, 30)
            await locks.extend_many(leases, 30)
            await locks.release_many(leases)
        samples.after(i)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=1_000_000, help="cycles measured (default 1,000,000)")
    parser.add_argument("--warmup", type=int, default=20_000, help="cycles before the first sample")
    parser.add_argument("--every", type=int, default=100_000, help="cycles between samples")
    parser.add_argument("--core", choices=["c", "python", "python-nohiredis"], default=None)
    parser.add_argument("--url", help="a Redis to use instead of a throwaway one")
    parser.add_argument("--bound", type=float, default=4.0, help="MiB of growth allowed (default 4)")
    parser.add_argument("--asyncio", action="store_true", help="the cycles on an AsyncLocks")
    args = parser.parse_args()
    core = core_named(args.core) if args.core else joblock._core.core
    server = None if args.url else RedisServer().start()
    url = args.url or server.url  # type: ignore[union-attr]
    samples = Samples(args.every, args.warmup)
    try:
        print(f"joblock {joblock.__version__}, core {core.__name__}, {url}", flush=True)
        if args.asyncio:

            async def run() -> None:
                locks = type("AsyncLocks", (AsyncLocks,), {"_core": core})(url, prefix="")
                try:
                    await cycles_async(locks, args.n, samples)
                finally:
                    await locks.close()

            asyncio.run(run())
        else:
            with type("Locks", (Locks,), {"_core": core})(url, prefix="") as locks:
                cycles(locks, args.n, samples)
    finally:
        if server is not None:
            server.close()
    taken = samples.taken
    grown = (taken[-1][2] - taken[0][2]) / 2**20
    rate = args.n / taken[-1][1]
    print(f"{args.n} cycles at {rate:,.0f}/s: rss {grown:+.2f} MiB after warm-up (bound {args.bound})")
    return 0 if grown <= args.bound else 1


if __name__ == "__main__":
    sys.exit(main())
