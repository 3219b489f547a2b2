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

A WAIT proves nothing about a write made on another connection. When a connection
broke with the operation's requests in flight, a retried acquire may have
recognised its own lock without writing anything, so the count is ``unsure``: the
plan (``_client.LocksBase._confirming``) then confirms in a way that holds on any
connection, an extend of the lease (a write of its own, after the grant in the
replication stream) followed by WAIT.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import errors
from .ops import Operation
from .requests import Request

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["Replicas", "Waits"]


class Replicas:
    """The WAITs behind one operation's requests, and what they answered.

    The wire counts a WAIT owed (``pending``) for each of the operation's requests it
    pushes, and hands this the WAIT's reply (``answer``) or loss (``lost``), through
    ``Waits``. The operation's ``finish`` is held back until every WAIT owed has
    answered, so a caller never sees an unconfirmed grant.
    """

    __slots__ = ("acks", "held", "n", "op", "payload", "pending", "refused", "unsure")

    replicas = None  # as an operation's: nothing follows the WAITs themselves

    def __init__(self, op: Operation, core: ModuleType, n: int, timeout: float) -> None:
        self.op = op
        self.n = n
        self.payload = core.encode_command((b"WAIT", n, max(1, round(timeout * 1000))))
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
            self.op.finish(result)

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
        self.op.fail(error)

    @property
    def confirmed(self) -> bool:
        return not self.unsure and self.acks >= self.n


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
