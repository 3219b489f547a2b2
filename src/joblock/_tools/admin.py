"""``joblock inspect`` and ``joblock release``: look at and clear locks by hand."""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

from .._core import core
from .._engine.ops import Call
from .._engine.sync import Driver
from .._engine.topology import slot_ranges
from .._engine.waits import CLOCK_MARGIN, parse_entry, queue_key
from ..settings import Settings, parse_url

# A lock's value: 128-bit token in hex, then "@host:pid" of the holder (and, for a
# fenced holder of a counting lock, "#" and its fencing number).
_VALUE = re.compile(rb"^[0-9a-f]{32}~?@(?P<host>.*):(?P<pid>\d+)(?:#(?P<fence>\d+))?$")


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
    limit: int = 1  # a counting lock's holders at most (this is one of them); 0: a reader

    def ttl(self, unit: str = "") -> str:
        return "no ttl" if self.left is None else f"{self.left:.1f}{unit}"

    def shown(self) -> str:
        """The key as text; a counting lock's holder says of how many (``key [limit 3]``),
        a read-write lock's reader says so (``key [reader]``)."""
        key = self.key.decode(errors="replace")
        if self.limit == 0:
            return f"{key} [reader]"
        return key if self.limit == 1 else f"{key} [limit {self.limit}]"


@dataclasses.dataclass
class Waiter:
    """A caller queued for a lock, as found in Redis."""

    holder: str  # "host pid N", as a lock's holder
    kind: str  # "writer", "reader", "limit N"
    left: float  # seconds until its wait ends


def _waiters(node: Node, keys: list[bytes]) -> list[list[Waiter]]:
    """Each key's queue of waiters, first first."""
    queues = node.calls([(b"LRANGE", queue_key(key), 0, -1) for key in keys], errors_as_replies=True)
    now = time.time()
    out = []
    for queue in queues:
        waiters = []
        for entry in queue if isinstance(queue, list) else []:
            parsed = parse_entry(entry)
            match = None if parsed is None else _VALUE.match(parsed[5])
            if parsed is None or match is None or parsed[2] <= now:
                continue  # not joblock's, or past its deadline
            limit = parsed[4]
            kind = "reader" if limit == 0 else "writer" if limit == 1 else f"limit {limit}"
            waiters.append(Waiter(_holder(match), kind, parsed[2] - CLOCK_MARGIN - now))
        out.append(waiters)
    return out


def _holder(match: re.Match[bytes]) -> str:
    return f"{match['host'].decode(errors='replace')} pid {int(match['pid'])}"


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
        holder = _holder(match)
        # PTTL -1: a lock without a ttl (compat.RedisLock with timeout=None), held
        # until released: the one most worth seeing here.
        left = ms / 1000 if ms >= 0 else None
        token = value.decode(errors="replace")
        rows.append(Held(key, token, holder, left, int(fence) if isinstance(fence, bytes) else None))
    return rows


def _describe_counting(node: Node, keys: list[bytes]) -> list[Held]:
    """The holders of the counting locks among ``keys`` (sorted sets: token -> expiry in
    ms of the server's clock, and "limit" -> -N) and the readers of read-write locks
    ("limit" -> 0), live ones only, soonest to expire first."""
    replies = node.calls([(b"TIME",)] + [(b"ZRANGE", key, 0, -1, b"WITHSCORES") for key in keys], True)
    seconds, micros = replies[0]
    now = int(seconds) * 1000 + int(micros) // 1000
    rows = []
    for key, flat in zip(keys, replies[1:]):
        if not isinstance(flat, list):
            continue  # gone since SCAN saw it
        scores = {member: float(score) for member, score in zip(flat[0::2], flat[1::2])}
        limit = -scores.pop(b"limit", 0)
        for member, expiry in scores.items():
            match = _VALUE.match(member)
            if match is None or limit == 1 or expiry <= now:
                continue  # not a joblock counting lock or reader, or an expired holder not yet dropped
            fence = None if match["fence"] is None else int(match["fence"])
            rows.append(
                Held(
                    key,
                    member.decode(errors="replace"),
                    _holder(match),
                    (expiry - now) / 1000,
                    fence,
                    int(limit),
                )
            )
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


def inspect(url: str, prefix: str, pattern: str, tokens: bool = False, queue: bool = False) -> int:
    """Prints the held locks under ``prefix`` matching ``pattern``; SCAN only, no KEYS.

    ``tokens`` adds a column with each lock's token, as text; ``queue`` lists each
    lock's waiters under it, in the order they are granted the lock.

    On a Redis Cluster node, every primary is scanned (a lock and its fence counter
    share a slot, so each primary describes its own locks).
    """
    settings = parse_url(url)
    ranges = _primaries(settings)
    servers = [settings] if ranges is None else list({s.port: s for _, _, s in ranges}.values())
    match = f"{prefix}:{pattern}" if prefix else pattern
    found = 0
    header = f"{'KEY':<48} {'HOLDER':<28} {'TTL':>9} {'FENCE':>7} {'WAITING':>7}"
    print(header + ("  TOKEN" if tokens else ""))
    for server in servers:
        node = Node(server)
        try:
            for kind, describe in (("string", _describe), ("zset", _describe_counting)):
                cursor = b"0"
                while True:
                    cursor, keys = node.call("SCAN", cursor, "MATCH", match, "COUNT", 1000, "TYPE", kind)
                    rows = describe(node, keys) if keys else []
                    found += len(rows)
                    _show(node, rows, tokens, queue)
                    if cursor == b"0":
                        break
        finally:
            node.close()
    print(f"{found} lock{'s' if found != 1 else ''} held")  # a counting lock's holders count one each
    return 0


def _show(node: Node, rows: list[Held], tokens: bool, queue: bool) -> None:
    """Prints locks and how many wait for each (with ``queue``, who, in order), each
    key's waiters with its first holder."""
    firsts = {held.key: held for held in reversed(rows)}
    queues = dict(zip(firsts, _waiters(node, list(firsts)))) if firsts else {}
    for held in rows:
        waiters = queues.pop(held.key) if firsts[held.key] is held else []
        line = f"{held.shown():<48} {held.holder:<28} {held.ttl('s'):>9} {held.fence or '-':>7}"
        print(f"{line} {len(waiters) or '-':>7}" + (f"  {held.token}" if tokens else ""))
        for n, waiter in enumerate(waiters if queue else [], 1):
            print(f"  {n:>3}. {waiter.holder:<28} {waiter.kind:<9} waits {waiter.left:.1f}s more")


def _wake_first(node: Node, raw: bytes) -> None:
    """Tells the first waiter of the lock just deleted to look again (it takes the lock):
    deleted by hand, the lock was not handed over as a release hands it."""
    first = node.call("LINDEX", queue_key(raw), 0)
    parsed = None if first is None else parse_entry(first)
    if parsed is not None:
        node.call("PUBLISH", b"joblock:wake:" + parsed[0], parsed[1] + b" ?")


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
        rows = _describe(node, [raw]) or _describe_counting(node, [raw])
        if not rows:
            print(f"no lock at {key}")
            return 1
        removed = node.call("DEL", raw)
        if removed:
            _wake_first(node, raw)
    finally:
        node.close()
    if removed:
        if rows[0].limit != 1:  # a counting lock's holders, or a read-write lock's readers: all go
            kind = (
                f"a counting lock of limit {rows[0].limit}"
                if rows[0].limit
                else "a read-write lock's readers"
            )
            print(f"released {key} ({kind}; {len(rows)} holders):")
        for held in rows:
            fenced = f", fence {held.fence}" if held.fence else ""
            text = f"held by {held.holder}, {held.ttl(' s left')}{fenced}, token {held.token}"
            print(f"  {text}" if held.limit != 1 else f"released {key} ({text})")
        return 0
    print(f"no lock at {key} (it expired just now)")
    return 1
