"""Pipelined windows of lock commands, and the loop that sends them.

A batch goes out as windows (1,000 commands by default), each one write and one read.
The next window is written before the previous one's replies are read, so Redis
always has work while the client parses. A dropped connection is retried with the
same tokens, in a form that recognises a lock granted before the drop as ours; a
NOSCRIPT reply loads the scripts and redoes just the commands it hit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable
from types import ModuleType
from typing import Any

from . import errors
from ._scripts import FENCED_ACQUIRE_SHA
from .connection import Pool


class Window:
    """One window: keys, their lock values, and the bytes that ask for them."""

    __slots__ = ("core", "keys", "n", "names", "payload", "retried", "start", "values")

    scripted = True  # whether its commands are EVALSHA (and can meet NOSCRIPT)

    def __init__(
        self, core: ModuleType, keys: list[bytes], values: list[bytes], names: list[Any] | None, start: int
    ) -> None:
        self.core = core
        self.keys = keys
        self.values = values
        self.names = names
        self.start = start
        self.n = len(keys)
        self.retried = False
        self.payload = self.encode(keys, values)

    def encode(self, keys: list[bytes], values: list[bytes]) -> bytes:
        raise NotImplementedError

    def retry(self) -> None:
        """Switches to the form sent again after a dropped connection."""
        self.retried = True

    def merge(self, replies: list[Any]) -> list[Any]:
        """One reply per key from what the (possibly retried) payload got back."""
        return replies


class AcquireWindow(Window):
    __slots__ = ("fenced", "ms")

    def __init__(
        self,
        core: ModuleType,
        keys: list[bytes],
        values: list[bytes],
        names: list[Any] | None,
        start: int,
        ms: int,
        fenced: bool,
    ) -> None:
        self.ms = ms
        self.fenced = fenced
        super().__init__(core, keys, values, names, start)

    @property
    def scripted(self) -> bool:  # type: ignore[override]
        return self.fenced

    def encode(self, keys: list[bytes], values: list[bytes]) -> bytes:
        return self.core.encode_acquire(keys, values, self.ms, FENCED_ACQUIRE_SHA if self.fenced else None)  # type: ignore[no-any-return]

    def retry(self) -> None:
        super().retry()
        if self.fenced:
            return  # the fenced script already recognises its own token
        # SET NX again, then GET: the lock is ours iff it holds our value, whether
        # this SET or the one whose reply was lost put it there.
        get = self.core.encode_command
        self.payload = b"".join(
            [
                self.core.encode_acquire([k], [v], self.ms, None) + get((b"GET", k))
                for k, v in zip(self.keys, self.values)
            ]
        )
        self.n = 2 * len(self.keys)

    def merge(self, replies: list[Any]) -> list[Any]:
        if not self.retried or self.fenced:
            return replies
        out: list[Any] = []
        for value, set_reply, got in zip(self.values, replies[0::2], replies[1::2]):
            if isinstance(set_reply, errors.ReplyError):
                out.append(set_reply)
            else:
                out.append(b"OK" if got == value else None)
        return out


class ScriptWindow(Window):
    """EVALSHA of release, extend or remaining over each key with its lock value."""

    __slots__ = ("arg", "gone_is_done", "sha")

    def __init__(
        self,
        core: ModuleType,
        sha: bytes,
        keys: list[bytes],
        values: list[bytes],
        start: int,
        arg: int | None,
        gone_is_done: bool,
    ) -> None:
        self.sha = sha
        self.arg = arg
        self.gone_is_done = gone_is_done
        super().__init__(core, keys, values, None, start)

    def encode(self, keys: list[bytes], values: list[bytes]) -> bytes:
        return self.core.encode_evalsha(self.sha, keys, values, self.arg)  # type: ignore[no-any-return]

    def merge(self, replies: list[Any]) -> list[Any]:
        # A release retried after a lost reply may find its own earlier DEL done: the
        # release script's 0 ("gone", as opposed to -1 "someone else's") counts as done.
        if self.retried and self.gone_is_done:
            return [1 if r == 0 and type(r) is int else r for r in replies]
        return replies


# What the batch loop asks its driver to do (see ``steps``).
SEND, READ, LOAD_SCRIPTS, RECONNECT = "send", "read", "load scripts", "reconnect"
Step = tuple[str, Any]
Handle = Callable[[Window, list[Any]], bool]


def steps(windows: Iterable[Window], handle: Handle, retries: int) -> Generator[Step, Any, None]:
    """The batch loop without I/O: yields what to do; a driver does it and sends back replies.

    Windows go out two in flight: the next one is written before the previous one's
    replies are read. When ``handle`` returns False no further window is sent, but the
    one in flight is still read and handed over, so the caller learns every lock that
    was granted. The same holds when ``windows`` raises (bad input mid-batch): the
    windows already sent are read and handed over first, then the exception propagates.
    A ConnectionError thrown in by the driver makes it reconnect, up to ``retries``
    times, and send the windows in flight again in their retry form; when retries run
    out, it propagates and the windows in flight stay undecided.
    """
    source = iter(windows)
    pending: deque[Window] = deque()
    early: list[Any] | None = None  # replies of pending[1], read ahead of a script reload
    attempts = 0
    resend = False
    more = True
    stopped: Exception | None = None
    while True:
        try:
            if resend:
                for window in pending:
                    yield SEND, window.payload
                resend = False
            while more and len(pending) < 2:
                try:
                    next_window = next(source, None)
                except Exception as e:
                    stopped, more = e, False
                    break
                if next_window is None:
                    break
                # In flight before it is written: a send that fails part-way may have
                # reached Redis, so the window must be retried, never dropped.
                pending.append(next_window)
                yield SEND, next_window.payload
            if not pending:
                break
            window = pending[0]
            if early is None:
                replies = yield READ, window.n
            else:
                replies, early = early, None
            replies = window.merge(replies)
            hit = window.core.error_positions(replies, "NOSCRIPT") if window.scripted else None
            if hit:
                # The replies of the window behind this one come first on the wire.
                if len(pending) > 1:
                    early = yield READ, pending[1].n
                yield LOAD_SCRIPTS, None
                yield SEND, window.encode([window.keys[i] for i in hit], [window.values[i] for i in hit])
                for i, reply in zip(hit, (yield READ, len(hit))):
                    replies[i] = reply
        except errors.ConnectionError:
            attempts += 1
            if attempts > retries:
                raise
            yield RECONNECT, None
            early = None
            for window in pending:
                window.retry()
            resend = True
            continue
        pending.popleft()
        more = handle(window, replies) and more
    if stopped is not None:
        raise stopped


def run(pool: Pool, windows: Iterable[Window], handle: Handle) -> None:
    """Carries out ``steps`` over one pooled connection."""
    loop = steps(windows, handle, pool.settings.retries)
    conn = pool.get()
    reply: Any = None
    failure: errors.ConnectionError | None = None
    try:
        while True:
            try:
                op, arg = loop.send(reply) if failure is None else loop.throw(failure)
            except StopIteration:
                break
            reply = failure = None
            try:
                if op is SEND:
                    conn.send(arg)
                elif op is READ:
                    reply = conn.read(arg)
                elif op is LOAD_SCRIPTS:
                    conn.load_scripts()
                else:
                    conn.close()
                    conn = pool.connect()
            except errors.ConnectionError as e:
                failure = e
    except BaseException:
        # Replies may still be on the wire: this connection cannot be reused.
        conn.close()
        raise
    pool.put(conn)
