"""``ClusterLocks``: the same locks on a Redis Cluster.

Every key goes to the primary that serves its hash slot; a batch is split per
primary and each primary gets its own pipeline, with no barrier between them (see
``joblock._engine.topology`` for the routing and the redirections it follows).
``joblock.aio.AsyncClusterLocks`` is the same client for asyncio.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from . import errors
from ._client import ClientOptions, LocksBase, Plan
from ._engine.batches import Acquired, Replies, Settled, acquire_form, script_form
from ._engine.ops import EXTEND, RELEASE, Operation, Pause
from ._engine.sync import Driver
from ._engine.topology import ClusterRouter, OneKey, RefreshSlots, Topology, pause
from ._scripts import EXTEND_SHA, RELEASE_SHA, REMAINING_SHA
from .locks import Locks
from .settings import Settings, parse_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._core_py import Lease

__all__ = ["ClusterBase", "ClusterLocks"]

Addr = tuple[str, int]
# The replies after which a waiting acquire reads the slot map again and starts over.
_REDIRECTIONS = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")
# Of those, the ones that say "not now", after which it pauses first: a failover or a
# migration under way. ASK too: a waiter's queue and wake-ups live on one node, so a
# waiting acquire does not follow its key to the importing node; it waits for the slot
# to have moved (then MOVED sends it there).
_BUSY = ("ASK", "TRYAGAIN", "CLUSTERDOWN")
_SHAS = {RELEASE: RELEASE_SHA, EXTEND: EXTEND_SHA}


class ClusterBase(LocksBase):
    """What ClusterLocks and AsyncClusterLocks share: seeds, the slot map, routed operations."""

    def __init__(
        self,
        url: str | Sequence[str] = "redis://127.0.0.1:7000",
        *,
        max_redirects: int = 16,
        **options: Unpack[ClientOptions],
    ) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("url must name at least one node of the cluster")
        connection = cast("dict[str, Any]", options)  # less prefix and window, next
        keep = {k: connection.pop(k) for k in ("prefix", "window") if k in connection}
        super().__init__(urls[0], **keep, **connection)
        seeds = [parse_url(u, **connection) for u in urls]
        for s in seeds:
            if s.path is not None:
                raise ValueError("a Redis Cluster is reached over TCP: give redis:// or rediss:// URLs")
            if s.db:
                raise ValueError(f"a Redis Cluster has only database 0, not {s.db}")
        if isinstance(max_redirects, bool) or not isinstance(max_redirects, int) or max_redirects < 0:
            raise ValueError(f"max_redirects must be an int >= 0, not {max_redirects!r}")
        self._topology = Topology([(s.host, s.port) for s in seeds], self._core, self.settings.retries)
        self._router = ClusterRouter(self._topology, max_redirects)
        self._max_redirects = max_redirects
        # How many keys met each redirection or failure, for logs and tests.
        self.redirects = self._topology.redirects

    def _node_settings(self, addr: Addr) -> Settings:
        return dataclasses.replace(self.settings, host=addr[0], port=addr[1])

    def _nodes(self) -> list[str]:
        return [f"{h}:{p}" for h, p in self._topology.primaries()]

    # A waiting acquire queues on its key's primary and listens there (a PUBLISH reaches
    # every node, but PUBSUB NUMSUB, which tells live waiters, counts only its own).

    def _queue_target(self, raw: bytes) -> Addr | None:
        return self._topology.slots[self._core.key_slot(raw)] if self._topology.slots else None

    def _acquiring(
        self,
        key: str | bytes,
        ttl: object,
        wait: object,
        fence: bool,
        limit: object,
        fair: bool = False,
        shared: bool = False,
    ) -> Plan[Lease | None]:
        """The waiting acquire of ``LocksBase``, started afresh after a redirection."""
        rounds = 0
        while True:
            if not self._topology.slots:
                yield RefreshSlots(self._topology)
            try:
                return (yield from super()._acquiring(key, ttl, wait, fence, limit, fair, shared))
            except errors.ReplyError as e:
                code = e.message.split(" ", 1)[0]
                if code not in _REDIRECTIONS or rounds >= self._max_redirects:
                    raise
                self.redirects[code] += 1
                if code in _BUSY:  # starting over at once would spend every round in a moment
                    yield Pause(pause(rounds))
                rounds += 1
                yield RefreshSlots(self._topology)

    # Single calls are batches of one key, routed like any other.

    def _one(
        self, keys: list[bytes], values: list[bytes], names: Any, form: Any, collector: Any
    ) -> Operation:
        source = iter([(keys, values, names, 0)])
        return OneKey(source, form, collector, self._router, self.settings.retries, 1)

    def _one_acquire(
        self, raw: bytes, name: Any, value: bytes, ms: int, fence: bool, limit: int
    ) -> Operation:
        core = self._core
        form = acquire_form(core, ms, fence, limit)
        return self._one([raw], [value], [name], form, Acquired(self, core, fence, limit))

    def _one_script(self, kind: str, lease: Lease, arg: int | None) -> Operation:
        core = self._core
        if kind in _SHAS:
            collector: Settled | Replies = Settled(core, release=kind == RELEASE)
            form = script_form(core, _SHAS[kind], arg)
        else:
            collector, form = Replies(), script_form(core, REMAINING_SHA, None)
        return self._one([lease._key], [lease._value], [lease], form, collector)


class ClusterLocks(ClusterBase, Locks):
    """Locks on a Redis Cluster: ``ClusterLocks("redis://any-node:7000", prefix="joblock")``.

    ``url`` names any node of the cluster (or a list of URLs to try in turn); the
    others are found with CLUSTER SLOTS. Options are those of ``Locks`` (they apply
    to every node); ``max_redirects`` bounds the rounds of MOVED, ASK, TRYAGAIN,
    CLUSTERDOWN and failover retries of each key. The API is that of ``Locks``:
    single locks go to their key's primary, batches to every primary at once.
    Fencing counters share their lock's hash slot, so ``fence=True`` works too, and so
    do counting locks (``limit=N``).
    """

    def _make_driver(self) -> Driver:
        return Driver(self._core, self._node_settings, multi=True)

    def refresh(self) -> None:
        """Reads the slot map again from the first node that answers."""
        self._driver.run(RefreshSlots(self._topology))

    def nodes(self) -> list[str]:
        """The primaries serving slots, as ``host:port`` (reads the slot map first if needed)."""
        if not self._topology.slots:
            self.refresh()
        return self._nodes()
