"""Exceptions raised by joblock.

Everything joblock raises on purpose derives from :class:`JoblockError`, except
``TypeError`` and ``ValueError`` for bad arguments. "Held by someone else" is never
an exception of ``acquire`` (it returns ``None``); "Redis unreachable" always is.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BatchConnectionError",
    "BatchError",
    "ConnectionError",
    "JoblockError",
    "LimitMismatchError",
    "LockLost",
    "LockNotAcquired",
    "NoPermissionError",
    "OutOfMemoryError",
    "ProtocolError",
    "ReadOnlyError",
    "ReplyError",
    "TimeoutError",
    "WrongTypeError",
]

import builtins
import re


class JoblockError(Exception):
    """Base class of joblock's exceptions."""


class LockNotAcquired(JoblockError):
    """``locks.lock(...)`` or a job could not take its lock: another holder has it."""

    def __init__(self, key: str | bytes) -> None:
        super().__init__(f"lock {key!r} is held by another holder")
        self.key = key


# Why a lease was lost (``LockLost.cause``), as its message says it.
LOST_CAUSES = {
    "deadline": "its deadline passed before an extend was confirmed",
    "expired": "it was found expired",
    "taken": "it was found held by another holder",
    "released": "an operator released it",
    "ended": "its holder released it",
}


class LockLost(JoblockError):
    """A lease no longer holds its lock, or can no longer be sure it does.

    ``cause`` says why: ``"deadline"`` (no extend was confirmed before the lease's
    local deadline), ``"expired"`` or ``"taken"`` (an extend found the lock gone, or
    another holder's), ``"released"`` (an operator released it: ``joblock release``,
    the locks page, ``joblock.testing``), or ``"ended"`` (its own holder released it).
    """

    def __init__(self, key: str | bytes, cause: str) -> None:
        super().__init__(f"lock {key!r} was lost: {LOST_CAUSES.get(cause, cause)}")
        self.key = key
        self.cause = cause

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.key, self.cause))


class ConnectionError(JoblockError, builtins.ConnectionError):
    """Redis could not be reached, or the connection broke and retries ran out."""


class TimeoutError(ConnectionError, builtins.TimeoutError):
    """Redis did not answer within the configured connect or socket timeout."""


class AuthenticationError(ConnectionError):
    """Redis refused the username or password (never retried; the password is not shown)."""


class ProtocolError(JoblockError):
    """The bytes from the server are not valid RESP."""


class ReplyError(JoblockError):
    """Redis answered a command with an error reply (``-ERR ...``).

    ``command`` and ``key`` name what was sent when they are known.
    """

    def __init__(self, message: str, command: str | None = None, key: bytes | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.command = command
        self.key = key

    def __str__(self) -> str:
        if self.command is None:
            return self.message
        where = self.command if self.key is None else f"{self.command} {self.key!r}"
        return f"{self.message} (in {where})"

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message, self.command, self.key))

    @property
    def code(self) -> str:
        """The error's first word, e.g. ``"NOSCRIPT"``, ``"WRONGTYPE"``, ``"OOM"``."""
        return self.message.split(" ", 1)[0]


class WrongTypeError(ReplyError):
    """WRONGTYPE: the key holds a value of another type (a list, a hash...), not a lock."""


class ReadOnlyError(ReplyError):
    """READONLY: the server is a replica; locks must be taken on the primary."""


class NoPermissionError(ReplyError):
    """NOPERM: the ACL user may not run this command or touch this key."""


class OutOfMemoryError(ReplyError):
    """OOM: Redis reached maxmemory and its policy refuses new keys."""


class LimitMismatchError(ReplyError):
    """A key taken with another ``limit`` than this acquire's: a counting lock's key with
    another limit, a plain lock's key (limit 1) as a counting lock's, a counting lock's
    key as a plain lock's, or a read-write lock's readers (``held`` 0) and a counting
    lock.

    ``held`` is the limit the key was taken with, ``asked`` this acquire's. Nothing was
    written.
    """

    @property
    def held(self) -> int:
        return int(self.message.split()[1])

    @property
    def asked(self) -> int:
        return int(self.message.split()[2])

    def __str__(self) -> str:
        key = "a lock" if self.key is None else f"lock {self.key!r}"
        if self.held > 1 and self.asked > 1:
            return f"{key} is a counting lock with limit={self.held}, not limit={self.asked}"
        return f"{key} is {_kind(self.held)}, not {_kind(self.asked)}"


def _kind(limit: int) -> str:
    """What a lock of ``limit`` is (0: the readers of a read-write lock)."""
    if limit == 0:
        return "a read-write lock (shared=True)"
    if limit == 1:
        return "a plain lock (limit=1)"
    return f"a counting lock with limit={limit}"


_BY_CODE: dict[str, type[ReplyError]] = {
    "JOBLOCKLIMIT": LimitMismatchError,
    "WRONGTYPE": WrongTypeError,
    "READONLY": ReadOnlyError,
    "NOPERM": NoPermissionError,
    "OOM": OutOfMemoryError,
}


# An error inside a Lua script comes back as ERR: Redis 6 wraps the inner reply
# ("ERR Error running script (call to f_...): @user_script:3: ... -READONLY ..." or
# "...: WRONGTYPE ..."), and an ACL denial inside a script says "The user executing
# the script can't ..." on every version of Redis, "ACL failure in script: ..." on
# Valkey. Either picks the specific class.
_IN_SCRIPT = re.compile(r"ERR Error running script .*?: -?([A-Z]+) ")
_SCRIPT_ACL = ("The user executing the script can't", "ERR ACL failure in script")


def reply_error(message: str, command: str | None = None, key: bytes | None = None) -> ReplyError:
    """The ReplyError (or its specific subclass, by the reply's first word) to raise."""
    code = message.split(" ", 1)[0]
    if code == "ERR":
        if message.startswith(_SCRIPT_ACL[1]) or _SCRIPT_ACL[0] in message:
            return NoPermissionError(message, command, key)
        inner = _IN_SCRIPT.match(message)
        if inner is not None:
            code = inner[1]
    return _BY_CODE.get(code, ReplyError)(message, command, key)


class BatchError(JoblockError):
    """A batch stopped on a failure that joblock could not retry away.

    The locks the batch had granted before the failure are released (best effort) so a
    failed call dispatches nothing; ``granted`` says how many there were and
    ``unreleased`` how many could not be released (they expire at their ttl).
    """

    def __init__(self, message: str, granted: int, unreleased: int) -> None:
        super().__init__(message)
        self.granted = granted
        self.unreleased = unreleased


class BatchConnectionError(BatchError, ConnectionError):
    """A batch stopped because Redis could not be reached (retries ran out).

    Caught by ``except joblock.ConnectionError`` like any unreachable Redis, and
    carries BatchError's ``granted`` and ``unreleased``.
    """


class ReplicationError(JoblockError):
    """Too few replicas acknowledged a grant or an extend (``min_replicas``).

    A grant is given up (compare-and-delete) before this is raised, unless ``released``
    is False: then Redis could not be reached to give it up, and it expires at its ttl.
    An extend (``extend`` True) keeps its lock: it is still the holder's, but a failover
    may bring back the expiry the replicas last acknowledged. ``acknowledged`` is how
    many replicas confirmed it, None when that could not be learned (the connection
    broke); ``needed`` is ``min_replicas``; ``more`` is how many other locks of the same
    call shared its fate (a batch).
    """

    def __init__(
        self,
        key: str | bytes,
        acknowledged: int | None,
        needed: int,
        released: bool = True,
        extend: bool = False,
        more: int = 0,
    ) -> None:
        self.key = key
        self.acknowledged = acknowledged
        self.needed = needed
        self.released = released
        self.extend = extend
        self.more = more
        counted = "an unknown number of" if acknowledged is None else str(acknowledged)
        what = f"the {'extend of the ' if extend else ''}lock {key!r}" + (f" and {more} more" if more else "")
        if extend:
            fate = "still held, but a failover may bring back the expiry the replicas last acknowledged"
        elif released:
            fate = "given up"
        else:
            fate = "not given up (Redis could not be reached): it expires at its ttl"
        super().__init__(
            f"{what} was acknowledged by {counted} replicas, fewer than min_replicas={needed}: {fate}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.key, self.acknowledged, self.needed, self.released, self.extend, self.more))
