"""Operations: each thing joblock asks of Redis, as a state machine without I/O.

An operation sends requests through its engine (a driver), is handed each
request's replies (``answer``), and ends with a result or an error. Nothing here
waits or reads a socket, so the threaded and the asyncio drivers run the very same
operations, and concurrent operations share connections.

Three things every operation shares are settled here once:

- a connection that broke with requests in flight: ``lost`` sends them again on a
  new connection, those that had been written in their retry form, up to
  ``retries`` times; an unreachable server or a refused handshake is final;
- a caller that stopped waiting (a cancelled task, an interrupted thread):
  ``abandon`` lets the operation go on to its end and ``undo`` what it was granted;
- operations whose input comes from the caller (a batch over a generator): the
  driver asks the caller's thread or task to ``produce`` the next piece and hands
  it to ``consume``, so user code never runs inside a driver.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Callable
from time import monotonic
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .. import errors, metrics
from .._scripts import COUNTING_ACQUIRE_SHA, EXTEND_SHA, FENCED_ACQUIRE_SHA, RELEASE_SHA, REMAINING_SHA
from .requests import (
    AcquireWindow,
    Commands,
    CompareOne,
    Request,
    ScriptedCommand,
    ScriptWindow,
    Single,
    SingleAcquire,
    Target,
    counting_arguments,
)

if TYPE_CHECKING:
    from .replicas import Replicas

__all__ = [
    "AcquireOne", "Call", "Engine", "Interrupted", "Loading", "Operation", "Pause", "ScriptOne",
    "fenced_members", "interruption", "sure_until",
]  # fmt: skip

logger = logging.getLogger("joblock")

# A lease is sure of its lock until its ttl, counted from when its grant (or its last
# extend) was sent, would end less an allowance for the drift between this host's
# clock and the server's: DRIFT of the ttl and DRIFT_S more (Redlock's allowance).
DRIFT = 0.01
DRIFT_S = 0.002


def sure_until(sent: float, ms: int) -> float:
    """The deadline (monotonic) of a grant or extend for ``ms`` sent at ``sent``; a lock
    without a ttl (compat's ``timeout=None``) has none."""
    if not ms:
        return math.inf
    return sent + ms * (1.0 - DRIFT) / 1000 - DRIFT_S


class Engine:
    """What operations ask of the driver that carries them out: the base of both
    drivers' state (a class, not a Protocol: the compiled build calls send and wake in C)."""

    def send(self, request: Request) -> None:
        """Writes ``request`` on the connection to its target (opening one if needed)."""
        raise NotImplementedError

    def later(self, delay: float, callback: Callable[[], None]) -> None:
        """Calls ``callback`` (with the driver's lock held) after ``delay`` seconds."""
        raise NotImplementedError

    def wake(self, op: Operation) -> None:
        """Tells the waiting caller that ``op`` is done or wants input."""
        raise NotImplementedError

    def spawn(self, op: Operation) -> None:
        """Runs ``op`` in the background (the undo of an abandoned operation)."""
        raise NotImplementedError


class Loading(errors.ConnectionError):
    """Redis answered LOADING: it restarted and still reads its dataset, so nothing ran.

    ``patient`` is set by the driver while the server has time left to finish (see
    ``sockets.Reloads``): it connects again after a pause, and the operations send
    again without counting that against their ``retries``, which a load of a few
    seconds would use up in milliseconds.
    """

    patient = False


class Interrupted(errors.ConnectionError):
    """A connection ended because a caller on it was interrupted (a signal handler raising
    in the main thread) with its bytes half read or written: no fault of the server's, so
    its operations send again without counting it against their ``retries``."""


def interruption(e: BaseException) -> bool:
    """Whether ``e`` interrupted the code it came out of rather than being that code's
    fault: a KeyboardInterrupt or SystemExit, or what a signal handler written in Python
    raised (in the main thread, where the pure build runs it between any two bytecodes):
    its traceback then passes through the handler."""
    if not isinstance(e, Exception):
        return True
    codes = set()
    for signum in signal.valid_signals():
        handler: Any = signal.getsignal(signum)
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            codes.add(code)
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False


class Operation:
    """Base of every operation: its outcome, retries after lost replies, abandonment."""

    __slots__ = (
        "abandoned",
        "attempts",
        "done",
        "engine",
        "error",
        "replicas",
        "result",
        "retries",
        "waiter",
        "wants_input",
    )

    engine: Engine

    def __init__(self, retries: int) -> None:
        self.prepare(retries)

    def prepare(self, retries: int) -> None:
        """What ``__init__`` sets. The single-lock operations call it directly: in the
        compiled build a C call, where ``super().__init__`` is a super object and two
        Python calls per operation."""
        self.retries = retries
        self.attempts = 0
        self.done = False
        self.abandoned = False
        self.wants_input = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.waiter: Any = None  # the driver's handle for waking the caller
        # min_replicas: the WAITs the wire writes behind each request (see replicas.py).
        self.replicas: Replicas | None = None

    def begin(self, engine: Engine) -> None:
        self.engine = engine
        self.start()

    def start(self) -> None:
        raise NotImplementedError

    def answer(self, request: Request, replies: list[Any]) -> None:
        raise NotImplementedError

    def lost(self, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool) -> None:
        """The connection of ``requests`` broke before all their replies came (``retryable``),
        or could not be made (not); each comes with whether it had been written."""
        if self.may_retry(error, retryable):
            self.resend(requests)
        else:
            self.fail(error)

    def may_retry(self, error: errors.JoblockError, retryable: bool) -> bool:
        """Whether a loss may be retried, counting the attempt if so (a loss that is not the
        server's, an interruption or a load it has time left to finish, counts none)."""
        uncounted = type(error) is Interrupted or (type(error) is Loading and error.patient)
        if retryable and not self.done and uncounted:
            if self.replicas is not None:
                self.replicas.unsure = True
            return True
        if (
            retryable
            and not self.done
            and isinstance(error, errors.ConnectionError)
            and not isinstance(error, errors.AuthenticationError)
            and self.attempts < self.retries
        ):
            self.attempts += 1
            if self.replicas is not None:  # a retried grant may be recognised, not written
                self.replicas.unsure = True
            return True
        return False

    def resend(self, requests: list[tuple[Request, bool]]) -> None:
        for request, sent in requests:
            self.engine.send(request.retried() if sent else request)

    # -- input from the caller ----------------------------------------------------------

    def produce(self) -> Any:
        """Runs in the caller's thread or task, outside the driver: the next piece of input."""
        return None

    def consume(self, item: Any) -> None:
        """Takes what ``produce`` made."""

    # -- the end ----------------------------------------------------------------------

    def finish(self, result: Any = None) -> None:
        if self.done:
            return
        replicas = self.replicas
        if replicas is not None and replicas.pending:  # a WAIT behind a request has yet to answer
            replicas.hold(result)
            return
        # The result before ``done``: a signal handler raising between the two (the pure
        # build's) must not leave a done operation without it (a grant read as None).
        self.result = result
        self.done = True
        if self.abandoned:
            self.undo()
        self.engine.wake(self)

    def fail(self, error: BaseException) -> None:
        if self.done:
            return
        self.error = error  # (before ``done``, as in finish)
        self.done = True
        self.engine.wake(self)

    def abandon(self) -> None:
        """The caller stopped waiting: go on to the end, then take back what was granted."""
        if self.abandoned:
            return
        self.abandoned = True
        if self.done and self.error is None:
            self.undo()

    def undo(self) -> None:
        """Takes back what the operation was granted, for a caller that will never see it."""

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class Pause:
    """A plan's pause between two operations; each driver sleeps in its own way."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class Call(Operation):
    """Commands sent as given; the result is their replies, an error reply raised by default.

    ``idempotent`` commands (reads) are sent again after a lost reply; others are not:
    a SET whose reply was lost cannot tell, when retried, whether it took the lock.
    ``scripted`` marks a single EVALSHA of joblock's scripts, sent again after a NOSCRIPT.
    """

    __slots__ = ("commands", "core", "errors_as_replies", "idempotent", "scripted", "target")

    def __init__(
        self,
        target: Target,
        core: ModuleType,
        commands: list[tuple[Any, ...]],
        retries: int,
        *,
        idempotent: bool = False,
        scripted: bool = False,
        errors_as_replies: bool = False,
    ) -> None:
        super().__init__(retries)
        self.target = target
        self.core = core
        self.commands = commands
        self.idempotent = idempotent
        self.scripted = scripted
        self.errors_as_replies = errors_as_replies

    def start(self) -> None:
        if not self.commands:  # a request answered by no reply would wait forever
            self.finish([])
        elif self.scripted:
            self.engine.send(ScriptedCommand(self, self.target, self.core, self.commands[0]))
        else:
            self.engine.send(Commands(self, self.target, self.core, self.commands))

    def answer(self, request: Request, replies: list[Any]) -> None:
        if not self.errors_as_replies:
            for command, reply in zip(self.commands, replies):
                if isinstance(reply, errors.ReplyError):
                    self.fail(command_error(reply, command))
                    return
        self.finish(replies)

    def lost(self, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool) -> None:
        sent = any(s for _, s in requests)
        if (self.idempotent or not sent) and self.may_retry(error, retryable):
            self.resend(requests)
        else:
            self.fail(error)


def command_error(reply: errors.ReplyError, command: tuple[Any, ...]) -> errors.ReplyError:
    """The ReplyError to raise for a command's error reply, naming the command and its key."""
    name = command[0] if isinstance(command[0], str) else command[0].decode()
    key = command[1] if len(command) > 1 and isinstance(command[1], bytes) else None
    if name.upper() == "EVALSHA" and len(command) > 3 and isinstance(command[3], bytes):
        key = command[3]
    return errors.reply_error(reply.message, command=name.upper(), key=key)


class AcquireOne(Operation):
    """One lock: ``SET key value NX PX ms GET`` (or the fenced or counting script), a Lease or None."""

    __slots__ = ("core", "fenced", "key", "limit", "ms", "name", "owner", "sent", "target", "value")

    def __init__(
        self,
        owner: Any,
        target: Target,
        core: ModuleType,
        key: bytes,
        name: Any,
        value: bytes,
        ms: int,
        fenced: bool,
        limit: int,
        retries: int,
    ) -> None:
        self.prepare(retries)
        self.owner = owner
        self.target = target
        self.core = core
        self.key = key
        self.name = name
        self.value = value
        self.ms = ms
        self.fenced = fenced
        self.limit = limit
        # Before the grant is sent (and before a retry, whose grant may be the first send's).
        self.sent = monotonic()

    def start(self) -> None:
        key, value = self.key, self.value
        if self.limit > 1:  # the counting script's replies and errors are final: no probe, no merge
            extra = counting_arguments(self.limit, self.fenced, False)
            payload = self.core.encode_acquire([key], [value], self.ms, COUNTING_ACQUIRE_SHA, extra)
            self.engine.send(Single(self, self.target, payload, True))
            return
        payload = self.core.encode_acquire(
            [key], [value], self.ms, FENCED_ACQUIRE_SHA if self.fenced else None
        )
        self.engine.send(SingleAcquire(self, self.target, payload, self.fenced, key, value))

    def retry_form(self) -> AcquireWindow:
        """What a lost reply sends again: the acquire as a window of one key, which
        recognises the lock it granted."""
        return AcquireWindow(
            self, self.target, self.core, [self.key], [self.value], [self.name], 0, self.ms, self.fenced,
            self.limit, True,
        )  # fmt: skip

    def answer(self, request: Request, replies: list[Any]) -> None:
        reply = replies[0]
        if reply is None:
            self.finish(None)
        elif type(reply) is _ReplyError:
            command = "EVALSHA" if self.fenced or self.limit > 1 else "SET"
            self.fail(errors.reply_error(reply.message, command=command, key=self.key))
        else:
            self.finish(self.lease(reply))

    def lease(self, reply: Any) -> Any:
        """The lease that a grant's reply (``b"OK"`` or a fencing number) makes."""
        lease = self.core.make_lease(
            self.owner, self.key, self.name, self.value, reply, sure_until(self.sent, self.ms)
        )
        if self.fenced:
            fenced_members([lease])
        return lease

    def undo(self) -> None:
        lease = self.result
        if lease is not None:
            logger.debug("joblock: releasing %r, granted to a caller that stopped waiting", lease.key)
            self.engine.spawn(ScriptOne(lease, self.target, self.core, RELEASE, None, self.retries))


def fenced_members(leases: list[Any]) -> None:
    """A fenced lock's holder is its token, "#" and its fencing number (the plain lock's
    value, the counting lock's member): what its lease's release, extend and remaining
    must compare."""
    for lease in leases:
        if lease is not None and type(lease) is not errors.ReplyError:
            lease._value += b"#%d" % lease._fence


# What a single-lease script does with the lease and its reply.
RELEASE, EXTEND, REMAINING = "release", "extend", "remaining"
_SHAS = {RELEASE: RELEASE_SHA, EXTEND: EXTEND_SHA, REMAINING: REMAINING_SHA}


class ScriptOne(Operation):
    """Release, extend or remaining of one lease: a compare-and-act script on its token
    (a plain lock's release and extend try the server's own command or a plain script
    first, ``CompareOne``, and its script then does what that left undone).

    The verdict is written on the lease when the reply comes, whether or not anyone
    still waits for it, so ``lease.held`` always says what Redis did.
    """

    __slots__ = ("arg", "core", "kind", "lease", "sent", "target")

    def __init__(
        self, lease: Any, target: Target, core: ModuleType, kind: str, arg: int | None, retries: int
    ) -> None:
        self.prepare(retries)
        self.lease = lease
        self.target = target
        self.core = core
        self.kind = kind
        self.arg = arg
        # What an extend's deadline counts from (a release's and remaining's need none).
        self.sent = monotonic() if kind == EXTEND else 0.0

    def start(self) -> None:
        lease = self.lease
        value = lease._value
        # A plain lock's (no "~" after the token, as a counting lock's has) that was not
        # handed over by a release goes by the plain command first.
        if self.kind != REMAINING and (len(value) <= 32 or value[32] != 126) and not lease._handed_over:
            self.engine.send(
                CompareOne(self, self.target, self.core, _SHAS[self.kind], lease._key, value, self.arg)
            )
            return
        payload = self.core.encode_evalsha(_SHAS[self.kind], [lease._key], [value], self.arg)
        self.engine.send(Single(self, self.target, payload, True))

    def retry_form(self) -> Request:
        """The same script; a release that finds the key gone counts its own lost DEL as done."""
        lease = self.lease
        return ScriptWindow(
            self, self.target, self.core, _SHAS[self.kind], [lease._key], [lease._value], None, 0, self.arg,
            self.kind == RELEASE, True,
        )  # fmt: skip

    def answer(self, request: Request, replies: list[Any]) -> None:
        reply = replies[0]
        if type(reply) is _ReplyError:
            self.fail(errors.reply_error(reply.message, command="EVALSHA", key=self.lease._key))
            return
        kind = self.kind
        if metrics.recorder is not None and kind != REMAINING:
            metrics.recorder.verdicts(kind == RELEASE, [self.lease], replies)
        if kind != REMAINING:
            deadline = None if kind == RELEASE else sure_until(self.sent, self.arg or 0)
            self.finish(self.core.confirm(self.lease, reply, deadline))
        else:
            self.finish(reply / 1000 if type(reply) is int and reply >= 0 else None)


# The parser's error replies are of this very class (checked by type: once per reply).
_ReplyError = errors.ReplyError
