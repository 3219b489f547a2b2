"""``joblock inspect`` and ``joblock release``: look at and clear locks by hand."""

from __future__ import annotations

import re
from typing import Any

from ._core import core
from .connection import Connection, Pool
from .settings import parse_url

# A lock's value: 128-bit token in hex, then "@host:pid" of the holder.
_VALUE = re.compile(rb"^[0-9a-f]{32}@(?P<host>.*):(?P<pid>\d+)$")


def _pool(url: str) -> Pool:
    return Pool(parse_url(url), core)


def _describe(conn: Any, keys: list[bytes]) -> list[tuple[bytes, str, float | None, int | None]]:
    """(key, holder, seconds left or None for no ttl, fence) for each key that holds a joblock lock."""
    commands = []
    for key in keys:
        commands += [(b"GET", key), (b"PTTL", key), (b"GET", core.fence_key(key))]
    conn.send(b"".join(core.encode_command(c) for c in commands))
    replies = conn.read(len(commands))
    rows = []
    for i, key in enumerate(keys):
        value, ms, fence = replies[3 * i : 3 * i + 3]
        match = _VALUE.match(value) if isinstance(value, bytes) else None
        if match is None or not isinstance(ms, int) or ms == -2:
            continue  # not a lock (a fence counter, or someone else's key), or gone
        holder = f"{match['host'].decode(errors='replace')} pid {int(match['pid'])}"
        # PTTL -1: a lock without a ttl (compat.RedisLock with timeout=None), held
        # until released: the one most worth seeing here.
        left = ms / 1000 if ms >= 0 else None
        rows.append((key, holder, left, int(fence) if isinstance(fence, bytes) else None))
    return rows


def inspect(url: str, prefix: str, pattern: str) -> int:
    """Prints the held locks under ``prefix`` matching ``pattern``; SCAN only, no KEYS.

    On a Redis Cluster node, every primary is scanned (a lock and its fence counter
    share a slot, so each primary describes its own locks).
    """
    import dataclasses

    from .cluster import cluster_primaries

    settings = parse_url(url)
    primaries = cluster_primaries(settings, core)
    pools = (
        [_pool(url)]
        if primaries is None
        else [Pool(dataclasses.replace(settings, host=h, port=p, db=0), core) for h, p in primaries]
    )
    match = f"{prefix}:{pattern}" if prefix else pattern
    found = 0
    print(f"{'KEY':<48} {'HOLDER':<28} {'TTL':>9} {'FENCE':>7}")
    for pool in pools:
        conn = pool.get()
        cursor = b"0"
        while True:
            cursor, keys = conn.call("SCAN", cursor, "MATCH", match, "COUNT", 1000, "TYPE", "string")
            for key, holder, left, fence in _describe(conn, keys):
                found += 1
                ttl = "no ttl" if left is None else f"{left:.1f}s"
                print(
                    f"{key.decode(errors='replace'):<48} {holder:<28} {ttl:>9} {fence if fence else '-':>7}"
                )
            if cursor == b"0":
                break
        pool.put(conn)
    print(f"{found} lock{'s' if found != 1 else ''} held")
    return 0


def _key_pool(url: str, raw: bytes) -> Pool:
    """A pool to the server holding ``raw``: on a Redis Cluster, the primary of its slot."""
    import dataclasses

    from .cluster import read_slots

    settings = parse_url(url)
    probe = Connection(settings, core)
    try:
        if b"cluster_enabled:1" not in probe.call("INFO", "cluster"):
            return Pool(settings, core)
        slot = core.key_slot(raw)
        for first, last, (host, port) in read_slots(probe):
            if first <= slot <= last:
                return Pool(dataclasses.replace(settings, host=host, port=port, db=0), core)
    finally:
        probe.close()
    return Pool(settings, core)


def release(url: str, key: str) -> int:
    """Deletes the lock at ``key`` whoever holds it, saying what it removed."""
    raw = core.as_key(key)
    pool = _key_pool(url, raw)
    conn = pool.get()
    rows = _describe(conn, [raw])
    if not rows:
        print(f"no lock at {key}")
        pool.put(conn)
        return 1
    _, holder, left, fence = rows[0]
    removed = conn.call("DEL", raw)
    pool.put(conn)
    fenced = f", fence {fence}" if fence else ""
    if removed:
        ttl = "no ttl" if left is None else f"{left:.1f} s left"
        print(f"released {key} (held by {holder}, {ttl}{fenced})")
        return 0
    print(f"no lock at {key} (it expired just now)")
    return 1
