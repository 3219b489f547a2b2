"""Batches: many keys in pipelined windows, two in flight per server, results in order.

The caller's iterable is read a window at a time in the caller's own thread or task
(``produce``), so a generator of millions of keys is never all in memory and user
code never runs inside a driver. A ``Router`` says which server each key goes to:
one server here, the nodes of a Redis Cluster in ``topology``. The next window to a
server is written before the previous one is answered, so Redis always has work.

What a batch's replies mean is the collector's business: ``Acquired`` turns acquire
replies into leases, ``Settled`` release and extend replies into verdicts written on
the leases. A failure stops the batch from sending more, but the windows in flight
are still read and collected, so the caller learns of every lock it was granted.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from time import monotonic
from types import ModuleType
from typing import Any, cast

from .. import errors, metrics
from .._scripts import RELEASE_SHA
from .ops import Operation, fenced_members, sure_until
from .replicas import Replicas, confirm
from .requests import AcquireWindow, Asking, Request, ScriptWindow, Target, Window

__all__ = [
    "Acquired", "Batch", "Chunk", "Replies", "Router", "Settled", "acquire_chunks", "acquire_form", "chunks",
    "dedupe_chunks", "iterate", "lease_chunks", "release_batch", "script_form",
]  # fmt: skip

# keys, their lock values, what to call the keys (the caller's keys, or the leases of a
# release), and where they sit in the batch.
Chunk = tuple[list[bytes], list[bytes], list[Any] | None, "int | list[int]"]
# Builds a window of a batch's form: (target, keys, values, names, where, retry_form).
Form = Callable[[Target, list[bytes], list[bytes], "list[Any] | None", "int | list[int]", bool], Window]

logger = logging.getLogger("joblock")

# Windows in flight per server at once: the next is written while the last is answered.
DEPTH = 2


def iterate(items: Any, name: str, what: str) -> Iterator[Any]:
    """An iterator over a batch argument, refusing what is not a batch with its name.

    A single str or bytes is refused too: iterating it would lock its characters.
    """
    if isinstance(items, (str, bytes)):
        raise TypeError(f"{name} must be an iterable of {what}, not a single {type(items).__name__}")
    try:
        return iter(items)
    except TypeError:
        raise TypeError(f"{name} must be an iterable of {what}, not {type(items).__name__}") from None


def chunks(items: Iterator[Any], size: int) -> Iterator[tuple[int, list[Any]]]:
    """``items`` in lists of ``size``, each with the position of its first item."""
    start = 0
    while chunk := list(itertools.islice(items, size)):
        yield start, chunk
        start += len(chunk)


def acquire_chunks(
    core: ModuleType, keys: Iterable[Any], size: int, fenced: bool, holder: bytes
) -> Iterator[Chunk]:
    """The chunks of ``acquire_many``: keys checked as each chunk is built, fresh tokens."""
    for start, chunk in chunks(iterate(keys, "keys", "str or bytes keys"), size):
        raw = core.as_keys(chunk, start)
        if fenced:
            for key in raw:
                core.fence_key(key)
        yield raw, core.new_values(len(raw), holder), chunk, start


def dedupe_chunks(
    core: ModuleType, prefix: bytes, job: str, arg_tuples: Iterable[Any], size: int, holder: bytes
) -> Iterator[Chunk]:
    """The chunks of ``dedupe``: one key per argument tuple, built in the core."""
    core.build_keys(prefix, job, [], 0)  # checks job before anything is sent
    for start, chunk in chunks(iterate(arg_tuples, "arg_tuples", "argument tuples"), size):
        raw = core.build_keys(prefix, job, chunk, start)
        yield raw, core.new_values(len(raw), holder), None, start


def lease_chunks(core: ModuleType, leases: Iterable[Any], size: int, settled: Settled) -> Iterator[Chunk]:
    """The chunks of a release or extend batch: the held leases among ``leases``."""
    for start, chunk in chunks(iterate(leases, "leases", "leases"), size):
        idx, keys, values = core.lease_fields(chunk, start)
        settled.total = start + len(chunk)
        if idx:
            yield keys, values, [chunk[i] for i in idx], [start + i for i in idx]


def acquire_form(core: ModuleType, ms: int, fenced: bool, limit: int) -> Form:
    def make(
        target: Target, keys: list[bytes], values: list[bytes], names: Any, where: Any, retry: bool
    ) -> Window:
        return AcquireWindow(None, target, core, keys, values, names, where, ms, fenced, limit, retry)

    return make


def script_form(core: ModuleType, sha: bytes, arg: int | None) -> Form:
    release = sha == RELEASE_SHA

    def make(
        target: Target, keys: list[bytes], values: list[bytes], names: Any, where: Any, retry: bool
    ) -> Window:
        return ScriptWindow(None, target, core, sha, keys, values, names, where, arg, release, retry)

    return make


def _place(out: list[Any], where: int | list[int], items: list[Any]) -> None:
    if isinstance(where, int):
        end = where + len(items)
        if len(out) < end:
            out.extend([None] * (end - len(out)))
        out[where:end] = items
        return
    top = max(where) + 1
    if len(out) < top:
        out.extend([None] * (top - len(out)))
    for i, item in zip(where, items):
        out[i] = item


class Acquired:
    """An acquire batch's leases, in order, and the first failure that stopped it."""

    __slots__ = ("command", "core", "failure", "members", "out", "owner", "passthrough")

    def __init__(self, owner: Any, core: ModuleType, fenced: bool, limit: int) -> None:
        self.owner = owner
        self.core = core
        self.command = "EVALSHA" if fenced or limit > 1 else "SET"
        self.members = fenced
        self.out: list[Any] = []
        self.failure: errors.JoblockError | None = None
        # Raised as it is once the grants went back: bad input met mid-batch, a peer that
        # is not Redis.
        self.passthrough: Exception | None = None

    def take(self, window: Window, replies: list[Any]) -> bool:
        deadline = sure_until(window.sent, cast(AcquireWindow, window).ms)
        leases, failed = self.core.make_leases(
            self.owner, window.keys, window.names, window.values, replies, deadline
        )
        if self.members:
            fenced_members(leases)
        if failed:
            i, first = next((i, r) for i, r in enumerate(leases) if isinstance(r, errors.ReplyError))
            if self.failure is None:
                self.failure = errors.reply_error(first.message, command=self.command, key=window.keys[i])
            leases = [None if isinstance(r, errors.ReplyError) else r for r in leases]
        _place(self.out, window.where, leases)
        return not failed

    def broke(self, error: errors.JoblockError) -> None:
        if self.failure is None:
            self.failure = error

    def granted(self) -> list[Any]:
        return [lease for lease in self.out if lease is not None]

    def error(self, unreleased: int) -> errors.BatchError:
        """The BatchError to raise once the granted locks went back (``unreleased`` did not)."""
        cause = self.failure
        granted = len(self.granted())
        undecided = ""
        kind = errors.BatchError
        if isinstance(cause, errors.ConnectionError):
            undecided = "; any lock in flight when the connection failed expires at its ttl"
            kind = errors.BatchConnectionError
        error = kind(
            f"batch acquire failed: {cause}. {granted} locks had been granted: "
            f"{granted - unreleased} released, {unreleased} not{undecided}",
            granted=granted,
            unreleased=unreleased,
        )
        error.__cause__ = cause
        return error


class Settled:
    """A release or extend batch's verdicts, in order (False for None and unheld leases)."""

    __slots__ = ("core", "failure", "out", "passthrough", "release", "total")

    def __init__(self, core: ModuleType, release: bool) -> None:
        self.core = core
        self.release = release
        self.out: list[Any] = []
        self.total = 0
        self.failure: errors.JoblockError | None = None
        self.passthrough: Exception | None = None

    def take(self, window: Window, replies: list[Any]) -> bool:
        leases = window.names or []
        if metrics.recorder is not None:
            metrics.recorder.verdicts(self.release, leases, replies)
        verdicts: list[Any] = [False] * len(leases)
        deadline = sure_until(window.sent, cast(ScriptWindow, window).arg or 0)
        failed = self.core.settle(leases, list(range(len(leases))), replies, verdicts, self.release, deadline)
        if failed:
            i, first = next((i, r) for i, r in enumerate(verdicts) if isinstance(r, errors.ReplyError))
            if self.failure is None:
                self.failure = errors.reply_error(first.message, command="EVALSHA", key=window.keys[i])
            verdicts = [v is True for v in verdicts]
        _place(self.out, window.where, verdicts)
        return not failed

    def broke(self, error: errors.JoblockError) -> None:
        if self.failure is None:
            self.failure = error

    def result(self) -> list[bool]:
        if self.passthrough is not None:
            raise self.passthrough
        if self.failure is not None:
            raise self.failure
        out = self.out
        if len(out) < self.total:
            out.extend([False] * (self.total - len(out)))
        return [v is True for v in out]


class Replies:
    """The replies of a script batch as they are (``remaining``'s milliseconds)."""

    __slots__ = ("failure", "out", "passthrough")

    def __init__(self) -> None:
        self.out: list[Any] = []
        self.failure: errors.JoblockError | None = None
        self.passthrough: Exception | None = None

    def take(self, window: Window, replies: list[Any]) -> bool:
        for key, reply in zip(window.keys, replies):
            if isinstance(reply, errors.ReplyError):
                if self.failure is None:
                    self.failure = errors.reply_error(reply.message, command="EVALSHA", key=key)
                return False
        _place(self.out, window.where, replies)
        return True

    def broke(self, error: errors.JoblockError) -> None:
        if self.failure is None:
            self.failure = error


class Router:
    """Where a batch's keys go: here, all to one server."""

    # How many keys may wait, built, for a server with its windows in flight.
    def lookahead(self, window_size: int) -> int:
        return window_size

    def split(self, chunk: Chunk, form: Form) -> list[Window]:
        """Runs in the caller's thread or task: the windows of ``chunk``."""
        keys, values, names, where = chunk
        return [form(None, keys, values, names, where, False)]

    def arrive(self, batch: Batch, windows: list[Window]) -> None:
        """Queues the windows ``split`` made (on the driver's side)."""
        for window in windows:
            batch.queue(window)

    def answered(self, batch: Batch, request: Request, replies: list[Any]) -> None:
        batch.collect(cast(Window, request), replies)

    def lost(
        self, batch: Batch, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool
    ) -> None:
        if batch.may_retry(error, retryable):
            for request, sent in requests:
                batch.queue(cast(Window, request.retried() if sent else request), front=True)
            return
        if isinstance(error, errors.ConnectionError):
            batch.collector.broke(error)
        elif batch.collector.passthrough is None:
            batch.collector.passthrough = error
        batch.stopped = True


class Batch(Operation):
    """Windows of one form (acquire, or a script) over many keys, collected in order."""

    __slots__ = (
        "collector", "form", "give_back", "inflight", "more", "parked_keys", "pauses", "queued_keys",
        "queues", "rounds", "router", "source", "stopped", "timers", "unconfirmed", "unreachable",
        "window_size",
    )  # fmt: skip

    # min_replicas: the leases are handed out together at the end, so one WAIT per server
    # behind the windows confirms them all (see replicas.py); a Cluster's single calls: no.
    together = True

    def __init__(
        self,
        source: Iterator[Chunk],
        form: Form,
        collector: Acquired | Settled | Replies,
        router: Router,
        retries: int,
        window_size: int,
    ) -> None:
        super().__init__(retries)
        self.source = source
        self.form = form
        self.collector = collector
        self.router = router
        self.window_size = window_size
        self.queues: dict[Target, deque[Window | Asking]] = {}
        self.inflight: dict[Target, int] = {}
        self.queued_keys = 0
        self.parked_keys = 0  # redirected or orphaned keys waiting for a pause or a slot map
        self.more = True  # the source may have more
        self.stopped = False  # a failure (or an abandoned caller): send no more
        self.timers = 0  # redirected keys waiting to be sent again
        # For routers that redirect keys: the rounds each key has been sent in (by its
        # position), and how many pauses the batch has made.
        self.rounds: dict[int, int] = {}
        self.pauses = 0
        self.unreachable: errors.JoblockError | None = None  # the last node lost meanwhile
        # Leases to release should the caller stop waiting for this batch (min_replicas:
        # the grants an extend batch is confirming).
        self.give_back: list[Any] = []
        # min_replicas: when the first window since the last WAIT asked for went to each server.
        self.unconfirmed: dict[Target, float] = {}

    def start(self) -> None:
        self.pump()

    def produce(self) -> Any:
        try:
            chunk = next(self.source, None)
        except Exception as e:  # bad input mid-batch: the windows sent so far are read first
            return e
        return None if chunk is None else self.router.split(chunk, self.form)

    def consume(self, item: Any) -> None:
        self.wants_input = False
        if self.done:
            return
        if item is None or self.stopped:
            self.more = False
        elif isinstance(item, Exception):
            self.collector.passthrough = item
            self.more = False
        else:
            self.router.arrive(self, item)
        self.pump()

    def queue(self, window: Window | Asking, front: bool = False) -> None:
        window.op = self
        queue = self.queues.get(window.target)
        if queue is None:
            queue = self.queues[window.target] = deque()
            self.inflight[window.target] = 0
        if front:
            queue.appendleft(window)
        else:
            queue.append(window)
        self.queued_keys += len(window.keys)

    def pump(self) -> None:
        """Sends what there is room for; asks the caller for more; finishes when all is done."""
        if self.done:
            return
        inflight = self.inflight
        replicas = self.replicas
        confirming = replicas is not None and replicas.batched
        if confirming and cast(Replicas, replicas).short:  # too few replicas: it fails anyway
            self.stopped = True
        busy = False
        for target, queue in self.queues.items():
            if self.stopped:  # what waits unsent stays unsent
                self.queued_keys -= sum(len(window.keys) for window in queue)
                queue.clear()
            while queue and inflight[target] < DEPTH:
                window = queue.popleft()
                self.queued_keys -= len(window.keys)
                inflight[target] += 1
                self.engine.send(window)
                if confirming and target not in self.unconfirmed:
                    self.unconfirmed[target] = monotonic()
            if confirming and not self.stopped and target in self.unconfirmed:
                self._confirm(target, last=not queue and not self.more)
            busy = busy or bool(queue) or inflight[target] > 0
        if self.more and not self.stopped:
            ahead = self.queued_keys + self.parked_keys
            if not self.wants_input and ahead < self.router.lookahead(self.window_size):
                self.wants_input = True
                self.engine.wake(self)
            return
        if not busy and not self.timers:
            self.finish(self.collector)

    def _confirm(self, target: Target, last: bool) -> None:
        """min_replicas: a WAIT on ``target`` behind the windows sent there, once they are
        the last for now, or the first of them went ``spacing`` seconds ago (see
        replicas.py). The batch does not finish before it answers (``Operation.finish``)."""
        replicas = cast(Replicas, self.replicas)
        if last or monotonic() - self.unconfirmed[target] >= replicas.spacing:
            del self.unconfirmed[target]
            self.engine.send(confirm(replicas, target))

    def answer(self, request: Request, replies: list[Any]) -> None:
        self.inflight[request.target] -= 1
        self.router.answered(self, request, replies)
        self.pump()

    def collect(self, window: Window, replies: list[Any]) -> None:
        if not self.collector.take(window, replies):
            self.stopped = True

    def lost(self, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool) -> None:
        for request, _ in requests:
            self.inflight[request.target] -= 1
        self.router.lost(self, requests, error, retryable)
        self.pump()

    def later(self, delay: float, then: Callable[[], None]) -> None:
        """Runs ``then`` after ``delay`` seconds; the batch does not finish before."""
        self.timers += 1

        def fire() -> None:
            self.timers -= 1
            if not self.done:
                then()
                self.pump()

        self.engine.later(delay, fire)

    def abandon(self) -> None:
        self.stopped = True
        super().abandon()
        self.pump()

    def undo(self) -> None:
        collector = self.collector
        granted = collector.granted() if isinstance(collector, Acquired) else self.give_back
        if granted and not isinstance(collector, Replies):
            logger.debug("joblock: releasing %d locks granted to a caller that stopped waiting", len(granted))
            self.engine.spawn(release_batch(granted, collector.core, self.router, self.retries, 1000))


def release_batch(leases: list[Any], core: ModuleType, router: Router, retries: int, size: int) -> Batch:
    """A batch releasing ``leases``: the clean-up after a failed or abandoned acquire."""
    settled = Settled(core, release=True)
    source = lease_chunks(core, leases, size, settled)
    return Batch(source, script_form(core, RELEASE_SHA, None), settled, router, retries, size)
