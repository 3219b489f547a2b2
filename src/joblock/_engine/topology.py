"""Redis Cluster routing without I/O: the slot map, and where each key of a batch goes.

Every key goes to the primary serving its hash slot (CRC16 with hash tags, computed
in the core). A batch's windows are split per primary in the caller's thread or task,
and each primary gets its own pipeline (two windows in flight, as on one server): a
slow node delays its own keys, not the others'.

Redirections are per key, within ``max_redirects`` rounds each: MOVED updates the
slot's owner (and the whole map is read again in the background), ASK sends the key
once to the importing node after ASKING, TRYAGAIN and CLUSTERDOWN wait and try
again. A node that cannot be reached, or whose connection broke, makes the batch
wait, read the map again (a replica may have been promoted) and send the key there
in its retry form, which recognises a lock its lost reply had granted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

from .. import errors
from .batches import Batch, Chunk, Form, Replies, Router, Settled
from .ops import Operation
from .requests import Asking, Commands, Request, Window

__all__ = ["SLOTS", "ClusterRouter", "OneKey", "RefreshSlots", "Topology"]

SLOTS = 16384
Addr = tuple[str, int]

# A window routed before the slot map was read: it is split once the map is there.
UNROUTED = ("", -1)


def pause(rounds: int) -> float:
    """The wait before sending redirected or orphaned keys again: 20 ms doubling to 0.5 s."""
    return float(min(0.02 * 2**rounds, 0.5))


def _host(raw: Any, fallback: str) -> str:
    host = raw.decode() if isinstance(raw, bytes) else str(raw)
    return host or fallback


def slot_ranges(reply: list[Any], fallback_host: str) -> list[tuple[int, int, Addr]]:
    """CLUSTER SLOTS as (first slot, last slot, primary address) ranges."""
    return [
        (int(first), int(last), (_host(primary[0], fallback_host), int(primary[1])))
        for first, last, primary, *_ in reply
    ]


class Topology:
    """A Redis Cluster's slot map as the client last read it, and who asked to read it again."""

    def __init__(self, seeds: list[Addr], core: ModuleType, retries: int) -> None:
        self.seeds = seeds
        self.core = core
        self.retries = retries
        self.slots: list[Addr | None] = []
        self.primaries_count = 0
        self._waiting: list[Callable[[errors.JoblockError | None], None]] | None = None
        # How many keys met each redirection or failure, for logs and tests.
        self.redirects: Counter[str] = Counter()

    def primaries(self) -> list[Addr]:
        return sorted({a for a in self.slots if a is not None})

    def moved(self, slot: int, addr: Addr) -> None:
        if self.slots:
            self.slots[slot] = addr

    def refresh(self, engine: Any, then: Callable[[errors.JoblockError | None], None] | None = None) -> None:
        """Reads the map again in the background (once, however many ask); ``then`` hears the outcome."""
        if self._waiting is not None:
            if then is not None:
                self._waiting.append(then)
            return
        self._waiting = [] if then is None else [then]
        engine.spawn(RefreshSlots(self))

    def refreshed(self, table: list[Addr | None] | None, error: errors.JoblockError | None) -> None:
        if table is not None:
            self.slots = table
            self.primaries_count = len(set(table) - {None})
        waiting, self._waiting = self._waiting or [], None
        for then in waiting:
            then(error)


class RefreshSlots(Operation):
    """CLUSTER SLOTS from the first node that answers: the known primaries, then the seeds."""

    __slots__ = ("failure", "todo", "topology")

    def __init__(self, topology: Topology) -> None:
        super().__init__(0)
        self.topology = topology
        self.todo = list(dict.fromkeys([*topology.primaries(), *topology.seeds]))
        self.failure: errors.JoblockError | None = None

    def start(self) -> None:
        self.next()

    def next(self) -> None:
        if not self.todo:
            error = errors.ConnectionError(
                f"no node of the Redis Cluster answered CLUSTER SLOTS: {self.failure}"
            )
            error.__cause__ = self.failure
            self.topology.refreshed(None, error)
            self.fail(error)
            return
        addr = self.todo.pop(0)
        self.engine.send(Commands(self, addr, self.topology.core, [("CLUSTER", "SLOTS")]))

    def answer(self, request: Request, replies: list[Any]) -> None:
        reply = replies[0]
        if isinstance(reply, errors.ReplyError):
            self.failure = errors.reply_error(reply.message, command="CLUSTER SLOTS")
            self.next()
            return
        table: list[Addr | None] = [None] * SLOTS
        for first, last, owner in slot_ranges(reply, request.target[0]):
            table[first : last + 1] = [owner] * (last - first + 1)
        self.topology.refreshed(table, None)
        self.finish(table)

    def lost(self, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool) -> None:
        if isinstance(error, errors.AuthenticationError):
            self.topology.refreshed(None, error)
            self.fail(error)
            return
        self.failure = error
        self.next()


class ClusterRouter(Router):
    """Routes a batch's keys to the primaries of their slots and follows redirections."""

    def __init__(self, topology: Topology, max_redirects: int) -> None:
        self.topology = topology
        self.core = topology.core
        self.max_redirects = max_redirects

    def lookahead(self, window_size: int) -> int:
        # Keys built ahead for every primary, so one slow node does not idle the others.
        return window_size * max(1, self.topology.primaries_count)

    def split(self, chunk: Chunk, form: Form) -> list[Window]:
        keys, values, names, where = chunk
        table = self.topology.slots
        if not table:
            return [form(UNROUTED, keys, values, names, where, False)]
        return self._split(keys, values, names, where, form, False)

    def _split(
        self, keys: list[bytes], values: list[bytes], names: Any, where: Any, form: Form, retry: bool
    ) -> list[Window]:
        table = self.topology.slots
        groups: dict[Addr | None, list[int]] = {}
        for i, slot in enumerate(self.core.key_slots(keys)):
            groups.setdefault(table[slot], []).append(i)
        if len(groups) == 1:
            return [form(next(iter(groups)), keys, values, names, where, retry)]
        positions = list(range(where, where + len(keys))) if type(where) is int else where
        return [
            form(
                addr,
                [keys[i] for i in idx],
                [values[i] for i in idx],
                None if names is None else [names[i] for i in idx],
                [positions[i] for i in idx],
                retry,
            )
            for addr, idx in groups.items()
        ]

    def _resplit(self, batch: Batch, window: Window) -> None:
        """Sends ``window``'s keys again, to whoever serves their slots now."""
        if not self.topology.slots:
            batch.timers += 1
            batch.parked_keys += len(window.keys)
            self.topology.refresh(batch.engine, lambda error: self._after_refresh(batch, [window], error))
            return
        parts = self._split(
            window.keys, window.values, window.names, window.where, batch.form, window.retry_form
        )
        for part in map(window.part, parts):  # a retried grant may date from the first send
            if part.target is None:
                self._orphaned(batch, [part], errors.ConnectionError("no node serves this key's hash slot"))
            else:
                batch.queue(part)

    def _after_refresh(self, batch: Batch, windows: list[Window], error: errors.JoblockError | None) -> None:
        batch.timers -= 1
        batch.parked_keys -= sum(len(window.keys) for window in windows)
        if batch.done:
            return
        if error is not None and not self.topology.slots:
            batch.collector.broke(error)
            batch.stopped = True
        else:
            for window in windows:
                self._resplit(batch, window)
        batch.pump()

    def arrive(self, batch: Batch, windows: list[Window]) -> None:
        for window in windows:
            if window.target == UNROUTED or window.target is None:
                self._resplit(batch, window)
            else:
                batch.queue(window)

    def _count(self, batch: Batch, window: Window, idx: list[int]) -> tuple[list[int], list[int]]:
        """Splits ``idx`` into the keys with rounds left (counting this one) and those without."""
        rounds = batch.rounds
        positions = window.positions()
        more, done = [], []
        for i in idx:
            p = positions[i]
            n = rounds.get(p, 0)
            if n < self.max_redirects:
                rounds[p] = n + 1
                more.append(i)
            else:
                done.append(i)
        return more, done

    def answered(self, batch: Batch, request: Request, replies: list[Any]) -> None:
        window = request.inner if isinstance(request, Asking) else cast(Window, request)
        moved: dict[Addr, list[int]] = {}
        asked: dict[Addr, list[int]] = {}
        again: list[int] = []
        final: list[int] = []
        refresh = False
        redirects = self.topology.redirects
        for i, reply in enumerate(replies):
            if type(reply) is not errors.ReplyError:
                final.append(i)
                continue
            code, _, rest = reply.message.partition(" ")
            if code not in ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"):
                final.append(i)
                continue
            redirects[code] += 1
            if code in ("MOVED", "ASK"):
                slot, _, where = rest.partition(" ")
                host, _, port = where.rpartition(":")
                addr = (host or window.target[0], int(port))
                if code == "MOVED":
                    self.topology.moved(int(slot), addr)
                    refresh = True
                    moved.setdefault(addr, []).append(i)
                else:
                    asked.setdefault(addr, []).append(i)
            else:
                again.append(i)
                refresh = refresh or code == "CLUSTERDOWN"
        if len(final) == len(replies):
            batch.collect(window, replies)
            return
        retry = window.retry_form
        for groups, wrap in ((moved, False), (asked, True)):
            for addr, idx in groups.items():
                idx, out_of_rounds = self._count(batch, window, idx)
                final += self._spent(batch, out_of_rounds)
                if idx:
                    part = window.subset(idx, addr, retry)
                    batch.queue(Asking(part) if wrap else part)
        if again:
            idx, out_of_rounds = self._count(batch, window, again)
            final += self._spent(batch, out_of_rounds)
            if idx:
                part = window.subset(idx, window.target, retry)
                batch.parked_keys += len(idx)

                def again_later() -> None:
                    batch.parked_keys -= len(part.keys)
                    self._resplit(batch, part)

                batch.later(pause(batch.pauses), again_later)
                batch.pauses += 1
        if final:
            final.sort()
            batch.collect(window.subset(final, window.target, retry), [replies[i] for i in final])
        if refresh:
            self.topology.refresh(batch.engine)

    @staticmethod
    def _spent(batch: Batch, idx: list[int]) -> list[int]:
        """Keys out of rounds on a redirection: their reply is final, unless a node of the
        batch was lost meanwhile. The cluster is then failing over (nodes still redirect
        to the lost primary, or already to its replica), and that is what the caller
        hears: the node's ConnectionError, not the last redirection."""
        if idx and batch.unreachable is not None:
            batch.collector.broke(batch.unreachable)
            return []
        return idx

    def lost(
        self, batch: Batch, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool
    ) -> None:
        if not isinstance(error, errors.ConnectionError):
            batch.collector.passthrough = batch.collector.passthrough or error
            batch.stopped = True
            return
        if isinstance(error, errors.AuthenticationError):
            batch.collector.broke(error)
            batch.stopped = True
            return
        parts = []
        for request, sent in requests:
            window = request.inner if isinstance(request, Asking) else cast(Window, request)
            # Sent to a node that failed: maybe carried out, so asked again in the retry form.
            parts.append(window.subset(list(range(len(window.keys))), None, window.retry_form or sent))
        self._orphaned(batch, parts, error)

    def _orphaned(self, batch: Batch, windows: list[Window], error: errors.JoblockError) -> None:
        """Keys whose node is gone: after a pause and a fresh map, to their new node."""
        batch.unreachable = error
        keep = []
        for window in windows:
            self.topology.redirects["unreachable"] += len(window.keys)
            idx, out_of_rounds = self._count(batch, window, list(range(len(window.keys))))
            if out_of_rounds:
                batch.collector.broke(error)  # their outcome stays undecided
            if idx:
                keep.append(window.subset(idx, None, window.retry_form) if out_of_rounds else window)
        if not keep:
            return

        batch.parked_keys += sum(len(window.keys) for window in keep)

        def refresh() -> None:
            batch.timers += 1  # until the map is read again
            self.topology.refresh(batch.engine, lambda e: self._after_refresh(batch, keep, e))

        batch.later(pause(batch.pauses), refresh)
        batch.pauses += 1


class OneKey(Batch):
    """A batch of one key whose outcome is that key's: a Redis Cluster client's single calls.

    The lease (acquire), the verdict (release, extend) or the seconds left
    (remaining); an error is raised as it is, not as a BatchError.
    """

    __slots__ = ()

    together = False  # one window: its WAIT goes in the same write

    def finish(self, result: Any = None) -> None:
        collector = self.collector
        failure = collector.passthrough or collector.failure
        if failure is not None:
            Operation.fail(self, failure)
            return
        out = collector.out
        value = out[0] if out else None
        if isinstance(collector, Settled):
            value = value is True
        elif isinstance(collector, Replies):
            value = value / 1000 if type(value) is int and value >= 0 else None
        Operation.finish(self, value)
