"""``joblock inspect`` and ``joblock release``: look at and clear locks by hand."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from .._core import core
from .._engine.ops import Call
from .._engine.sync import Driver
from .._engine.topology import slot_ranges
from ..settings import Settings, parse_url

# A lock's value: 128-bit token in hex, then "@host:pid" of the holder.
_VALUE = re.compile(rb"^[0-9a-f]{32}@(?P<host>.*):(?P<pid>\d+)$")


class Node:
    """One server, for commands typed by hand: replies in order, error replies raised."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._driver = Driver(core, lambda _: settings)

    def call(self, *command: Any) -> Any:
        return self.calls([command])[0]

    def calls(self, commands: list[tuple[Any, ...]], errors_as_replies: bool = False) -> list[Any]:
        op = Call(
            None, core, commands, self.settings.retries, idempotent=True, errors_as_replies=errors_as_replies
        )
        return self._driver.run(op)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._driver.close()


@dataclasses.dataclass
class Held:
    """A joblock lock as found in Redis."""

    key: bytes
    token: str  # the lock's value as text: ``lease.token.decode()`` of the lease that holds it
    holder: str  # "host pid N"
    left: float | None  # seconds of ttl left; None for a lock without a ttl
    fence: int | None

    def ttl(self, unit: str = "") -> str:
        return "no ttl" if self.left is None else f"{self.left:.1f}{unit}"


def server_info(settings: Settings) -> dict[str, str]:
    """The server section of INFO, as a dict."""
    node = Node(settings)
    try:
        text = node.call("INFO", "server").decode(errors="replace")
    finally:
        node.close()
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def describe_server(info: dict[str, str]) -> str:
    """The version and, when INFO says, the binary: "Redis 7.0.15 (/usr/bin/redis-server)"."""
    executable = info.get("executable")
    return f"Redis {info.get('redis_version', '?')}" + (f" ({executable})" if executable else "")


def _describe(node: Node, keys: list[bytes]) -> list[Held]:
    """The locks among ``keys``: keys holding something else, or nothing, are left out."""
    commands = []
    for key in keys:
        commands += [(b"GET", key), (b"PTTL", key), (b"GET", core.fence_key(key))]
    replies = node.calls(commands, errors_as_replies=True)
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
        token = value.decode(errors="replace")
        rows.append(Held(key, token, holder, left, int(fence) if isinstance(fence, bytes) else None))
    return rows


def _primaries(settings: Settings) -> list[tuple[int, int, Settings]] | None:
    """The slot ranges of the cluster the server at ``settings`` belongs to; None when it is no cluster."""
    node = Node(settings)
    try:
        if b"cluster_enabled:1" not in node.call("INFO", "cluster"):
            return None
        ranges = slot_ranges(node.call("CLUSTER", "SLOTS"), settings.host)
    finally:
        node.close()
    return [
        (first, last, dataclasses.replace(settings, host=h, port=p, db=0)) for first, last, (h, p) in ranges
    ]


def inspect(url: str, prefix: str, pattern: str, tokens: bool = False) -> int:
    """Prints the held locks under ``prefix`` matching ``pattern``; SCAN only, no KEYS.

    ``tokens`` adds a column with each lock's token, as text.

    On a Redis Cluster node, every primary is scanned (a lock and its fence counter
    share a slot, so each primary describes its own locks).
    """
    settings = parse_url(url)
    ranges = _primaries(settings)
    servers = [settings] if ranges is None else list({s.port: s for _, _, s in ranges}.values())
    match = f"{prefix}:{pattern}" if prefix else pattern
    found = 0
    print(f"{'KEY':<48} {'HOLDER':<28} {'TTL':>9} {'FENCE':>7}" + ("  TOKEN" if tokens else ""))
    for server in servers:
        node = Node(server)
        try:
            cursor = b"0"
            while True:
                cursor, keys = node.call("SCAN", cursor, "MATCH", match, "COUNT", 1000, "TYPE", "string")
                for held in _describe(node, keys):
                    found += 1
                    shown = held.key.decode(errors="replace")
                    line = f"{shown:<48} {held.holder:<28} {held.ttl('s'):>9} {held.fence or '-':>7}"
                    print(line + (f"  {held.token}" if tokens else ""))
                if cursor == b"0":
                    break
        finally:
            node.close()
    print(f"{found} lock{'s' if found != 1 else ''} held")
    return 0


def release(url: str, key: str) -> int:
    """Deletes the lock at ``key`` whoever holds it, saying what it removed."""
    raw = core.as_key(key)
    settings = parse_url(url)
    ranges = _primaries(settings)
    if ranges is not None:  # on a Redis Cluster: the primary of the key's slot
        slot = core.key_slot(raw)
        settings = next(s for first, last, s in ranges if first <= slot <= last)
    node = Node(settings)
    try:
        rows = _describe(node, [raw])
        if not rows:
            print(f"no lock at {key}")
            return 1
        [held] = rows
        removed = node.call("DEL", raw)
    finally:
        node.close()
    if removed:
        fenced = f", fence {held.fence}" if held.fence else ""
        print(f"released {key} (held by {held.holder}, {held.ttl(' s left')}{fenced}, token {held.token})")
        return 0
    print(f"no lock at {key} (it expired just now)")
    return 1
