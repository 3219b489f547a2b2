"""``ClusterLocks``: the same locks on a Redis Cluster.

Every key goes to the primary that serves its hash slot (CRC16 with hash tags,
computed in the core). A batch window is split per node; the parts go out to the
nodes at once (one thread each) and their replies are put back in the order of the
keys, so the Acquired/Settled bookkeeping of ``Locks`` runs unchanged. Each part is
sent with ``_windows.run``, so it keeps the single-server guarantees: NOSCRIPT
reloads, and a dropped connection retried in a form that recognises its own lock.

Redirections are per key: MOVED updates the slot's owner (and the whole map is read
again), ASK sends the key once to the importing node after ASKING, TRYAGAIN and
CLUSTERDOWN wait and try again; a node that cannot be reached makes the client
re-read the map (a replica may have been promoted) and send there, in the retry
form. All of it within ``max_redirects`` rounds.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import _windows, errors
from ._base import LocksBase
from .connection import Connection, Pool
from .locks import Locks
from .settings import Settings, parse_url

__all__ = ["ClusterLocks", "cluster_primaries"]

SLOTS = 16384
Addr = tuple[str, int]


def _host(raw: Any, fallback: str) -> str:
    host = raw.decode() if isinstance(raw, bytes) else str(raw)
    return host or fallback


def read_slots(conn: Connection) -> list[tuple[int, int, Addr]]:
    """CLUSTER SLOTS as (first slot, last slot, primary address) ranges."""
    ranges = []
    for entry in conn.call("CLUSTER", "SLOTS"):
        first, last, primary = entry[0], entry[1], entry[2]
        ranges.append((int(first), int(last), (_host(primary[0], conn.settings.host), int(primary[1]))))
    return ranges


def cluster_primaries(settings: Settings, core: Any) -> list[Addr] | None:
    """The primaries of the cluster the node at ``settings`` belongs to; None when it is no cluster."""
    conn = Connection(settings, core)
    try:
        info = conn.call("INFO", "cluster")
        if b"cluster_enabled:1" not in info:
            return None
        return sorted({addr for _, _, addr in read_slots(conn)})
    finally:
        conn.close()


def _subset(window: _windows.Window, idx: list[int]) -> _windows.Window:
    """The same commands for the keys at ``idx`` only."""
    keys = [window.keys[i] for i in idx]
    values = [window.values[i] for i in idx]
    if isinstance(window, _windows.AcquireWindow):
        return _windows.AcquireWindow(window.core, keys, values, None, window.start, window.ms, window.fenced)
    if isinstance(window, _windows.ScriptWindow):
        return _windows.ScriptWindow(
            window.core, window.sha, keys, values, window.start, window.arg, window.gone_is_done
        )
    raise TypeError(f"cannot route a {type(window).__name__}")


class ClusterLocks(Locks):
    """Locks on a Redis Cluster: ``ClusterLocks("redis://any-node:7000", prefix="joblock")``.

    ``url`` names any node of the cluster (or a list of URLs to try in turn); the
    others are found with CLUSTER SLOTS. Options are those of ``Locks`` (they apply
    to every node); ``max_redirects`` bounds the rounds of MOVED, ASK, TRYAGAIN,
    CLUSTERDOWN and failover retries of one window. The API is that of ``Locks``:
    single locks go to their key's primary, batches to every primary at once.
    Fencing counters share their lock's hash slot, so ``fence=True`` works too.
    """

    def __init__(
        self,
        url: str | Sequence[str] = "redis://127.0.0.1:7000",
        *,
        max_redirects: int = 16,
        max_workers: int = 16,
        **options: Any,
    ) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("url must name at least one node of the cluster")
        keep = {k: options[k] for k in ("prefix", "window") if k in options}
        settings_options = {k: v for k, v in options.items() if k not in keep}
        LocksBase.__init__(self, urls[0], **keep, **settings_options)
        seeds = [parse_url(u, **settings_options) for u in urls]
        for s in seeds:
            if s.path is not None:
                raise ValueError("a Redis Cluster is reached over TCP: give redis:// or rediss:// URLs")
            if s.db:
                raise ValueError(f"a Redis Cluster has only database 0, not {s.db}")
        if isinstance(max_redirects, bool) or not isinstance(max_redirects, int) or max_redirects < 0:
            raise ValueError(f"max_redirects must be an int >= 0, not {max_redirects!r}")
        self._seeds: list[Addr] = [(s.host, s.port) for s in seeds]
        self._max_redirects = max_redirects
        self._max_workers = max(1, int(max_workers))
        self._slots: list[Addr | None] = []
        self._pools: dict[Addr, Pool] = {}
        self._topology_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._executor_pid = -1
        # How many keys met each redirection or failure, for logs and tests.
        self.redirects: Counter[str] = Counter()

    # -- topology -----------------------------------------------------------------------

    def _node_settings(self, addr: Addr) -> Settings:
        return dataclasses.replace(self.settings, host=addr[0], port=addr[1])

    def _node_pool(self, addr: Addr) -> Pool:
        pool = self._pools.get(addr)
        if pool is None:
            with self._topology_lock:
                pool = self._pools.get(addr)
                if pool is None:
                    pool = self._pools[addr] = Pool(self._node_settings(addr), self._core)
        return pool

    def refresh(self) -> None:
        """Reads the slot map again from the first node that answers."""
        with self._topology_lock:
            known = [a for a in dict.fromkeys(self._slots) if a is not None]
        failure: Exception | None = None
        for addr in dict.fromkeys([*known, *self._seeds]):
            try:
                conn = Connection(self._node_settings(addr), self._core)
            except errors.AuthenticationError:
                raise
            except errors.ConnectionError as e:
                failure = e
                continue
            try:
                ranges = read_slots(conn)
            except (errors.ConnectionError, errors.ReplyError) as e:
                failure = e
                continue
            finally:
                conn.close()
            table: list[Addr | None] = [None] * SLOTS
            for first, last, owner in ranges:
                table[first : last + 1] = [owner] * (last - first + 1)
            with self._topology_lock:
                self._slots = table
                owners = set(table)
                gone = [a for a in self._pools if a not in owners]
                dropped = [self._pools.pop(a) for a in gone]
            for pool in dropped:
                pool.close()
            return
        error = errors.ConnectionError(f"no node of the Redis Cluster answered CLUSTER SLOTS: {failure}")
        raise error from failure

    def _table(self) -> list[Addr | None]:
        if not self._slots:
            self.refresh()
        return self._slots

    def nodes(self) -> list[str]:
        """The primaries serving slots, as ``host:port`` (reads the slot map first if needed)."""
        return [f"{h}:{p}" for h, p in sorted({a for a in self._table() if a is not None})]

    def _moved(self, slot: int, addr: Addr) -> None:
        with self._topology_lock:
            if self._slots:
                self._slots[slot] = addr

    # -- sending ------------------------------------------------------------------------

    def _map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """``fn`` over ``items`` at once; each result, or the exception it raised."""

        def guarded(item: Any) -> Any:
            try:
                return fn(item)
            except Exception as e:
                return e

        if len(items) == 1:
            return [guarded(items[0])]
        pid = os.getpid()
        with self._topology_lock:
            if self._executor is None or self._executor_pid != pid:
                # A forked child has none of its parent's threads.
                self._executor = ThreadPoolExecutor(self._max_workers, thread_name_prefix="joblock-cluster")
                self._executor_pid = pid
            executor = self._executor
        return list(executor.map(guarded, items))

    def _send(self, addr: Addr, window: _windows.Window, asking: bool) -> list[Any]:
        """One window to one node: a reply per key (error replies as ReplyError objects)."""
        pool = self._node_pool(addr)
        if asking:
            return self._send_asking(pool, window)
        got: list[list[Any]] = []

        def collect(_: _windows.Window, replies: list[Any]) -> bool:
            got.append(replies)
            return True

        _windows.run(pool, (window,), collect)
        return got[0]

    def _send_asking(self, pool: Pool, window: _windows.Window) -> list[Any]:
        # ASKING opens the importing node to the next command only: one before each.
        core = self._core
        asking = core.encode_command((b"ASKING",))
        plain_acquire = isinstance(window, _windows.AcquireWindow) and not window.fenced

        def commands(i: int) -> list[bytes]:
            key, value = window.keys[i], window.values[i]
            if window.retried and plain_acquire:
                assert isinstance(window, _windows.AcquireWindow)
                return [
                    core.encode_acquire([key], [value], window.ms, None),
                    core.encode_command((b"GET", key)),
                ]
            return [window.encode([key], [value])]

        def send(conn: Connection, positions: list[int]) -> list[Any]:
            flat = [c for i in positions for c in commands(i)]
            conn.send(b"".join(asking + c for c in flat))
            return conn.read(2 * len(flat))[1::2]

        conn = pool.get()
        try:
            replies = window.merge(send(conn, list(range(len(window.keys)))))
            hit = core.error_positions(replies, "NOSCRIPT") if window.scripted else None
            if hit:
                conn.load_scripts()
                for i, reply in zip(hit, window.merge(send(conn, hit))):
                    replies[i] = reply
        except BaseException:
            conn.close()
            raise
        pool.put(conn)
        return replies

    def _execute(self, window: _windows.Window) -> tuple[list[Any], errors.ConnectionError | None]:
        """Each key's reply, in order, after redirections; and a connection failure that remained."""
        keys = window.keys
        slots = self._core.key_slots(keys)
        out: list[Any] = [None] * len(keys)
        todo = list(range(len(keys)))
        ask: dict[int, Addr] = {}
        uncertain: set[int] = set()  # sent to a node that failed: maybe carried out
        pauses = 0
        failure: errors.ConnectionError | None = None
        for attempt in range(self._max_redirects + 1):
            table = self._table()
            groups: dict[tuple[Addr | None, bool, bool], list[int]] = {}
            for i in todo:
                target = ask.get(i)
                group = (target, True, i in uncertain) if target else (table[slots[i]], False, i in uncertain)
                groups.setdefault(group, []).append(i)
            parts = list(groups.items())

            def send(part: tuple[tuple[Addr | None, bool, bool], list[int]]) -> list[Any]:
                (addr, asking, retry), idx = part
                if addr is None:
                    raise errors.ConnectionError(f"hash slot {slots[idx[0]]} is served by no node")
                sub = (
                    window
                    if len(idx) == len(keys) and not retry and not window.retried
                    else _subset(window, idx)
                )
                if retry and not sub.retried:
                    sub.retry()
                return self._send(addr, sub, asking)

            results = self._map(send, parts)
            todo, ask = [], {}
            pause = refresh = False
            failure = None
            lost: list[int] = []
            for ((addr, _, _), idx), result in zip(parts, results):
                if isinstance(result, errors.ConnectionError) and not isinstance(
                    result, errors.AuthenticationError
                ):
                    todo += idx
                    lost += idx
                    self.redirects["unreachable"] += len(idx)
                    if addr is not None:
                        uncertain.update(idx)
                    failure = result
                    pause = refresh = True
                    continue
                if isinstance(result, BaseException):
                    raise result
                for i, reply in zip(idx, result):
                    out[i] = reply
                    if type(reply) is not errors.ReplyError:
                        continue
                    code, _, rest = reply.message.partition(" ")
                    if code in ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"):
                        self.redirects[code] += 1
                    if code in ("MOVED", "ASK"):
                        slot, _, where = rest.partition(" ")
                        host, _, port = where.rpartition(":")
                        target = (host or (addr[0] if addr else self.settings.host), int(port))
                        if code == "MOVED":
                            self._moved(int(slot), target)
                            refresh = True
                        else:
                            ask[i] = target
                        todo.append(i)
                    elif code in ("TRYAGAIN", "CLUSTERDOWN"):
                        todo.append(i)
                        pause = True
                        refresh = refresh or code == "CLUSTERDOWN"
            if not todo:
                return out, None
            if attempt == self._max_redirects:
                break
            if pause:
                time.sleep(min(0.02 * 2**pauses, 0.5))
                pauses += 1
            if refresh:
                try:
                    self.refresh()
                except errors.ConnectionError as e:
                    failure = e
        # Out of rounds: redirect errors stay as the keys' replies; failed nodes leave
        # their keys undecided.
        for i in lost:
            out[i] = None
        return out, failure if lost else None

    def _run(self, windows: Iterable[_windows.Window], handle: _windows.Handle) -> None:
        for window in windows:
            out, failure = self._execute(window)
            go_on = handle(window, out)
            if failure is not None:
                raise failure
            if not go_on:
                return

    def close(self) -> None:
        """Closes idle connections and worker threads; the ClusterLocks stays usable."""
        with self._topology_lock:
            pools = list(self._pools.values())
            executor, self._executor = self._executor, None
        for pool in pools:
            pool.close()
        if executor is not None:
            executor.shutdown(wait=False)
