#!/usr/bin/env python3
"""How many fencing counter keys N distinct fenced keys leave behind (docs/keys.md).

    python scripts/fence_keys.py                  # 1,000,000 keys, the active core
    python scripts/fence_keys.py -n 100000 --core python
    python scripts/fence_keys.py --url redis://127.0.0.1:6379/0

Takes N distinct keys with ``fence=True`` (``acquire_many``, pipelined, in chunks) on a
throwaway Redis, releases them, and counts what is left: the slot counters
(``joblock:fences:{...}``, at most one per hash slot), per-key ``:fence`` counters (the
scheme before, which left one per key: none now) and every other key. Also checks that
the numbers of each chunk are above those of every earlier grant of its slot.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

if importlib.util.find_spec("joblock") is None:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import joblock
from joblock._slot_tags import COUNTER
from joblock._tools.admin import Node
from joblock._tools.servers import RedisServer
from joblock.locks import Locks
from joblock.settings import parse_url


def core_named(name: str):
    if name == "c":
        from joblock._core import compiled

        found = compiled()
        if found is None:
            sys.exit("fence_keys: the compiled core is not built here")
        return found
    from joblock import _core_py

    return _core_py


def count(node: Node, pattern: bytes) -> int:
    found, cursor = 0, b"0"
    while True:
        cursor, keys = node.calls([(b"SCAN", cursor, b"MATCH", pattern, b"COUNT", 10_000)])[0]
        found += len(keys)
        if cursor == b"0":
            return found


def run(url: str, n: int, chunk: int, core) -> None:
    locks = type("Locks", (Locks,), {"_core": core})(url, prefix="fk")
    node = Node(parse_url(url), core)
    seconds = 0.0  # in acquire_many and release_many only
    top: dict[int, int] = {}  # the highest number granted per slot so far
    for start in range(0, n, chunk):
        keys = [f"fk:{i}" for i in range(start, min(n, start + chunk))]
        began = time.perf_counter()
        leases = locks.acquire_many(keys, 60, fence=True)
        released = locks.release_many(leases)
        seconds += time.perf_counter() - began
        assert all(released)
        seen: dict[int, int] = {}
        for key, lease in zip(keys, leases):
            slot = core.key_slot(key.encode())
            assert lease is not None and lease.fence > top.get(slot, 0), key
            seen[slot] = max(seen.get(slot, 0), lease.fence)
        top.update(seen)
    counters = count(node, COUNTER.split(b"{")[0] + b"*")
    legacy = count(node, b"*:fence")
    total = node.calls([(b"DBSIZE",)])[0]
    memory = node.calls([(b"MEMORY", b"STATS")])[0]
    dataset = dict(zip(memory[0::2], memory[1::2]))[b"dataset.bytes"]
    locks.close()
    print(f"core: {core.__name__}, {n:,} distinct fenced keys taken and released in {seconds:.1f} s")
    print(f"slot counters left: {counters:,} (bound 16,384); per-key ':fence' counters: {legacy:,}")
    print(f"keys in the database: {total:,}; dataset: {dataset / 1024:,.0f} KiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=1_000_000, help="distinct keys (default 1,000,000)")
    parser.add_argument("--chunk", type=int, default=100_000, help="keys per acquire_many (default 100,000)")
    parser.add_argument("--core", choices=["c", "python"], default=None)
    parser.add_argument("--url", help="a Redis to use instead of a throwaway one (its keys are counted too)")
    args = parser.parse_args()
    core = core_named(args.core) if args.core else joblock._core.core
    if args.url:
        run(args.url, args.n, args.chunk, core)
    else:
        with RedisServer() as server:
            run(server.url, args.n, args.chunk, core)
    return 0


if __name__ == "__main__":
    sys.exit(main())
