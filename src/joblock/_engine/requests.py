"""What goes out on a connection: requests, each one write answered by ``n`` replies.

A request belongs to the operation that sent it and is answered in order on its
connection. Windows of lock commands are requests over many keys; each knows the
form it is sent again in after a connection dropped with it in flight (one that
recognises a lock its lost reply had granted), how to redo a few of its keys after a
NOSCRIPT, and how to ask for its keys on the node importing them (ASK).

A plain acquire is ``SET key value NX PX ms GET``: the key's old value comes back, so
one command tells a free key (nil), a lock of our own that a lost reply had granted
(our value), a busy one (another value) and a key that is no plain lock at all
(WRONGTYPE: a counting lock's sorted set, which a ``Probe`` then tells apart). Redis
before 7.0 refuses NX with GET; a connection to one sends the ``pairs`` form instead,
SET NX then GET, whose replies mean the same.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from .. import errors
from .._scripts import (
    COUNTING_ACQUIRE_SHA,
    EXTEND_PLAIN_SHA,
    EXTEND_SHA,
    FENCED_ACQUIRE_SHA,
    MARK,
    RELEASE_PLAIN_SHA,
    RELEASE_SHA,
)

if TYPE_CHECKING:
    from ..settings import Settings
    from .native import Dialect
    from .ops import Operation

W = TypeVar("W", bound="Window")

# The compare-and-delete or compare-and-pexpire (``fast``) that runs first for the
# release or extend of a plain lock, by the lease's own script (RELEASE, EXTEND).
FAST = {RELEASE_SHA: RELEASE_PLAIN_SHA, EXTEND_SHA: EXTEND_PLAIN_SHA}

# A target names the server a request goes to: None for a client of one server, a
# (host, port) for a Redis Cluster node, an index for a Redlock server.
Target = Any


class Resolver(Protocol):
    """Where a target is, when an operation must find it out (Redis Sentinel's primary).

    A driver given one asks ``resolve`` before it opens a connection: the operation
    it returns, carried out first, hands ``then`` the connection's settings (or the
    error the connection's requests fail with). While the connection is in use, the
    driver asks again every ``recheck`` seconds and ends the connection when the
    target has moved; its requests are then sent again on a new one.
    """

    recheck: float

    def settings_for(self, target: Target) -> Settings: ...

    def resolve(
        self, target: Target, then: Callable[[Settings | errors.JoblockError], None]
    ) -> Operation | None: ...


class Acquiring(Protocol):
    """What an ``exclusive`` or ``nx_get`` request has besides a Request's own."""

    @property
    def keys(self) -> list[bytes]: ...

    def pairs(self, positions: list[int]) -> Request:
        """The SET NX GET commands at ``positions`` as SET NX then GET each (Redis < 7.0)."""


class Request:
    """Commands written as one piece, and the replies that answer them.

    Five flags say what the wire must watch for in the replies (fields, not class
    attributes, so that the compiled engine reads them without a lookup):

    - ``scripted``: the commands are EVALSHA of joblock's scripts (and may meet NOSCRIPT);
    - ``merges``: ``merge`` does anything (the replies of most requests are theirs as they came);
    - ``exclusive``: the commands acquire plain (limit 1) locks, so a WRONGTYPE reply is
      probed to tell a counting lock's key; such a request is also ``Acquiring``;
    - ``nx_get``: the commands are SET NX GET, which a server before Redis 7.0 refuses;
    - ``fast``: the commands release or extend plain locks the cheap way, the server's own
      commands or the ``FAST`` scripts (the wire has them written by ``fit``, which knows
      what the server has), and what they did not do is ``slow``'s to do: a lock a waiter
      marked, one expired or someone else's.
    """

    __slots__ = (
        "exclusive",
        "fast",
        "got",
        "merges",
        "n",
        "nx_get",
        "op",
        "parent",
        "payload",
        "scripted",
        "seq",
        "target",
    )

    def __init__(self, op: Operation | None, target: Target, payload: bytes, n: int) -> None:
        # The operation to hand the replies to; None for the wire's own (handshake, loads).
        self.op = op
        self.target = target
        self.payload = payload
        self.n = n
        self.got: list[Any] = []
        self.seq = 0
        # Set on a NOSCRIPT redo: (the request it redoes, its replies, the positions redone).
        self.parent: tuple[Request, list[Any], list[int]] | None = None
        self.scripted = self.merges = self.exclusive = self.nx_get = self.fast = False

    def merge(self, got: list[Any]) -> list[Any]:
        """One reply per item from the replies the payload got back."""
        return got

    def redo(self, positions: list[int]) -> Request:
        """The same commands for the items at ``positions`` only (after a NOSCRIPT)."""
        raise TypeError(f"{type(self).__name__} is not scripted")

    def retried(self) -> Request:
        """What to send on a new connection when this one's replies were lost."""
        return self

    def fit(self, dialect: Dialect | None) -> None:
        """A ``fast`` request: its payload, in the server's own commands where it has them."""

    def slow(self, positions: list[int]) -> Request:
        """A ``fast`` request: the items at ``positions`` by their lease's script."""
        raise TypeError(f"{type(self).__name__} is not fast")


class Single(Request):
    """One command already encoded; sent as it is again after a NOSCRIPT (``scripted``).

    What a lost reply makes it send instead is its operation's ``retry_form()``: the
    single-lock operations keep the common path down to this one small object.
    """

    __slots__ = ()

    def __init__(self, op: Operation | None, target: Target, payload: bytes, scripted: bool) -> None:
        self.op = op
        self.target = target
        self.payload = payload
        self.n = 1
        self.got = []
        self.seq = 0
        self.parent = None
        self.scripted = scripted
        self.merges = self.exclusive = self.nx_get = self.fast = False

    def redo(self, positions: list[int]) -> Request:
        return Single(self.op, self.target, self.payload, self.scripted)

    def retried(self) -> Request:
        return cast(Retrying, self.op).retry_form()


class Retrying(Protocol):
    """The operation of a ``Single``: what it sends again after a lost reply."""

    def retry_form(self) -> Request: ...


class SingleAcquire(Single):
    """One plain lock: ``SET key value NX PX ms GET``, or the fenced-acquire script.

    The replies go to the operation as an acquire window's do (``b"OK"``, None, or a
    fencing number), whichever form carried them.
    """

    __slots__ = ("key", "value")

    def __init__(
        self, op: Operation | None, target: Target, payload: bytes, fenced: bool, key: bytes, value: bytes
    ) -> None:
        # Single's fields set here, not through its __init__: one call less per acquire.
        self.op = op
        self.target = target
        self.payload = payload
        self.n = 1
        self.got = []
        self.seq = 0
        self.parent = None
        self.scripted = fenced
        self.merges = self.exclusive = True
        self.nx_get = not fenced
        self.fast = False
        self.key = key
        self.value = value

    @property
    def keys(self) -> list[bytes]:
        return [self.key]

    def merge(self, got: list[Any]) -> list[Any]:
        if not self.scripted:  # core.claims, inline for one reply but a marked value
            reply = got[0]
            if reply is None or reply == self.value:
                got[0] = b"OK"
            elif type(reply) is bytes:  # ours, marked by a waiter since a lost reply; or another's
                got[0] = b"OK" if reply == self.value + MARK else None
        return got

    def redo(self, positions: list[int]) -> Request:
        return SingleAcquire(self.op, self.target, self.payload, self.scripted, self.key, self.value)

    def pairs(self, positions: list[int]) -> Request:
        return cast(AcquireWindow, self.retried()).pairs(positions)


class CompareOne(Single):
    """One plain lock's release or extend, ``fast`` (see ``Request``): what it did not do
    goes on by ``sha``, the lease's script, and its operation only hears that reply."""

    __slots__ = ("arg", "core", "key", "native", "sha", "value")

    def __init__(
        self, op: Operation | None, target: Target, core: ModuleType, sha: bytes, key: bytes, value: bytes,
        arg: int | None,
    ) -> None:  # fmt: skip
        self.op = op
        self.target = target
        self.payload = b""  # fit() writes it
        self.n = 1
        self.got = []
        self.seq = 0
        self.parent = None
        self.scripted = self.fast = True
        self.merges = self.native = False
        self.exclusive = self.nx_get = False
        self.core = core
        self.sha = sha
        self.key = key
        self.value = value
        self.arg = arg

    def redo(self, positions: list[int]) -> Request:
        return CompareOne(self.op, self.target, self.core, self.sha, self.key, self.value, self.arg)

    def fit(self, dialect: Dialect | None) -> None:
        self.payload, native = fast_payload(self.core, dialect, self.sha, [self.key], [self.value], self.arg)
        if native:
            self.scripted = False
            self.native = True
            self.merges = self.arg is not None  # SET IFEQ's replies; DELIFEQ's are the scripts'

    def merge(self, got: list[Any]) -> list[Any]:
        return native_verdicts(got)

    def slow(self, positions: list[int]) -> Request:
        return Single(
            self.op, self.target, self.core.encode_evalsha(self.sha, [self.key], [self.value], self.arg), True
        )


def fast_payload(
    core: ModuleType,
    dialect: Dialect | None,
    sha: bytes,
    keys: list[bytes],
    values: list[bytes],
    arg: int | None,
) -> tuple[bytes, bool]:
    """The commands of a ``fast`` request for the script ``sha``: the server's own where it
    has them (and True), else the plain script (``FAST``)."""
    payload = None if dialect is None else dialect.encode(core, keys, values, arg)
    if payload is None:
        return core.encode_evalsha(FAST[sha], keys, values, arg), False
    return payload, True


def plain(values: list[bytes]) -> bool:
    """Whether every value is a plain lock's token: a counting lock's (and a reader's)
    has "~" after its 32 hex digits, and goes by its script alone."""
    return all(v[32:33] != b"~" for v in values)


def native_verdicts(got: list[Any]) -> list[Any]:
    """The replies of native commands as the scripts' verdicts: SET IFEQ's OK is 1, its nil 0."""
    return [1 if r == b"OK" else 0 if r is None else r for r in got]


class Commands(Request):
    """Commands given as argument tuples, one reply each (AUTH, SCRIPT LOAD, CLUSTER SLOTS, ...)."""

    __slots__ = ("commands",)

    def __init__(
        self, op: Operation | None, target: Target, core: ModuleType, commands: list[tuple[Any, ...]]
    ) -> None:
        super().__init__(op, target, b"".join([core.encode_command(c) for c in commands]), len(commands))
        self.commands = commands


class ScriptedCommand(Commands):
    """One EVALSHA given as arguments; a NOSCRIPT sends it again once the scripts are loaded."""

    __slots__ = ("core",)

    def __init__(
        self, op: Operation | None, target: Target, core: ModuleType, command: tuple[Any, ...]
    ) -> None:
        super().__init__(op, target, core, [command])
        self.core = core
        self.scripted = True

    def redo(self, positions: list[int]) -> Request:
        return ScriptedCommand(self.op, self.target, self.core, self.commands[0])


class Window(Request):
    """Lock commands over many keys, one per key, each with its lock value.

    ``where`` places the keys in the caller's batch: the position of the first (the
    keys follow on), or a list of positions (a window of keys picked from several).
    """

    __slots__ = ("core", "keys", "names", "retry_form", "sent", "values", "where")

    def __init__(
        self,
        op: Operation | None,
        target: Target,
        core: ModuleType,
        keys: list[bytes],
        values: list[bytes],
        names: list[Any] | None,
        where: int | list[int],
        retry_form: bool,
    ) -> None:
        # Before the window is sent: what its grants' and extends' deadlines count from
        # (a window's retries and parts keep their first's, see ``part``).
        self.sent = monotonic()
        self.core = core
        self.keys = keys
        self.values = values
        self.names = names
        self.where = where
        self.retry_form = retry_form
        payload, n = self.encode()
        super().__init__(op, target, payload, n)
        self.merges = True

    def encode(self) -> tuple[bytes, int]:
        raise NotImplementedError

    def commands(self) -> list[bytes]:
        """The payload as one command per piece (ASKING goes before each)."""
        raise NotImplementedError

    def positions(self) -> list[int]:
        where = self.where
        return list(range(where, where + len(self.keys))) if isinstance(where, int) else where

    def subset(self, idx: list[int], target: Target, retry_form: bool) -> Window:
        """The keys at ``idx`` (of this window), to ``target``, in the plain or the retry form."""
        raise NotImplementedError

    def _pick(self, idx: list[int]) -> tuple[list[bytes], list[bytes], list[Any] | None, list[int]]:
        where = self.positions()
        names = None if self.names is None else [self.names[i] for i in idx]
        return [self.keys[i] for i in idx], [self.values[i] for i in idx], names, [where[i] for i in idx]

    def part(self, window: W) -> W:
        """``window``, made of keys of this one, as sent when this one was."""
        window.sent = self.sent
        return window

    def redo(self, positions: list[int]) -> Window:
        return self.subset(positions, self.target, self.retry_form)

    def retried(self) -> Window:
        return self.subset(list(range(len(self.keys))), self.target, True)


def counting_arguments(limit: int, fenced: bool, retry_form: bool) -> tuple[int, ...]:
    """The counting-lock script's arguments after the ms: the limit, whether fenced, and
    whether the acquire is sent again after a lost reply."""
    return (limit, 1 if fenced else 0, 1 if retry_form else 0)


class AcquireWindow(Window):
    """``SET key value NX PX ms GET`` per key (SET NX then GET with ``pairs``), the
    fenced-acquire script with ``fenced``, or the counting-lock script for ``limit`` > 1.

    Every form recognises a lock that a SET whose reply was lost had granted (the
    lock holds our value; the scripts find their own token), so the retry form is the
    window as it is; but for the counting script, which looks for its token among the
    holders only when told it is sent again (a first attempt's token is fresh).
    """

    __slots__ = ("fenced", "limit", "ms", "pair_form")

    def __init__(
        self,
        op: Operation | None,
        target: Target,
        core: ModuleType,
        keys: list[bytes],
        values: list[bytes],
        names: list[Any] | None,
        where: int | list[int],
        ms: int,
        fenced: bool,
        limit: int,
        retry_form: bool = False,
        pair_form: bool = False,
    ) -> None:
        self.ms = ms
        self.fenced = fenced
        self.limit = limit
        self.pair_form = pair_form
        super().__init__(op, target, core, keys, values, names, where, retry_form)
        self.scripted = fenced or limit > 1
        self.exclusive = limit == 1
        self.nx_get = limit == 1 and not fenced and not pair_form

    def encode(self) -> tuple[bytes, int]:
        if self.pair_form:
            return b"".join(self.commands()), 2 * len(self.keys)
        return self.core.encode_acquire(self.keys, self.values, self.ms, *self.script()), len(self.keys)

    def script(self) -> tuple[bytes | None, tuple[int, ...]]:
        """The script's sha (None for SET NX GET) and its arguments after the ms."""
        if self.limit > 1:
            return COUNTING_ACQUIRE_SHA, counting_arguments(self.limit, self.fenced, self.retry_form)
        return (FENCED_ACQUIRE_SHA if self.fenced else None), ()

    def commands(self) -> list[bytes]:
        core, ms = self.core, self.ms
        if self.pair_form:
            out = []
            for key, value in zip(self.keys, self.values):
                out.append(core.encode_command((b"SET", key, value, b"NX", b"PX", ms)))
                out.append(core.encode_command((b"GET", key)))
            return out
        sha, extra = self.script()
        return [
            core.encode_acquire([key], [value], ms, sha, extra) for key, value in zip(self.keys, self.values)
        ]

    def merge(self, got: list[Any]) -> list[Any]:
        if self.scripted:
            return got
        if not self.pair_form:
            return self.core.claims(got, self.values)  # type: ignore[no-any-return]
        out: list[Any] = []
        for value, set_reply, read in zip(self.values, got[0::2], got[1::2]):
            if type(set_reply) is errors.ReplyError:
                out.append(set_reply)  # as it is (a redirect too)
            elif set_reply is not None:
                out.append(b"OK")
            elif type(read) is errors.ReplyError:
                out.append(read)  # WRONGTYPE: the key holds no plain lock
            else:
                out.append(b"OK" if type(read) is bytes and self.core.mine(read, value) else None)
        return out

    def subset(self, idx: list[int], target: Target, retry_form: bool) -> Window:
        keys, values, names, where = self._pick(idx)
        return self.part(AcquireWindow(
            self.op, target, self.core, keys, values, names, where, self.ms, self.fenced, self.limit,
            retry_form, self.pair_form,
        ))  # fmt: skip

    def pairs(self, positions: list[int]) -> AcquireWindow:
        """The keys at ``positions`` as SET NX then GET each, for a server before Redis 7.0."""
        keys, values, names, where = self._pick(positions)
        return self.part(AcquireWindow(
            self.op, self.target, self.core, keys, values, names, where, self.ms, False, 1, self.retry_form,
            True,
        ))  # fmt: skip


class ScriptWindow(Window):
    """EVALSHA of release, extend or remaining over each key with its lock value.

    The first attempt at releasing or extending plain locks is ``fast`` (see
    ``Request``). A release retried after a lost reply goes by the script: it may find
    its own earlier DEL done, and the script's 0 ("gone", as opposed to -1 "someone
    else's") then counts as done.
    """

    __slots__ = ("arg", "gone_is_done", "native", "sha")

    def __init__(
        self,
        op: Operation | None,
        target: Target,
        core: ModuleType,
        sha: bytes,
        keys: list[bytes],
        values: list[bytes],
        leases: list[Any] | None,
        where: int | list[int],
        arg: int | None,
        gone_is_done: bool,
        retry_form: bool = False,
        fast: bool | None = None,
    ) -> None:
        self.sha = sha
        self.arg = arg
        self.gone_is_done = gone_is_done
        self.native = False
        if fast is None:
            fast = not retry_form and sha in FAST and plain(values)
        self.fast = fast  # for encode(), which the Request's __init__ below runs before it clears it
        # The leases the keys belong to ride along as the window's names, so the
        # replies' verdicts can be written onto them.
        super().__init__(op, target, core, keys, values, leases, where, retry_form)
        self.scripted = True
        self.fast = fast

    def encode(self) -> tuple[bytes, int]:
        if self.fast:  # fit() writes it
            return b"", len(self.keys)
        return self.core.encode_evalsha(self.sha, self.keys, self.values, self.arg), len(self.keys)

    def commands(self) -> list[bytes]:
        encode, sha, arg = self.core.encode_evalsha, FAST[self.sha] if self.fast else self.sha, self.arg
        return [encode(sha, [k], [v], arg) for k, v in zip(self.keys, self.values)]

    def merge(self, got: list[Any]) -> list[Any]:
        if self.native and self.arg is not None:  # SET IFEQ's replies; DELIFEQ's are the scripts'
            return native_verdicts(got)
        if self.retry_form and self.gone_is_done:
            return [1 if r == 0 and type(r) is int else r for r in got]
        return got

    def fit(self, dialect: Dialect | None) -> None:
        self.payload, native = fast_payload(self.core, dialect, self.sha, self.keys, self.values, self.arg)
        if native:
            self.scripted = False
            self.native = True

    def slow(self, positions: list[int]) -> ScriptWindow:
        keys, values, leases, where = self._pick(positions)
        return self.part(ScriptWindow(
            self.op, self.target, self.core, self.sha, keys, values, leases, where, self.arg,
            self.gone_is_done, self.retry_form, False,
        ))  # fmt: skip

    def subset(self, idx: list[int], target: Target, retry_form: bool) -> Window:
        keys, values, leases, where = self._pick(idx)
        return self.part(ScriptWindow(
            self.op, target, self.core, self.sha, keys, values, leases, where, self.arg, self.gone_is_done,
            retry_form,
        ))  # fmt: skip


_ASKING = b"*1\r\n$6\r\nASKING\r\n"


class Asking(Request):
    """A window sent to the Redis Cluster node importing its keys: ASKING before each command."""

    __slots__ = ("inner",)

    def __init__(self, inner: Window) -> None:
        if inner.fast:  # what it would leave undone is not redone through ASKING: the script does it all
            inner = cast(ScriptWindow, inner).slow(list(range(len(inner.keys))))
        self.inner = inner
        commands = inner.commands()
        super().__init__(inner.op, inner.target, b"".join([_ASKING + c for c in commands]), 2 * len(commands))
        self.merges = True
        self.scripted, self.exclusive, self.nx_get = inner.scripted, inner.exclusive, inner.nx_get

    @property
    def keys(self) -> list[bytes]:
        return self.inner.keys

    def pairs(self, positions: list[int]) -> Asking:
        return Asking(cast(AcquireWindow, self.inner).pairs(positions))

    def merge(self, got: list[Any]) -> list[Any]:
        return self.inner.merge(got[1::2])  # each ASKING's +OK dropped

    def redo(self, positions: list[int]) -> Asking:
        return Asking(self.inner.subset(positions, self.target, self.inner.retry_form))

    def retried(self) -> Asking:
        return Asking(self.inner.subset(list(range(len(self.inner.keys))), self.target, True))


class Probe(Request):
    """``ZSCORE key limit`` for keys whose plain acquire met WRONGTYPE: the key of a
    counting lock scores its limit there, and the acquire's reply becomes the error
    "JOBLOCKLIMIT <its limit> 1"; readers hold the key of a read-write lock (score 0),
    and the acquire's reply becomes None (busy); any other value at the key keeps its
    WRONGTYPE.

    Sent on the connection that met the WRONGTYPE (after ASK, the node importing the
    slot would answer MOVED to it: the WRONGTYPE stays).
    """

    __slots__ = ("wrong",)

    def __init__(self, redone: Request, core: ModuleType, keys: list[bytes], wrong: list[Any]) -> None:
        payload = b"".join([core.encode_command((b"ZSCORE", key, b"limit")) for key in keys])
        super().__init__(redone.op, redone.target, payload, len(keys))
        self.merges = True
        self.wrong = wrong

    def merge(self, got: list[Any]) -> list[Any]:
        out: list[Any] = []
        for score, wrong in zip(got, self.wrong):
            # A counting lock scores "limit" as minus its limit, which is 2 or more; the
            # readers of a read-write lock score it 0: busy for a writer.
            held = -float(score) if type(score) is bytes else -1.0
            if held == 0:
                out.append(None)
            elif held >= 2 and held.is_integer():
                out.append(errors.ReplyError(f"JOBLOCKLIMIT {int(held)} 1"))
            else:
                out.append(wrong)
        return out
