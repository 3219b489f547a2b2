"""What the sync and asyncio lock APIs share: settings, keys, windows and their bookkeeping.

``Locks`` (threads) and ``joblock.aio.AsyncLocks`` (asyncio) differ only in how
they wait for Redis; everything decided without I/O lives here once.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import socket
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

from . import _windows, errors
from ._core import core as _active_core
from .settings import Settings, parse_url

# Longest ttl accepted: about 31 years, far below where Redis' PX would overflow.
MAX_SECONDS = 1e9


def seconds(value: object, name: str, allow_zero: bool = False) -> float:
    """Checks a duration argument (seconds as int or float, or a timedelta)."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or a timedelta, not {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, not {value!r}")
    if value > MAX_SECONDS:
        raise ValueError(f"{name} must be at most {MAX_SECONDS:.0e} seconds, not {value!r}")
    return float(value)


def milliseconds(ttl: object) -> int:
    """A ttl in seconds as the whole milliseconds sent to Redis (never 0)."""
    return max(1, round(seconds(ttl, "ttl") * 1000))


def backoff(patience: float) -> Iterator[float]:
    """Pauses between attempts to take a busy lock, until ``patience`` seconds are spent.

    Jittered and growing (2 ms doubling to 100 ms): contenders spread out instead of
    polling in step.
    """
    deadline = time.monotonic() + patience
    delay = 0.002
    while (left := deadline - time.monotonic()) > 0:
        yield min(left, delay * random.uniform(0.5, 1.0))
        delay = min(delay * 2, 0.1)


class Acquired:
    """An acquire run's leases, in order, and the first failure that stopped it."""

    __slots__ = ("core", "failure", "out", "owner")

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.core = owner._core
        self.out: list[Any] = []
        self.failure: Exception | None = None

    def handle(self, window: _windows.Window, replies: list[Any]) -> bool:
        leases, failed = self.core.make_leases(self.owner, window.keys, window.names, window.values, replies)
        if failed:
            i, first = next((i, r) for i, r in enumerate(leases) if isinstance(r, errors.ReplyError))
            command = "EVALSHA" if window.scripted else "SET"
            self.failure = errors.reply_error(first.message, command=command, key=window.keys[i])
            leases = [None if isinstance(r, errors.ReplyError) else r for r in leases]
        self.out.extend(leases)
        return not failed

    def broke(self, e: errors.ConnectionError) -> None:
        if self.failure is None:
            self.failure = e

    def granted(self) -> list[Any]:
        return [lease for lease in self.out if lease is not None]

    def error(self, unreleased: int) -> errors.BatchError:
        """The BatchError to raise once the granted locks went back (``unreleased`` did not)."""
        cause = self.failure
        granted = len(self.granted())
        undecided = ""
        kind = errors.BatchError
        if isinstance(cause, errors.ConnectionError):
            undecided = "; any lock in flight when the connection failed expires at its ttl"
            kind = errors.BatchConnectionError
        error = kind(
            f"batch acquire failed: {cause}. {granted} locks had been granted: "
            f"{granted - unreleased} released, {unreleased} not{undecided}",
            granted=granted,
            unreleased=unreleased,
        )
        error.__cause__ = cause
        return error


class Settled:
    """Verdicts of a release or extend run, in order, and the first error reply."""

    __slots__ = ("chunks", "core", "failure", "out", "release")

    def __init__(self, core: ModuleType, release: bool) -> None:
        self.core = core
        self.release = release
        self.out: list[Any] = []
        self.chunks: list[tuple[list[Any], list[int]]] = []
        self.failure: errors.ReplyError | None = None

    def handle(self, window: _windows.Window, replies: list[Any]) -> bool:
        chunk, idx = self.chunks.pop(0)
        verdicts: list[Any] = [False] * len(chunk)
        failed = self.core.settle(chunk, idx, replies, verdicts, self.release)
        if failed:
            i, first = next((i, r) for i, r in enumerate(verdicts) if isinstance(r, errors.ReplyError))
            self.failure = errors.reply_error(first.message, command="EVALSHA", key=chunk[i]._key)
            verdicts = [v is True for v in verdicts]
        self.out.extend(verdicts)
        return not failed

    def result(self) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        return self.out


class LocksBase:
    """Settings, key building and window building shared by Locks and AsyncLocks."""

    # The core this class uses; tests run every API test on each twin through it.
    _core: ModuleType = _active_core

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "joblock",
        window: int = 1000,
        **options: Any,
    ) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int, not {type(window).__name__}")
        if not 1 <= window <= 100_000:
            raise ValueError(f"window must be between 1 and 100000, not {window}")
        self.settings: Settings = parse_url(url, **options)
        self.prefix = prefix
        self._prefix = self._core.as_key(prefix, "prefix") if prefix else b""
        self._window = window
        self._holder_pid = -1
        self._holder = b""

    @classmethod
    def from_redis(cls, client: Any, *, prefix: str = "joblock", **options: Any) -> Any:
        """Locks that reach the same server, database and credentials as a redis-py client."""
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
        if not isinstance(kwargs, dict):
            raise TypeError(f"client must be a redis-py client (redis.Redis), not {type(client).__name__}")
        found: dict[str, Any] = {"db": kwargs.get("db", 0) or 0}
        if kwargs.get("path"):
            found["path"] = kwargs["path"]
            url = "unix:///"
        else:
            found["host"] = kwargs.get("host", "127.0.0.1")
            found["port"] = int(kwargs.get("port", 6379))
            url = "redis://"
        provider = kwargs.get("credential_provider")
        if provider is not None:
            credentials = provider.get_credentials()
            found["username"], found["password"] = (
                credentials if len(credentials) == 2 else (None, credentials[0])
            )
        else:
            found["username"] = kwargs.get("username")
            found["password"] = kwargs.get("password")
        for theirs, ours in (
            ("socket_timeout", "socket_timeout"),
            ("socket_connect_timeout", "connect_timeout"),
        ):
            if kwargs.get(theirs) is not None:
                found[ours] = float(kwargs[theirs])
        if "ssl" in client.connection_pool.connection_class.__name__.lower():
            found["tls"] = True
            for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
                if kwargs.get(name):
                    found[name] = kwargs[name]
            if kwargs.get("ssl_cert_reqs") is not None:
                reqs = kwargs["ssl_cert_reqs"]
                found["ssl_cert_reqs"] = (
                    reqs if isinstance(reqs, str) else {0: "none", 1: "optional"}.get(int(reqs), "required")
                )
            found["ssl_check_hostname"] = bool(kwargs.get("ssl_check_hostname", True))
        found.update(options)
        return cls(url, prefix=prefix, **found)

    def __repr__(self) -> str:
        impl = "c" if self._core.__name__.endswith("_core_c") else "python"
        return f"<{type(self).__name__} {self.settings.url()} prefix={self.prefix!r} core={impl}>"

    def key(self, job: str, *args: Any, **kwargs: Any) -> str:
        """The lock key of ``job`` run with these arguments: ``prefix:job:identifier``.

        The same arguments give the same key in every process; different arguments
        never share one (``key("J", "a-b") != key("J", "a", "b")``). Identifiers over
        200 bytes become a 128-bit digest.
        """
        return self._core.build_key(self._prefix, job, args, kwargs).decode()  # type: ignore[no-any-return]

    def _holder_suffix(self) -> bytes:
        # "@host:pid" after each token, so `joblock inspect` can name a lock's holder.
        pid = os.getpid()
        if pid != self._holder_pid:
            host = socket.gethostname().encode("ascii", "replace").replace(b" ", b"_") or b"?"
            self._holder = b"@%s:%d" % (host, pid)
            self._holder_pid = pid
        return self._holder

    # -- windows ---------------------------------------------------------------------

    def _attempt(self, key: str | bytes, ttl: float, wait: float | None, fence: bool) -> tuple[Any, float]:
        """The window of a single acquire (sent again on each attempt) and its patience."""
        core = self._core
        raw = core.as_key(key)
        ms = milliseconds(ttl)
        patience = 0.0 if wait is None else seconds(wait, "wait", allow_zero=True)
        if fence:
            core.fence_key(raw)
        values = core.new_values(1, self._holder_suffix())
        return _windows.AcquireWindow(core, [raw], values, [key], 0, ms, fence), patience

    def _chunks(self, items: Iterable[Any]) -> Iterator[tuple[int, list[Any]]]:
        it = iter(items)
        start = 0
        while True:
            chunk = list(itertools.islice(it, self._window))
            if not chunk:
                return
            yield start, chunk
            start += len(chunk)

    # The arguments are checked when these are called, before any connection is made;
    # the keys themselves as each window is built.

    def _acquire_windows(
        self, keys: Iterable[str | bytes], ttl: float, fence: bool
    ) -> Iterator[_windows.AcquireWindow]:
        ms = milliseconds(ttl)
        core = self._core
        holder = self._holder_suffix()
        items = iterate(keys, "keys", "str or bytes keys")

        def windows() -> Iterator[_windows.AcquireWindow]:
            for start, chunk in self._chunks(items):
                raw = core.as_keys(chunk, start)
                if fence:
                    for k in raw:
                        core.fence_key(k)
                values = core.new_values(len(raw), holder)
                yield _windows.AcquireWindow(core, raw, values, chunk, start, ms, fence)

        return windows()

    def _dedupe_windows(
        self, job: str, arg_tuples: Iterable[tuple[Any, ...]], ttl: float, fence: bool
    ) -> Iterator[_windows.AcquireWindow]:
        ms = milliseconds(ttl)
        core = self._core
        holder = self._holder_suffix()
        prefix = self._prefix
        core.build_keys(prefix, job, [], 0)  # checks job
        items = iterate(arg_tuples, "arg_tuples", "argument tuples")

        def windows() -> Iterator[_windows.AcquireWindow]:
            for start, chunk in self._chunks(items):
                raw = core.build_keys(prefix, job, chunk, start)
                values = core.new_values(len(raw), holder)
                yield _windows.AcquireWindow(core, raw, values, None, start, ms, fence)

        return windows()

    def _script_windows(
        self, sha: bytes, leases: Iterable[Any], arg: int | None, settled: Settled
    ) -> Iterator[_windows.ScriptWindow]:
        core = self._core
        for start, chunk in self._chunks(iterate(leases, "leases", "leases")):
            idx, keys, values = core.lease_fields(chunk, start)
            settled.chunks.append((chunk, idx))
            yield _windows.ScriptWindow(core, sha, keys, values, start, arg, settled.release)

    def _script_window(self, sha: bytes, lease: Any, arg: int | None, gone_is_done: bool) -> Any:
        if type(lease) is not self._core.Lease:
            raise TypeError(f"lease must be a Lease, not {type(lease).__name__}")
        return _windows.ScriptWindow(self._core, sha, [lease._key], [lease._value], 0, arg, gone_is_done)


def iterate(items: Any, name: str, what: str) -> Iterator[Any]:
    """An iterator over a batch argument, refusing what is not a batch with its name.

    A single str or bytes is refused too: iterating it would lock its characters.
    """
    if isinstance(items, (str, bytes)):
        raise TypeError(f"{name} must be an iterable of {what}, not a single {type(items).__name__}")
    try:
        return iter(items)
    except TypeError:
        raise TypeError(f"{name} must be an iterable of {what}, not {type(items).__name__}") from None


def single_reply(window: _windows.Window, replies: list[Any]) -> Any:
    """The reply of a one-command window; an error reply is raised, naming the key."""
    reply = replies[0]
    if isinstance(reply, errors.ReplyError):
        raise errors.reply_error(reply.message, command="EVALSHA", key=window.keys[0])
    return reply
