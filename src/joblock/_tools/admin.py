"""``joblock inspect``, ``joblock release`` and ``joblock web``: look at and clear locks by hand.

``read_page`` is what they share: the locks among at most N keys found by SCAN under
a prefix, on one server or every primary of a Redis Cluster, with their waiters, and
where the next page starts. ``inspect`` reads pages until the scan is done; the page
of ``joblock web`` (``web``) reads one per request.
"""

from __future__ import annotations

import dataclasses
import re
import time
from types import ModuleType
from typing import Any

from .._core import core
from .._engine.ops import Call
from .._engine.sync import Driver
from .._engine.topology import slot_ranges
from .._engine.waits import CLOCK_MARGIN, lost_message, parse_entry, queue_key
from .._scripts import MARK, RELEASE_SHA, TELL_SHA
from ..settings import Settings, parse_url

# A lock's value: 128-bit token in hex, then "@host:pid" of the holder (and, for a
# fenced lock or fenced holder of a counting lock, "#" and its fencing number; for a
# plain lock that waiters queue for, _scripts.MARK).
_VALUE = re.compile(
    rb"^[0-9a-f]{32}~?@(?P<host>.*):(?P<pid>\d+)(?:#(?P<fence>\d+))?(?:" + re.escape(MARK) + rb")?$"
)


class Node:
    """One server, for commands typed by hand: replies in order, error replies raised."""

    def __init__(self, settings: Settings, twin: ModuleType = core) -> None:
        self.settings = settings
        self.core = twin
        self._driver = Driver(twin, lambda _: settings)

    def call(self, *command: Any) -> Any:
        return self.calls([command])[0]

    def calls(self, commands: list[tuple[Any, ...]], errors_as_replies: bool = False) -> list[Any]:
        op = Call(
            None,
            self.core,
            commands,
            self.settings.retries,
            idempotent=True,
            errors_as_replies=errors_as_replies,
        )
        return self._driver.run(op)  # type: ignore[no-any-return]

    def release(self, key: bytes, token: bytes) -> int:
        """Releases the holder ``token`` of the lock at ``key`` as its own ``lease.release()``
        would, with joblock's release script (compare-and-delete, handing the lock to its
        first waiter): 1 released, 0 gone already, -1 held by someone else now. Not sent
        again after a lost reply: a second run could release the next holder's place."""
        op = Call(None, self.core, [(b"EVALSHA", RELEASE_SHA, 1, key, token)], 0, scripted=True)
        released = int(self._driver.run(op)[0])
        if released == 1:
            self.told(key, [token])
        return released

    def told(self, key: bytes, tokens: list[bytes], wake: bool = False) -> None:
        """Tells the holders of ``tokens`` their lock at ``key`` was released by an operator
        (a client hears it if it guards the lease: see joblock.lost); with ``wake``, the
        lock's first waiter looks again (deleted by hand, the lock was not handed over)."""
        notices = [lost_message(b"released", token) for token in tokens]
        tell = (b"EVALSHA", TELL_SHA, 1, key, b"1" if wake else b"0", *notices)
        self._driver.run(Call(None, self.core, [tell], self.settings.retries, scripted=True))

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
    """The version and, when INFO says, the binary: "Redis 7.0.15 (/usr/bin/redis-server)".

    Valkey answers redis_version:7.2.4 whatever its release, for clients that read it:
    its own version is valkey_version."""
    executable = info.get("executable")
    if "valkey_version" in info:
        name = f"Valkey {info['valkey_version']}"
    else:
        name = f"Redis {info.get('redis_version', '?')}"
    return name + (f" ({executable})" if executable else "")


def _describe(node: Node, keys: list[bytes]) -> list[Held]:
    """The locks among ``keys``: keys holding something else, or nothing, are left out."""
    commands = []
    for key in keys:
        commands += [(b"GET", key), (b"PTTL", key)]
    replies = iter(node.calls(commands, errors_as_replies=True))
    rows = []
    for key in keys:
        value, ms = next(replies), next(replies)
        match = _VALUE.match(value) if isinstance(value, bytes) else None
        if match is None or not isinstance(ms, int) or ms == -2:
            continue  # not a lock (a fence counter, or someone else's key), or gone
        holder = _holder(match)
        # PTTL -1: a lock without a ttl (compat.RedisLock with timeout=None), held
        # until released: the one most worth seeing here.
        left = ms / 1000 if ms >= 0 else None
        token = value.removesuffix(MARK).decode(errors="replace")
        fence = None if match["fence"] is None else int(match["fence"])  # a fenced lock holds its number
        rows.append(Held(key, token, holder, left, fence))
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


def describe(node: Node, keys: list[bytes]) -> list[Held]:
    """The locks among ``keys`` of either kind: a plain lock is a string, a counting or
    read-write lock a sorted set. TYPE first, so that no command meets a key of the
    other kind (an error reply, which Redis would count in INFO errorstats)."""
    kinds = node.calls([(b"TYPE", key) for key in keys], errors_as_replies=True) if keys else []
    strings = [key for key, kind in zip(keys, kinds) if kind == b"string"]
    sets = [key for key, kind in zip(keys, kinds) if kind == b"zset"]
    return (_describe(node, strings) if strings else []) + (_describe_counting(node, sets) if sets else [])


def _primaries(settings: Settings, twin: ModuleType = core) -> list[tuple[int, int, Settings]] | None:
    """The slot ranges of the cluster the server at ``settings`` belongs to; None when it is no cluster."""
    node = Node(settings, twin)
    try:
        if b"cluster_enabled:1" not in node.call("INFO", "cluster"):
            return None
        ranges = slot_ranges(node.call("CLUSTER", "SLOTS"), settings.host)
    finally:
        node.close()
    return [
        (first, last, dataclasses.replace(settings, host=h, port=p, db=0)) for first, last, (h, p) in ranges
    ]


class Servers:
    """Where the locks are: the server at ``settings``, or every primary of its Redis
    Cluster (a lock and its fence counter and waiters share a slot, so each primary
    describes its own locks). One ``Node`` each, on the ``twin`` core."""

    def __init__(self, settings: Settings, twin: ModuleType = core) -> None:
        self.ranges = _primaries(settings, twin)
        found = [settings] if self.ranges is None else [s for _, _, s in self.ranges]
        unique = {(s.host, s.port): s for s in found}
        self.nodes = [Node(s, twin) for s in unique.values()]
        self._index = {address: i for i, address in enumerate(unique)}

    def node_of(self, key: bytes) -> Node:
        """The server of ``key``: on a cluster, the primary of its hash slot."""
        if self.ranges is None:
            return self.nodes[0]
        slot = self.nodes[0].core.key_slot(key)
        server = next(s for first, last, s in self.ranges if first <= slot <= last)
        return self.nodes[self._index[server.host, server.port]]

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def scan_match(prefix: str, pattern: str) -> str:
    """SCAN's MATCH for ``pattern`` (a glob) after ``prefix``: the prefix's own glob
    characters are escaped, so that it means itself."""
    if not prefix:
        return pattern
    return re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + ":" + pattern


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where a page starts: a server (its index in ``Servers.nodes``), its SCAN cursor
    (b"": that server's scan is done), and keys its last SCAN reply gave beyond the page
    before, which come first."""

    server: int = 0
    scan: bytes = b"0"
    pending: tuple[bytes, ...] = ()


@dataclasses.dataclass
class Page:
    """The locks among the keys of one page, each key's waiters (first first), how many
    keys SCAN gave, and where the next page starts (None: the scan is done)."""

    rows: list[Held]
    waiters: dict[bytes, list[Waiter]]
    keys: int
    next: Cursor | None


def read_page(
    servers: Servers, match: str, size: int, start: Cursor = Cursor(), budget: float | None = None
) -> Page:
    """The locks among the next ``size`` keys at most that SCAN finds matching ``match``.

    Every SCAN asks for COUNT at most ``size`` (the keys still wanted), so that no call
    makes Redis walk more than that many slots of its table: Redis stays free for the
    jobs between the calls. A reply with more keys than the page has room for (a slot
    holds several keys now and then) leaves the rest to the next page's cursor. With a
    ``budget`` (seconds), a pattern that matches little stops scanning when it is spent
    (after one SCAN at least), with fewer keys: the next page goes on from there.
    """
    deadline = None if budget is None else time.monotonic() + budget
    server, scan, pending = start.server, start.scan, list(start.pending)
    found: dict[int, list[bytes]] = {}
    taken = scans = 0
    while server < len(servers.nodes):
        room = size - taken
        if pending and room > 0:
            found.setdefault(server, []).extend(pending[:room])
            taken += len(pending[:room])
            del pending[:room]
            continue
        if not pending and scan == b"":  # this server's scan is done
            server, scan = server + 1, b"0"
            continue
        if room <= 0 or (deadline is not None and scans and time.monotonic() >= deadline):
            break
        scan, keys = servers.nodes[server].call("SCAN", scan, "MATCH", match, "COUNT", room)
        scans += 1
        scan, pending = (b"" if scan == b"0" else scan), list(keys)
    rows: list[Held] = []
    waiters: dict[bytes, list[Waiter]] = {}
    for index, keys in found.items():
        node = servers.nodes[index]
        held = describe(node, keys)
        rows += held
        firsts = list(dict.fromkeys(row.key for row in held))
        waiters.update(zip(firsts, _waiters(node, firsts) if firsts else []))
    while server < len(servers.nodes) and not pending and scan == b"":
        server, scan = server + 1, b"0"  # so that a page that ends a scan says there is no next
    more = server < len(servers.nodes)
    return Page(rows, waiters, taken, Cursor(server, scan, tuple(pending)) if more else None)


def inspect(url: str, prefix: str, pattern: str, tokens: bool = False, queue: bool = False) -> int:
    """Prints the held locks under ``prefix`` matching ``pattern``; SCAN only, no KEYS.

    ``tokens`` adds a column with each lock's token, as text; ``queue`` lists each
    lock's waiters under it, in the order they are granted the lock.

    On a Redis Cluster node, every primary is scanned.
    """
    servers = Servers(parse_url(url))
    found = 0
    header = f"{'KEY':<48} {'HOLDER':<28} {'TTL':>9} {'FENCE':>7} {'WAITING':>7}"
    print(header + ("  TOKEN" if tokens else ""))
    try:
        cursor: Cursor | None = Cursor()
        while cursor is not None:
            page = read_page(servers, scan_match(prefix, pattern), 1000, cursor)
            found += len(page.rows)
            _show(page, tokens, queue)
            cursor = page.next
    finally:
        servers.close()
    print(f"{found} lock{'s' if found != 1 else ''} held")  # a counting lock's holders count one each
    return 0


def _show(page: Page, tokens: bool, queue: bool) -> None:
    """Prints locks and how many wait for each (with ``queue``, who, in order), each
    key's waiters with its first holder."""
    queues = dict(page.waiters)
    for held in page.rows:
        waiters = queues.pop(held.key, [])
        line = f"{held.shown():<48} {held.holder:<28} {held.ttl('s'):>9} {held.fence or '-':>7}"
        print(f"{line} {len(waiters) or '-':>7}" + (f"  {held.token}" if tokens else ""))
        for n, waiter in enumerate(waiters if queue else [], 1):
            print(f"  {n:>3}. {waiter.holder:<28} {waiter.kind:<9} waits {waiter.left:.1f}s more")


def release(url: str, key: str) -> int:
    """Deletes the lock at ``key`` whoever holds it, saying what it removed."""
    raw = core.as_key(key)
    servers = Servers(parse_url(url))
    try:
        node = servers.node_of(raw)  # on a Redis Cluster: the primary of the key's slot
        rows = describe(node, [raw])
        if not rows:
            print(f"no lock at {key}")
            return 1
        removed = node.call("DEL", raw)
        if removed:
            node.told(raw, [held.token.encode() for held in rows], wake=True)
    finally:
        servers.close()
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
