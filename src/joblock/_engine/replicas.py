"""Grants confirmed by replicas: ``WAIT n timeout`` behind an operation's writes.

Redis replicates asynchronously: a lock granted by a primary that fails before a
replica saw the SET is lost when that replica is promoted. With ``min_replicas``,
every request an operation writes is followed on the same connection, in the same
write, by ``WAIT n timeout``: Redis answers it once ``n`` replicas acknowledged
everything the connection wrote before it (or the timeout passed), so its reply
says how many replicas hold the grant. The wire writes one WAIT at the end of each
write that carries such requests (whatever connection they go out on, and again
behind a request it sends a second time after a NOSCRIPT): Redis holds the
connection while a WAIT waits, so a lagging replica costs the connection's other
callers one ``replica_timeout`` per write, not one per confirming caller.

A batch hands out its leases together, at its end, so its windows need no WAIT each
(one behind every window stalled the connection once per window: 100,000 keys took
twice as long confirmed as not). The batch sends a ``Confirm`` to a server behind the
last window it wrote there, and the wire writes one WAIT for it, which covers every
window written on that connection before it. A batch that goes on writing to a
server for long (a generator of millions of keys) also sends one there every
``SPACING`` times ``replica_timeout``: a replica that cannot keep up is never asked to
catch up more than that much of the batch's writing, and a batch whose replicas are
gone stops at the first WAIT that says so, not at its end.

A WAIT proves nothing about a write made on another connection. When a connection
broke with the operation's requests in flight, a retried acquire may have
recognised its own lock without writing anything, so the count is ``unsure``: the
plan (``_client.LocksBase._confirming``) then confirms in a way that holds on any
connection, an extend of the lease (a write of its own, after the grant in the
replication stream) followed by WAIT.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from .. import errors
from .ops import Operation
from .requests import Request, Target

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["SPACING", "Confirm", "Replicas", "Waits", "confirm"]

# At most this many times replica_timeout between two WAITs of a batch on a server (2 s
# by default). Each WAIT stalls the connection until the replica caught up: on a 2-core
# machine with other load, WAITs every quarter of replica_timeout (7 per batch of 100,000
# keys) cost a quarter to a third of the batch's rate, one at its end 0-10%. A replica
# slower than the primary falls behind by a share of this time, and must catch up within
# replica_timeout: one less than 25% slower still does; one that stopped is found out in 2 s.
SPACING = 4.0


class Replicas:
    """The WAITs behind one operation's requests, and what they answered.

    The wire counts a WAIT owed (``pending``) for each of the operation's requests it
    pushes, and hands this the WAIT's reply (``answer``) or loss (``lost``), through
    ``Waits``. The operation's ``finish`` is held back until every WAIT owed has
    answered, so a caller never sees an unconfirmed grant.
    """

    __slots__ = (
        "acks", "batched", "carried", "held", "n", "op", "payload", "pending", "refused", "spacing", "unsure",
    )  # fmt: skip

    replicas = None  # as an operation's: nothing follows the WAITs themselves

    def __init__(
        self, op: Operation, core: ModuleType, n: int, timeout: float, batched: bool = False
    ) -> None:
        self.op: Operation | None = op  # None once this finished it (see _settle)
        self.n = n
        self.batched = batched  # the operation sends a Confirm where it wants a WAIT
        self.carried: list[Any] = []  # batched: the wires that wrote its windows since its last Confirm
        self.payload = core.encode_command((b"WAIT", n, max(1, round(timeout * 1000))))
        self.spacing = timeout * SPACING  # batched: seconds between its WAITs on a server, at most
        self.acks = n  # the fewest replicas any WAIT counted; n until one counts fewer
        self.pending = 0
        self.unsure = False  # a WAIT was lost or refused, or a request was sent again
        self.refused: errors.ReplyError | None = None  # WAIT not allowed (NOPERM)
        self.held: tuple[Any] | None = None  # the operation's result, waiting for the WAITs

    def hold(self, result: Any) -> None:
        self.held = (result,)

    def _settle(self) -> None:
        if self.pending == 0 and self.held is not None:
            (result,) = self.held
            self.held = None
            cast(Operation, self.op).finish(result)
            # The operation holds this (op.replicas): kept, the cycle would keep the
            # operation, a batch's collector and the leases it returned alive after the
            # caller let go of them, until the next full collection of the cyclic GC
            # (which untracked objects, such as the compiled leases, never bring on).
            self.op = None

    # -- as the operation of its WAIT requests ---------------------------------------------

    def answer(self, request: Request, replies: list[Any]) -> None:
        self.pending -= 1
        reply = replies[0]
        if type(reply) is int:
            self.acks = min(self.acks, reply)
        else:  # WAIT refused: nothing is known (an UNBLOCKED by a failover: ask again)
            self.unsure = True
            if isinstance(reply, errors.ReplyError) and reply.code == "NOPERM":
                self.refused = reply  # asking again will not help
        self._settle()

    def lost(self, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool) -> None:
        # Never sent again: on another connection a WAIT would count that connection's writes.
        self.pending -= len(requests)
        self.unsure = True
        self._settle()

    def fail(self, error: BaseException) -> None:
        # What the wire caught while handing a WAIT's reply on: the operation's own fault
        # (raised by its finish), so the operation's to fail with.
        self.unsure = True
        if self.op is not None:  # (None: finished already; the fault is another's that its WAIT covered)
            self.op.fail(error)

    def unconfirmed(self) -> None:
        """A Confirm that no WAIT answers: it reached a connection that wrote none of the
        batch's windows, or the connection ended before its WAIT was written."""
        self.pending -= 1
        self.unsure = True
        self._settle()

    @property
    def confirmed(self) -> bool:
        return not self.unsure and self.acks >= self.n

    @property
    def short(self) -> bool:
        """Whether a WAIT counted too few replicas already (no later one makes up for it)."""
        return self.acks < self.n


class Confirm(Operation):
    """A batch's call for a WAIT on one server, behind the windows it wrote there.

    Sent as a request of its own, it goes to the connection of the windows' target but
    writes nothing itself: the wire writes one WAIT at the end of the write it joins
    (``Wire._owe``). The batch counted it ``pending`` when it sent it; the WAIT's reply,
    or its loss, settles that.
    """

    __slots__ = ()

    def __init__(self, replicas: Replicas) -> None:
        self.prepare(0)
        self.replicas = replicas  # its batch's: the wire looks here, and tells a Confirm by its type

    def lost(self, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool) -> None:
        # Never sent again: on another connection a WAIT would count none of the windows.
        cast(Replicas, self.replicas).unconfirmed()

    def fail(self, error: BaseException) -> None:
        cast(Replicas, self.replicas).fail(error)


def confirm(replicas: Replicas, target: Target) -> Request:
    """The request of a Confirm to ``target``, counted as a WAIT that ``replicas`` is owed."""
    replicas.pending += 1
    return Request(Confirm(replicas), target, b"", 0)


class Waits(Operation):
    """The operation of one WAIT that the wire wrote behind the requests of several
    confirming operations: its reply (or loss) goes to each one's Replicas."""

    __slots__ = ("waiting",)

    def __init__(self, waiting: list[Replicas]) -> None:
        self.prepare(0)
        self.waiting = waiting  # once per request it covers

    def answer(self, request: Request, replies: list[Any]) -> None:
        for replicas in self.waiting:
            replicas.answer(request, replies)

    def lost(self, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool) -> None:
        for replicas in self.waiting:
            replicas.lost(requests, error, retryable)

    def fail(self, error: BaseException) -> None:
        for replicas in self.waiting:
            replicas.fail(error)
