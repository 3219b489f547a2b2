"""One connection's traffic, without I/O: a state machine that both drivers feed.

Requests are written in the order they are submitted, whoever submits them, and
Redis answers in that order, so each reply goes back to the request at the head of
the queue: that is all it takes for concurrent callers to share one connection.

The wire also owns what belongs to the connection rather than to any operation:

- the handshake (AUTH, SELECT, CLIENT SETNAME), written first; requests submitted
  before it is answered wait, so none of them meets a NOAUTH;
- NOSCRIPT: a request of joblock's scripts that meets it gets the scripts loaded
  (once per connection, however many callers hit it at the same moment) and its
  affected commands redone once; its operation sees only the final replies;
- LOADING: a server that restarted and still reads its dataset ran nothing; the
  connection ends, so its requests are sent again on a new one, which the driver opens
  after a pause while the server has time left to load (see ``sockets.Reloads``);
- the server's dialect: Redis before 7.0 answers SET NX GET with a syntax error, and
  from then on the connection sends plain acquires as SET NX then GET; a server with
  native compare-and-act commands (asked in the handshake, see ``native``) gets the
  ``fast`` releases and extends as those commands, any other the plain scripts;
- what a ``fast`` release or extend left undone (a lock a waiter marked, expired or
  someone else's) goes on by the lease's script before its operation hears of it;
- WRONGTYPE to a plain acquire: a probe asks whether the key is a counting lock's,
  so that the operation hears of a limit mismatch rather than of a wrong type;
- a bound on the replies outstanding, beyond which requests wait to be written.

A redo (of a NOSCRIPT, in the older dialect, a probe) answers in place of the replies
it redoes, so operations only ever see the request they sent and its final replies.

The driver gives it bytes read (``feed``), takes bytes to write (``output``) and,
when the connection breaks, takes back every request not fully answered (``drop``).
"""

from __future__ import annotations

from collections import deque
from types import ModuleType
from typing import Any, cast

from .. import errors
from .._scripts import SCRIPTS
from ..settings import Settings
from .native import PROBE, Dialect, dialect
from .ops import Loading, Operation, interruption
from .replicas import Confirm, Replicas, Waits
from .requests import Acquiring, Commands, Probe, Request

__all__ = ["Wire", "handshake_commands"]

# At most this many replies outstanding per connection: a burst of callers beyond it
# waits in memory rather than in Redis' query buffer.
MAX_OUTSTANDING = 65536

CONNECTING, GREETING, READY = "connecting", "greeting", "ready"

# The replies ``quick`` knows: a nil (SET NX GET's grant), 1 and 0 (a release done, or
# left to the script), OK (a native extend done).
_NIL, _ONE, _ZERO, _OK = b"$-1\r\n", b":1\r\n", b":0\r\n", b"+OK\r\n"

# What Redis before 7.0 answers to SET with both NX and GET.
_REFUSED = "ERR syntax error"


def handshake_commands(s: Settings) -> list[tuple[Any, ...]]:
    """The commands a new connection sends first: AUTH, SELECT, CLIENT SETNAME."""
    commands: list[tuple[Any, ...]] = []
    if s.password is not None:
        commands.append(("AUTH", s.username, s.password) if s.username else ("AUTH", s.password))
    if s.db:
        commands.append(("SELECT", s.db))
    if s.client_name:
        commands.append(("CLIENT", "SETNAME", s.client_name))
    if s.service is not None:  # the address came from the sentinels: is it still the primary?
        commands.append(("ROLE",))
    return commands


def handshake_error(s: Settings, command: tuple[Any, ...], reply: errors.ReplyError) -> errors.JoblockError:
    if command[0] == "AUTH":
        user = f"user {s.username!r}" if s.username else "the default user"
        return errors.AuthenticationError(
            f"Redis at {s.address} refused the password for {user}: {reply.code}"
        )
    return errors.reply_error(reply.message, command=" ".join(map(str, command[:2])))


def demoted(s: Settings, what: str) -> errors.ConnectionError:
    """The error that ends a connection to a Sentinel service's primary that is no longer one."""
    return errors.ConnectionError(f"Redis at {s.address} is {what}, no longer the primary of {s.service!r}")


class Wire:
    """Requests in flight on one connection, and the replies coming back for them."""

    __slots__ = (
        "_core", "_dialect", "_error_positions", "_held", "_inflight", "_load_error", "_load_seq", "_out",
        "_outstanding", "_pairs", "_primary", "_reader", "_refusing", "_seq", "_settings", "_take",
        "_taken_seq", "_unwaited", "interruptible", "state",
    )  # fmt: skip

    def __init__(self, core: ModuleType, settings: Settings, refusing: set[str]) -> None:
        self._core = core
        # The addresses of servers that refused SET NX GET (Redis < 7.0), shared by a
        # driver's connections: a new connection to one sends pairs from the start
        # rather than learn it again from a refused window.
        self._refusing = refusing
        self.settle(settings)
        self._reader = core.Reader()
        self._take = core.take
        self._error_positions = core.error_positions  # (read once: both run for every request)
        self._inflight: deque[Request] = deque()
        self._held: deque[Request] = deque()  # submitted, not yet written
        self._out: list[bytes] = []
        self._outstanding = 0
        self._seq = 0  # requests written so far, counting the handshake and script loads
        self._taken_seq = 0  # the last request whose bytes the driver took to write
        self._load_seq = -1  # when the scripts were last loaded
        self._load_error: errors.ReplyError | None = None
        self._pairs = False  # the server refuses SET NX GET
        self._dialect: Dialect | None = None  # the server's native compare-and-act commands
        self._unwaited: list[Replicas] = []  # min_replicas: written since the last WAIT, wanting one
        # Set by the threaded driver: there, a signal handler raising in the main thread as
        # it runs another thread's operation step is the reader's to raise, not that
        # operation's error (the connection ends and the operation sends again).
        self.interruptible = False
        self.state = CONNECTING

    # -- what the driver calls ---------------------------------------------------------

    def settle(self, settings: Settings) -> None:
        """The settings to connect with, once known (a Sentinel service's primary is found first)."""
        self._settings = settings
        # A READONLY reply on the primary of a Sentinel service: a failover made it a
        # replica, and the connection ends so its requests go to the new primary.
        self._primary = settings.service is not None

    def connected(self) -> None:
        """The transport is up: the handshake goes first, then whatever waited for it."""
        commands = handshake_commands(self._settings)
        if self._settings.native_commands:
            commands += PROBE
        if commands:
            self.state = GREETING
            self._push(Commands(None, None, self._core, commands))
        else:
            self._ready()

    def submit(self, request: Request) -> None:
        if self.state is READY and not self._held and self._outstanding < MAX_OUTSTANDING:
            op = request.op
            if op is not None and op.replicas is not None and not self._owe(request, op):
                return  # a batch's Confirm: nothing of its own to write
            if self._pairs and request.nx_get:
                request = self._in_pairs(request)
            elif request.fast:
                request.fit(self._dialect)
            self._seq += 1  # _write, inline: this runs once per call of every caller
            request.seq = self._seq
            self._inflight.append(request)
            self._out.append(request.payload)
            self._outstanding += request.n
        else:
            self._held.append(request)

    def output(self) -> bytes | None:
        """The bytes to write next, in order; None when there are none."""
        if self._unwaited:
            self._push_waits()
        out = self._out
        if not out:
            return None
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self._taken_seq = self._seq
        return data

    # Methods rather than properties, which the compiled engine would look up by name.

    def unsent(self) -> int:
        """How many payloads wait for the driver to take them."""
        return len(self._out)

    def outstanding(self) -> int:
        """Commands written or about to be, whose replies have not come yet."""
        return self._outstanding

    def busy(self) -> bool:
        """Whether any request awaits replies (or waits to be written)."""
        return bool(self._inflight or self._held)

    def feed(self, data: bytes) -> None:
        """Bytes read from the connection; each request complete is handed to its operation.

        Raises ProtocolError on bytes that are not RESP and the handshake's error when
        Redis refused it: the connection is then unusable.
        """
        self._reader.feed(data)
        inflight = self._inflight
        take = self._take
        reader = self._reader
        while inflight:
            request = inflight[0]
            if take(reader, request.got, request.n) < request.n:
                return
            if self._primary and self._read_only(request):
                raise demoted(self._settings, "a replica (it answered READONLY)")
            first = request.got[0]
            if type(first) is _ReplyError and first.message.startswith("LOADING "):
                # Redis restarted and reads its dataset: nothing ran. The connection ends
                # and its requests are sent again (drop() hands them back); a pipeline that
                # straddles the end of the loading starts with a LOADING reply too, and its
                # retry forms recognise what its later commands did.
                request.got.clear()
                raise Loading(f"Redis at {self._settings.address} is loading its dataset")
            # Taken off the queue once its operation has the replies: interrupted meanwhile
            # (a signal handler raising in the pure build), the connection ends and drop()
            # hands the request back to its operation, which would otherwise wait for ever.
            self._complete(request)
            inflight.popleft()
            self._outstanding -= request.n
            if self._held and self.state is READY:
                self._release_held()

    def quick(self, data: bytes) -> bool:
        """What ``feed`` does with ``data``, without the parser, when ``data`` is the one
        reply of the one request in flight and one of the commonest (see ``_NIL``): a
        lone caller's grant, release or extend. Returns whether it was (else ``feed`` it).

        Only for a first read after a write that left one request in flight: its bytes are
        then the parser's first (any before were a reply to a request still in flight).
        """
        inflight = self._inflight
        if len(inflight) != 1:
            return False
        # (compared one by one: a dict's get, looked up by name, costs more than all four)
        if data == _NIL:
            reply: Any = None
        elif data == _ONE:
            reply = 1
        elif data == _ZERO:
            reply = 0
        elif data == _OK:
            reply = b"OK"
        else:
            return False
        request = inflight[0]
        if request.n != 1 or request.got:
            return False
        request.got.append(reply)
        self._complete(request)  # (as feed: no READONLY nor LOADING in these replies)
        inflight.popleft()
        self._outstanding -= 1
        if self._held and self.state is READY:
            self._release_held()
        return True

    def drop(self) -> dict[Operation, list[tuple[Request, bool]]]:
        """Every request not fully answered, by operation, in order, each with whether it was written."""
        lost: dict[Operation, list[tuple[Request, bool]]] = {}
        for request in self._inflight:
            sent = request.seq <= self._taken_seq
            while request.parent is not None:  # a redo stands for the request it redoes
                request, sent = request.parent[0], True
            _add(lost, request, sent)
        for request in self._held:
            _add(lost, request, False)
        if self._unwaited:  # asked for, never written
            waits = self._waits()
            lost[waits.op] = [(waits, False)]  # type: ignore[index]
        self._inflight.clear()
        self._held.clear()
        self._out.clear()
        self._outstanding = 0
        return lost

    # -- inside --------------------------------------------------------------------------

    def _push(self, request: Request) -> None:
        """Writes one of the wire's own requests, or a redo: a WAIT of its operation's goes
        behind it (a batch's Confirm may have gone before it)."""
        op = request.op
        if op is not None and op.replicas is not None:
            op.replicas.pending += 1
            self._unwaited.append(op.replicas)
        self._write(request)

    def _write(self, request: Request) -> None:
        if request.fast:
            request.fit(self._dialect)
        self._seq += 1
        request.seq = self._seq
        self._inflight.append(request)
        self._out.append(request.payload)
        self._outstanding += request.n

    def _owe(self, request: Request, op: Operation) -> bool:
        """min_replicas: the WAIT a request of ``op`` calls for. False for a batch's
        ``Confirm``, which asks for a WAIT and writes nothing itself.

        A single call's request has one behind the write it goes out in. A batch's
        windows have none of their own: the batch sends a ``Confirm`` behind its last
        window to a server, and its WAIT covers every window written here before it.
        The Confirm of a batch that wrote nothing on this connection (it broke after
        the windows were answered, and this is a new one) would count none of them: the
        count is then unsure, and learned again by an extend (see ``_client``).
        """
        replicas = cast(Replicas, op.replicas)
        if type(op) is Confirm:
            if self in replicas.carried:
                replicas.carried.remove(self)
                self._unwaited.append(replicas)  # (the batch counted it pending when it sent it)
            else:
                replicas.unconfirmed()
            return False
        if replicas.batched:
            if self not in replicas.carried:  # (kept by the batch: nothing here outlives it)
                replicas.carried.append(self)
        else:
            replicas.pending += 1
            self._unwaited.append(replicas)
        return True

    def _push_waits(self) -> None:
        """One WAIT behind everything about to be written, for the requests that asked for
        one since the last (WAIT counts every write of the connection before it): a lagging
        replica holds the connection for one ``replica_timeout`` per write, not one per caller."""
        self._push(self._waits())

    def _waits(self) -> Request:
        waiting, self._unwaited = self._unwaited, []
        most = max(waiting, key=lambda replicas: replicas.n)  # WAIT for the most any asked
        return Request(Waits(waiting), None, most.payload, 1)

    def _ready(self) -> None:
        self.state = READY
        self._pairs = self._settings.address in self._refusing
        self._release_held()

    def _release_held(self) -> None:
        held = self._held
        while held and self._outstanding < MAX_OUTSTANDING:
            # Taken off once written: interrupted before (a signal handler raising in the
            # pure build), the connection ends and drop() still finds it (once: it dedupes).
            request = held[0]
            op = request.op
            if op is not None and op.replicas is not None and not self._owe(request, op):
                held.popleft()
                continue
            if self._pairs and request.nx_get:
                self._write(self._in_pairs(request))
            else:
                self._write(request)
            held.popleft()

    def _in_pairs(self, request: Request) -> Request:
        """``request``'s SET NX GET as SET NX then GET, answering for it."""
        acquiring = cast(Acquiring, request)
        everything = list(range(len(acquiring.keys)))
        pairs = acquiring.pairs(everything)
        pairs.parent = (request, [None] * len(everything), everything)
        return pairs

    def _read_only(self, request: Request) -> bool:
        got = request.got
        for reply in got:
            if isinstance(reply, errors.ReplyError) and isinstance(
                errors.reply_error(reply.message), errors.ReadOnlyError
            ):
                # Sent again on the next connection, from scratch (drop() hands it back).
                got.clear()
                return True
        return False

    def _complete(self, request: Request) -> None:
        replies = request.merge(request.got) if request.merges else request.got
        if request.scripted or request.exclusive:
            hit = self._error_positions(replies)
            if hit and self._redone(request, replies, hit):
                return
        if request.fast:
            undone = _undone(replies)
            if undone:
                self._redo(request, replies, undone, request.slow(undone))
                return
        while request.parent is not None:
            request, redone, positions = request.parent
            for i, reply in zip(positions, replies):
                redone[i] = reply
            replies = redone
        op = request.op
        if op is None:
            self._answer(request, replies)
            return
        try:
            op.answer(request, replies)
        except Exception as e:  # a fault of the operation's own is its caller's, not the connection's
            if self.interruptible and interruption(e):
                raise  # the reader's own, and the connection ends (see interruptible)
            op.fail(e)

    def _redone(self, request: Request, replies: list[Any], hit: list[int]) -> bool:
        """Sends what the error replies at ``hit`` call for before the operation hears them:
        True if it did."""
        wrong = []
        if request.exclusive:  # (Redis 6 wraps a script's WRONGTYPE in an ERR)
            wrong = [i for i in hit if type(errors.reply_error(replies[i].message)) is errors.WrongTypeError]
        if request.scripted:
            noscript = [i for i in hit if replies[i].code == "NOSCRIPT"]
            if noscript and not _after_noscript(request):  # load (unless done since sent), redo
                if self._load_seq < request.seq:
                    self._push(Commands(None, None, self._core, _LOAD))
                    self._load_seq = self._seq
                # A WRONGTYPE beside them goes along, for the redo to probe.
                redo = sorted(noscript + wrong)
                self._redo(request, replies, redo, request.redo(redo))
                return True
            if noscript and self._load_error is not None:
                for i in noscript:
                    replies[i] = self._load_error
        if request.nx_get:
            refused = [i for i in hit if replies[i].message == _REFUSED]
            if refused:
                self._pairs = True
                self._refusing.add(self._settings.address)
                self._redo(request, replies, refused, cast(Acquiring, request).pairs(refused))
                return True
        if wrong:
            keys = cast(Acquiring, request).keys
            probe = Probe(request, self._core, [keys[i] for i in wrong], [replies[i] for i in wrong])
            self._redo(request, replies, wrong, probe)
            return True
        return False

    def _redo(self, request: Request, replies: list[Any], positions: list[int], redo: Request) -> None:
        redo.parent = (request, replies, positions)
        self._push(redo)  # a WAIT of its operation's goes behind it: the one before did not cover it

    def _answer(self, request: Request, replies: list[Any]) -> None:
        """The replies to the wire's own requests: the handshake, script loads."""
        assert isinstance(request, Commands)
        if self.state is GREETING:
            if self._settings.native_commands:  # refused or not, the probe tells what the server has
                self._dialect = dialect(*replies[-len(PROBE) :])
                replies = replies[: -len(PROBE)]
            for command, reply in zip(request.commands, replies):
                if isinstance(reply, errors.ReplyError):
                    raise handshake_error(self._settings, command, reply)
                if command[0] == "ROLE" and not (isinstance(reply, list) and reply[:1] == [b"master"]):
                    role = reply[0].decode(errors="replace") if isinstance(reply, list) and reply else "?"
                    raise demoted(self._settings, f"a {role}")
            self._ready()
            return
        # A refused load (NOPERM, say) stands in for the NOSCRIPT of what it was to redo.
        self._load_error = next((r for r in replies if isinstance(r, errors.ReplyError)), None)


def _add(lost: dict[Operation, list[tuple[Request, bool]]], request: Request, sent: bool) -> None:
    """``request`` for ``drop``, once: interrupted (a signal handler raising in the pure
    build), a request may stay at the head of the queue behind its redo, or stay held
    once written (see ``feed`` and ``_release_held``)."""
    if request.op is not None:
        mine = lost.setdefault(request.op, [])
        if not any(r is request for r, _ in mine):
            mine.append((request, sent))


def _after_noscript(request: Request) -> bool:
    """Whether ``request`` redoes commands that met NOSCRIPT: meeting it again, the load
    did not help (another is not tried). A fast request's slow part, say, is no such redo:
    the scripts may never have been loaded on a connection that only sent native commands."""
    if request.parent is None:
        return False
    _, replies, positions = request.parent
    first = replies[positions[0]]
    return type(first) is _ReplyError and first.code == "NOSCRIPT"


def _undone(replies: list[Any]) -> list[int]:
    """The positions a ``fast`` request left to its script: not done (0), a key of
    another type (WRONGTYPE; a counting lock there now is someone else's), or a command
    refused where the script may run: a full Redis refuses SET IFEQ (it may grow the
    key), and an ACL may deny the native command but allow scripts."""
    out = []
    for i in range(len(replies)):
        r = replies[i]
        if type(r) is int:
            if r == 0:
                out.append(i)
        elif type(r) is _ReplyError and type(errors.reply_error(r.message)) in _SCRIPT_DOES:
            out.append(i)
    return out


_SCRIPT_DOES = (errors.WrongTypeError, errors.OutOfMemoryError, errors.NoPermissionError)
_LOAD = [(b"SCRIPT", b"LOAD", body) for body in SCRIPTS.values()]
# The parser's error replies are of this very class (checked by type: once per reply).
_ReplyError = errors.ReplyError
