"""Pipelined windows of lock commands, and the loop that sends them.

A batch goes out as windows (1,000 commands by default), each one write and one read.
The next window is written before the previous one's replies are read, so Redis
always has work while the client parses. A dropped connection is retried with the
same tokens, in a form that recognises a lock granted before the drop as ours; a
NOSCRIPT reply loads the scripts and redoes just the commands it hit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from . import errors
from ._scripts import FENCED_ACQUIRE_SHA
from .connection import Connection, Pool


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


def _redo(conn: Connection, window: Window, replies: list[Any], hit: list[int]) -> None:
    """Loads the scripts and sends again the commands that NOSCRIPT hit."""
    conn.load_scripts()
    keys = [window.keys[i] for i in hit]
    values = [window.values[i] for i in hit]
    conn.send(window.encode(keys, values))
    for i, reply in zip(hit, conn.read(len(hit))):
        replies[i] = reply


def run(pool: Pool, windows: Iterable[Window], handle: Callable[[Window, list[Any]], bool]) -> None:
    """Sends the windows over one connection, two in flight, and hands each its replies.

    When ``handle`` returns False no further window is sent, but the one in flight is
    still read and handed over, so the caller learns every lock that was granted. The
    same holds when ``windows`` raises (bad input mid-batch): the windows already sent
    are read and handed over first, then the exception propagates.
    A dropped connection is retried up to ``settings.retries`` times; the windows in
    flight are sent again in their retry form. When retries run out, the
    ConnectionError propagates and the windows in flight stay undecided.
    """
    source = iter(windows)
    pending: deque[Window] = deque()
    early: list[Any] | None = None  # replies of pending[1], read ahead of a script reload
    attempts = 0
    conn = pool.get()
    resend = False
    more = True
    stopped: Exception | None = None
    try:
        while True:
            try:
                if resend:
                    for window in pending:
                        conn.send(window.payload)
                    resend = False
                while more and len(pending) < 2:
                    try:
                        next_window = next(source, None)
                    except Exception as e:
                        stopped, more = e, False
                        break
                    if next_window is None:
                        break
                    conn.send(next_window.payload)
                    pending.append(next_window)
                if not pending:
                    break
                window = pending[0]
                replies, early = (early, None) if early is not None else (conn.read(window.n), None)
                replies = window.merge(replies)
                hit = window.core.error_positions(replies, "NOSCRIPT") if window.scripted else None
                if hit:
                    # The replies of the window behind this one come first on the wire.
                    if len(pending) > 1:
                        early = conn.read(pending[1].n)
                    _redo(conn, window, replies, hit)
            except errors.ConnectionError:
                conn.close()
                attempts += 1
                if attempts > pool.settings.retries:
                    raise
                conn = pool.connect()
                early = None
                for window in pending:
                    window.retry()
                resend = True
                continue
            pending.popleft()
            more = handle(window, replies) and more
        if stopped is not None:
            raise stopped
    finally:
        # A connection with replies still on the wire cannot be reused.
        if pending or resend:
            conn.close()
        else:
            pool.put(conn)
