"""Memory stays flat: a million items through the core's functions (the compiled twin's
C code above all, error paths included) and 20,000 real acquire/release round trips.

Growth is measured twice: by tracemalloc, which sees every allocation made through
Python's allocators (the compiled core's buffers and objects included), and by the
process' resident set. The bounds are far below what one leaked byte per item would
add. scripts/leak_check.py runs a million real round trips for the record.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import tracemalloc

import pytest

from joblock.errors import ProtocolError

BATCH = 10_000
# Under AddressSanitizer (scripts/sanitize.sh) freed memory waits in a quarantine of up
# to 256 MiB, so the resident size grows without a leak; tracemalloc still counts.
RESIDENT_BOUND = 8 * 2**20 if "asan" not in os.environ.get("LD_PRELOAD", "") else 512 * 2**20


def rss() -> int:
    """Resident set size in bytes (the peak where the current one cannot be read)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def growth(work, rounds):
    """Bytes resident gained over ``rounds`` runs of ``work`` after a warm-up, then bytes
    traced over a fifth as many (tracemalloc's own tables would blur the resident size)."""
    work()
    work()
    gc.collect()
    resident = rss()
    for _ in range(rounds):
        work()
    gc.collect()
    resident = rss() - resident
    tracemalloc.start()
    try:
        traced = tracemalloc.get_traced_memory()[0]
        for _ in range(max(1, rounds // 5)):
            work()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - traced, resident
    finally:
        tracemalloc.stop()


ARGS = [
    (1,),
    ("a-b", 2.5),
    (None, True, b"\x00\xff"),
    ([1, {"k": "v"}],),
    ("x" * 300,),  # becomes a digest
    ("héllo", -(2**70)),
]
REPLY_KINDS = [(b"+OK\r\n", b"OK"), (b"$-1\r\n", None), (b":7\r\n", 7), (b"-ERR nope\r\n", "error")]
OWNER = object()


def core_work(core):
    """One batch of BATCH items through every function of the core, and its error paths."""
    holder = b"@host:1"
    sha = b"0" * 40
    tuples = [ARGS[i % len(ARGS)] for i in range(BATCH)]
    wire = b"".join(REPLY_KINDS[i % len(REPLY_KINDS)][0] for i in range(BATCH))
    verdict_wire = b":1\r\n:0\r\n" * (BATCH // 2)

    def work():
        keys = core.build_keys(b"joblock", "Job", tuples, 0)
        named = core.as_keys([k.decode() for k in keys[:100]], 0)
        fences = [core.fence_key(k) for k in named]
        values = core.new_values(BATCH, holder)
        payloads = (
            core.encode_acquire(keys, values, 30_000, None),
            core.encode_acquire(keys[:100], values[:100], 30_000, sha),
            core.encode_acquire(keys[:100], values[:100], 30_000, sha, (3, 1, 0, b"x", 2**70)),
            core.encode_evalsha(sha, keys, values, None),
            core.encode_evalsha(sha, keys, values, 30_000),
            core.encode_command((b"SET", keys[0], values[0], "NX", 5)),
        )
        reader, replies = core.Reader(), []
        for start in range(0, len(wire), 4093):  # replies split across feeds
            reader.feed(wire[start : start + 4093])
            core.take(reader, replies, BATCH)
        leases, errors = core.make_leases(OWNER, keys, None, values, replies, 1e12)
        assert errors == BATCH // 4
        leases = [lease if type(lease) is core.Lease else None for lease in leases]
        idx, _, _ = core.lease_fields(leases, 0)
        verdicts, out = [], [False] * len(leases)
        reader.feed(verdict_wire[: 4 * len(idx)])
        core.take(reader, verdicts, len(idx))
        core.settle(leases, idx, verdicts, out, True, 0.0)
        core.error_positions(replies)
        core.claims([None, values[1], b"other", *replies[: BATCH - 3]], values)
        # Error paths: each raises after allocating, and must free what it allocated.
        for bad in (
            lambda: core.build_keys(b"joblock", "Job", [*tuples[:50], (object(),)], 0),
            lambda: core.build_key(b"joblock", "Job", ("a\ud800",), None),
            lambda: core.as_keys(["k", b""], 0),
            lambda: core.encode_command((b"SET", 1.5)),
            lambda: core.encode_acquire(keys[:10], values[:9], 5, None),
            lambda: core.encode_acquire(keys[:10], values[:10], 5, sha, (1, 2.5)),
            lambda: core.fence_key(b"a}b"),
        ):
            with pytest.raises((TypeError, ValueError)):
                bad()
        broken = core.Reader()
        broken.feed(b"+OK\r\n" * 50 + b"?bad\r\n")
        with pytest.raises(ProtocolError):
            core.take(broken, [], 100)
        return payloads, fences

    return work


@pytest.mark.slow
def test_a_million_items_through_the_core_leave_memory_flat(core):
    compiled = core.__name__.endswith("_core_c")
    rounds = 100 if compiled else 10  # 1,000,000 items on the compiled twin; 100,000 on the pure ones
    traced, resident = growth(core_work(core), rounds)
    print(f"\n{core.__name__}: {rounds * BATCH} items: traced {traced:+d} B, resident {resident:+d} B")
    assert traced < 64 * 1024
    assert resident < RESIDENT_BOUND


ROUND_TRIPS = 20_000


@pytest.mark.slow
def test_20k_acquire_release_round_trips_leave_memory_flat(locks):
    keys = [f"{locks.prefix}:leak{i % 100}" for i in range(ROUND_TRIPS)]
    position = iter(range(10**9))

    def work():
        # A slice of the round trips per call, so the warm-up covers every kind of them.
        for _ in range(ROUND_TRIPS // 10):
            i = next(position)
            lease = locks.acquire(keys[i % ROUND_TRIPS], 30, fence=i % 10 == 0)
            assert lease.release() is True
        leases = locks.acquire_many(keys[:100], 30)
        assert locks.release_many(leases) == [True] * 100

    traced, resident = growth(work, 10)
    print(f"\n{ROUND_TRIPS} round trips: traced {traced:+d} B, resident {resident:+d} B")
    assert traced < 64 * 1024
    assert resident < RESIDENT_BOUND
