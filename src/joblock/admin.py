"""``joblock inspect`` and ``joblock release``: look at and clear locks by hand."""

from __future__ import annotations

import re
from typing import Any

from ._core import core
from .connection import Pool
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
    """Prints the held locks under ``prefix`` matching ``pattern``; SCAN only, no KEYS."""
    pool = _pool(url)
    conn = pool.get()
    match = f"{prefix}:{pattern}" if prefix else pattern
    cursor = b"0"
    found = 0
    print(f"{'KEY':<48} {'HOLDER':<28} {'TTL':>9} {'FENCE':>7}")
    while True:
        cursor, keys = conn.call("SCAN", cursor, "MATCH", match, "COUNT", 1000, "TYPE", "string")
        for key, holder, left, fence in _describe(conn, keys):
            found += 1
            ttl = "no ttl" if left is None else f"{left:.1f}s"
            print(f"{key.decode(errors='replace'):<48} {holder:<28} {ttl:>9} {fence if fence else '-':>7}")
        if cursor == b"0":
            break
    pool.put(conn)
    print(f"{found} lock{'s' if found != 1 else ''} held")
    return 0


def release(url: str, key: str) -> int:
    """Deletes the lock at ``key`` whoever holds it, saying what it removed."""
    raw = core.as_key(key)
    pool = _pool(url)
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
