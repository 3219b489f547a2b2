"""Redis Sentinel: where a service's primary is, found without I/O.

A client of a ``redis+sentinel://`` URL talks to one server, the primary, whose
address the sentinels know. ``Primary`` is what the drivers ask for a connection's
settings (see ``requests.Resolver``): before a connection to the primary is opened, a
``Discover`` operation asks the sentinels in turn (``SENTINEL GET-MASTER-ADDR-BY-NAME``)
and the connection goes to the address it names; the connection's handshake then
checks with ``ROLE`` that the server is a primary indeed (see ``wire``).

A failover shows up in three ways, each of which ends the connection, so that the
operations on it are sent again (in their retry forms, up to ``retries`` times) on
a new connection, to the primary found anew:

- the old primary closes its clients when it is made a replica, or dies;
- a ``READONLY`` reply: the server is a replica now (``wire`` ends the connection);
- the sentinels name another address: the drivers ask again every ``RECHECK``
  seconds while the connection is used, for an old primary keeps taking writes for
  seconds after the sentinels promoted another (the locks it grants then are lost).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import errors
from ..settings import Settings
from .ops import Operation
from .requests import Commands, Request, Target

__all__ = ["RECHECK", "Discover", "Primary", "SentinelTarget"]

# Seconds between two checks of the primary's address while its connection is in use.
RECHECK = 0.5


@dataclasses.dataclass(frozen=True)
class SentinelTarget:
    """The target of a request to the sentinel at ``index`` of the URL's list."""

    index: int


class Primary:
    """The settings of a Sentinel client's connections: the sentinels', and the primary's once found."""

    recheck = RECHECK

    def __init__(self, core: ModuleType, settings: Settings) -> None:
        self.core = core
        self.settings = settings
        self.service = settings.service
        # The sentinels' own credentials; no SELECT (a sentinel has no databases), and
        # no reconnect pauses: the next sentinel is asked instead.
        self.sentinels = [
            dataclasses.replace(
                settings, host=host, port=port, username=settings.sentinel_username,
                password=settings.sentinel_password, db=0, retries=0, service=None, sentinels=(),
                sentinel_username=None, sentinel_password=None,
            )
            for host, port in settings.sentinels
        ]  # fmt: skip
        self.first = 0  # the sentinel that answered last is asked first
        self.found: Settings | None = None

    def settings_for(self, target: Target) -> Settings:
        if isinstance(target, SentinelTarget):
            return self.sentinels[target.index]
        return self.found or self.settings

    def resolve(
        self, target: Target, then: Callable[[Settings | errors.JoblockError], None]
    ) -> Operation | None:
        """The operation that finds the primary before a connection to it opens; None for a sentinel's."""
        if isinstance(target, SentinelTarget):
            return None
        return Discover(self, then)

    def at(self, host: str, port: int) -> Settings:
        """The settings of the primary found at ``host:port``."""
        found = self.found
        if found is None or (found.host, found.port) != (host, port):
            found = self.found = dataclasses.replace(self.settings, host=host, port=port, sentinels=())
        return found


class Discover(Operation):
    """Asks each sentinel in turn for the primary's address, until one names it.

    Its result goes to ``then`` (the driver's), as the settings of the primary or the
    error saying why no sentinel named it: none reachable, none knowing the service
    name, or the sentinels refusing the password.
    """

    __slots__ = ("asked", "failures", "primary", "then", "unknown")

    def __init__(self, primary: Primary, then: Callable[[Settings | errors.JoblockError], None]) -> None:
        super().__init__(0)
        self.primary = primary
        self.then = then
        self.asked = 0
        self.unknown: list[str] = []  # the sentinels that do not know the service
        self.failures: list[tuple[str, errors.JoblockError]] = []  # each sentinel's, where it was

    def start(self) -> None:
        self.ask()

    def ask(self) -> None:
        primary = self.primary
        n = len(primary.sentinels)
        if self.asked == n:
            self.fail(self.why())
            return
        index = (primary.first + self.asked) % n
        self.asked += 1
        command = (b"SENTINEL", b"GET-MASTER-ADDR-BY-NAME", primary.service)
        self.engine.send(Commands(self, SentinelTarget(index), primary.core, [command]))

    def answer(self, request: Request, replies: list[Any]) -> None:
        reply = replies[0]
        index = request.target.index
        where = self.primary.sentinels[index].address
        if isinstance(reply, list) and len(reply) == 2:
            host, port = reply
            self.primary.first = index
            self.finish(self.primary.at(host.decode(), int(port)))
            return
        if reply is None:
            self.unknown.append(where)
        elif isinstance(reply, errors.ReplyError):
            self.failures.append(
                (where, errors.ReplyError(f"the sentinel at {where} answered {reply.message}"))
            )
        else:
            self.failures.append((where, errors.ProtocolError(f"the sentinel at {where} answered {reply!r}")))
        self.ask()

    def lost(self, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool) -> None:
        self.failures.append((self.primary.sentinels[requests[0][0].target.index].address, error))
        self.ask()

    def why(self) -> errors.JoblockError:
        service = self.primary.service
        reasons = "; ".join(str(e) for _, e in self.failures)
        if self.unknown:
            known = f" (asked {', '.join(self.unknown)})" + (f"; {reasons}" if reasons else "")
            return errors.ConnectionError(f"no sentinel knows a primary named {service!r}{known}")
        if all(isinstance(e, errors.AuthenticationError) for _, e in self.failures):
            # Their messages say "Redis at ...": these were the sentinels, and their password.
            return errors.AuthenticationError(
                f"the sentinels at {', '.join(where for where, _ in self.failures)} refused the sentinel"
                f" credentials (sentinel_username, sentinel_password), asked for the primary {service!r}"
            )
        return errors.ConnectionError(f"no sentinel could say where the primary {service!r} is: {reasons}")

    def finish(self, result: Any = None) -> None:
        if not self.done:
            super().finish(result)
            self.then(result)

    def fail(self, error: BaseException) -> None:
        if not self.done:
            super().fail(error)
            assert isinstance(error, errors.JoblockError)
            self.then(error)
