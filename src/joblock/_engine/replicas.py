"""Grants confirmed by replicas: ``WAIT n timeout`` behind an operation's writes.

Redis replicates asynchronously: a lock granted by a primary that fails before a
replica saw the SET is lost when that replica is promoted. With ``min_replicas``,
every request an operation writes is followed on the same connection, in the same
write, by ``WAIT n timeout``: Redis answers it once ``n`` replicas acknowledged
everything the connection wrote before it (or the timeout passed), so its reply
says how many replicas hold the grant. The wire places the WAIT right behind its
request, whatever connection the request goes out on, and again behind a request it
sends a second time after a NOSCRIPT.

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
from .requests import Request, Target

if TYPE_CHECKING:
    from types import ModuleType

    from .ops import Operation

__all__ = ["Replicas"]


class Replicas:
    """The WAITs behind one operation's requests, and what they answered.

    It stands as the operation of its WAIT requests: the wire hands it their replies
    (``answer``) or their loss (``lost``). The operation's ``finish`` is held back
    until every WAIT it sent has answered, so a caller never sees an unconfirmed grant.
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
        self.refused: errors.ReplyError | None = None  # WAIT's error reply (NOPERM, say)
        self.held: tuple[Any] | None = None  # the operation's result, waiting for the WAITs

    def wait(self, target: Target) -> Request:
        """The WAIT to write right behind a request to ``target``."""
        self.pending += 1
        return Request(self, target, self.payload, 1)  # type: ignore[arg-type]

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
        else:  # WAIT refused (NOPERM, say): nothing is known, and asking again will not help
            self.unsure = True
            if isinstance(reply, errors.ReplyError):
                self.refused = reply
        self._settle()

    def lost(self, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool) -> None:
        # Never sent again: on another connection a WAIT would count that connection's writes.
        self.pending -= len(requests)
        self.unsure = True
        self._settle()

    def fail(self, error: BaseException) -> None:
        self.unsure = True

    @property
    def confirmed(self) -> bool:
        return not self.unsure and self.acks >= self.n
