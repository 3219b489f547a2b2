"""``Locks``: the lock API on top of the core and the connection pool."""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import ModuleType
from typing import Any, TypeVar

from . import _windows, errors
from ._core import core as _active_core
from ._scripts import EXTEND_SHA, RELEASE_SHA, REMAINING_SHA
from .connection import Pool
from .settings import Settings, parse_url

__all__ = ["Lease", "Locks"]

logger = logging.getLogger("joblock")

Lease = _active_core.Lease

F = TypeVar("F", bound=Callable[..., Any])

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


class Locks:
    """Redis locks for jobs: single, batched and deduplicating.

    Thread-safe: connections are pooled, and a forked child opens its own.
    ``url`` is ``redis://``, ``rediss://`` (TLS) or ``unix://``; keyword options
    (``username``, ``password``, ``db``, ``connect_timeout``, ``socket_timeout``,
    ``retries``, ``ssl_ca_certs``, ...) override what the URL says.
    """

    # The core this class uses; tests run every API test on both twins through it.
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
        self._pool = Pool(self.settings, self._core)
        self._holder_pid = -1
        self._holder = b""

    @classmethod
    def from_redis(cls, client: Any, *, prefix: str = "joblock", **options: Any) -> Locks:
        """Locks that reach the same server, database and credentials as a redis-py client."""
        kwargs = client.connection_pool.connection_kwargs
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
        return f"<Locks {self.settings.url()} prefix={self.prefix!r} core={impl}>"

    def close(self) -> None:
        """Closes the idle connections; the Locks stays usable (it reconnects)."""
        self._pool.close()

    def __enter__(self) -> Locks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- keys -------------------------------------------------------------------------

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

    # -- single locks -------------------------------------------------------------------

    def acquire(self, key: str | bytes, ttl: float, *, wait: float | None = None, fence: bool = False) -> Any:
        """Takes the lock for ``ttl`` seconds: a Lease, or None while someone else holds it.

        ``wait`` (seconds) keeps trying until then; ``fence=True`` gives the lease a
        fencing number that grows with every grant of this key.
        """
        core = self._core
        raw = core.as_key(key)
        ms = milliseconds(ttl)
        patience = 0.0 if wait is None else seconds(wait, "wait", allow_zero=True)
        if fence:
            core.fence_key(raw)
        values = core.new_values(1, self._holder_suffix())
        names = [key]
        deadline = time.monotonic() + patience
        delay = 0.002
        while True:
            window = _windows.AcquireWindow(core, [raw], values, names, 0, ms, fence)
            leases = self._acquire_windows(iter((window,)), single=True)
            if leases[0] is not None:
                return leases[0]
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            # Jittered, growing pauses: contenders spread out instead of polling in step.
            time.sleep(min(left, delay * random.uniform(0.5, 1.0)))
            delay = min(delay * 2, 0.1)

    @contextmanager
    def lock(
        self, key: str | bytes, ttl: float, *, wait: float | None = None, fence: bool = False
    ) -> Iterator[Any]:
        """``with locks.lock(key, ttl):`` holds the lock for the block.

        Raises LockNotAcquired when another holder has it (after ``wait``). If the
        lock expired before the block ended, a warning is logged on release.
        """
        lease = self.acquire(key, ttl, wait=wait, fence=fence)
        if lease is None:
            raise errors.LockNotAcquired(key)
        with lease:
            yield lease

    def _single(self, sha: bytes, lease: Any, arg: int | None, gone_is_done: bool) -> Any:
        if type(lease) is not self._core.Lease:
            raise TypeError(f"lease must be a Lease, not {type(lease).__name__}")
        window = _windows.ScriptWindow(self._core, sha, [lease._key], [lease._value], 0, arg, gone_is_done)
        result: list[Any] = []

        def handle(window: _windows.Window, replies: list[Any]) -> bool:
            result.extend(replies)
            return True

        _windows.run(self._pool, (window,), handle)
        reply = result[0]
        if isinstance(reply, errors.ReplyError):
            raise errors.ReplyError(reply.message, command="EVALSHA", key=lease._key)
        return reply

    def _release(self, lease: Any) -> bool:
        if not lease._held:
            return False
        reply = self._single(RELEASE_SHA, lease, None, True)
        lease._held = False
        return bool(reply == 1)

    def _extend(self, lease: Any, ttl: float) -> bool:
        ms = milliseconds(ttl)
        if not lease._held:
            return False
        ok = bool(self._single(EXTEND_SHA, lease, ms, False) == 1)
        if not ok:
            lease._held = False
        return ok

    def _remaining(self, lease: Any) -> float | None:
        if not lease._held:
            return None
        ms = self._single(REMAINING_SHA, lease, None, False)
        return ms / 1000 if ms >= 0 else None

    def _exit(self, lease: Any) -> None:
        if lease._held and not self._release(lease):
            logger.warning("lock %r expired or was taken before release", lease.key)

    # -- batches -----------------------------------------------------------------------

    def _chunks(self, items: Iterable[Any]) -> Iterator[tuple[int, list[Any]]]:
        it = iter(items)
        start = 0
        while True:
            chunk = list(itertools.islice(it, self._window))
            if not chunk:
                return
            yield start, chunk
            start += len(chunk)

    def _acquire_windows(self, windows: Iterator[_windows.AcquireWindow], single: bool = False) -> list[Any]:
        """Runs acquire windows; on an undecidable failure, releases what was granted."""
        core = self._core
        out: list[Any] = []
        failure: list[Exception] = []

        def handle(window: _windows.Window, replies: list[Any]) -> bool:
            leases, failed = core.make_leases(self, window.keys, window.names, window.values, replies)
            if failed:
                i, first = next((i, r) for i, r in enumerate(leases) if isinstance(r, errors.ReplyError))
                command = "EVALSHA" if window.fenced else "SET"  # type: ignore[attr-defined]
                failure.append(errors.ReplyError(first.message, command=command, key=window.keys[i]))
                leases = [None if isinstance(r, errors.ReplyError) else r for r in leases]
            out.extend(leases)
            return not failed

        try:
            _windows.run(self._pool, windows, handle)
        except errors.ConnectionError as e:
            if single:
                raise
            failure.append(e)
        except Exception:
            # Bad input mid-batch: the locks granted so far go back before the error.
            self._release_quietly([r for r in out if r is not None])
            raise
        if not failure:
            return out
        cause = failure[0]
        granted = [r for r in out if r is not None]
        if single:
            raise cause
        unreleased = self._release_quietly(granted)
        undecided = ""
        if isinstance(cause, errors.ConnectionError):
            undecided = "; any lock in flight when the connection failed expires at its ttl"
        kind = errors.BatchConnectionError if isinstance(cause, errors.ConnectionError) else errors.BatchError
        raise kind(
            f"batch acquire failed: {cause}. {len(granted)} locks had been granted: "
            f"{len(granted) - unreleased} released, {unreleased} not{undecided}",
            granted=len(granted),
            unreleased=unreleased,
        ) from cause

    def _release_quietly(self, leases: list[Any]) -> int:
        """Releases leases after a failure; returns how many could not be released."""
        if not leases:
            return 0
        try:
            self.release_many(leases)
        except errors.JoblockError:
            return sum(1 for lease in leases if lease._held)
        return 0

    def acquire_many(self, keys: Iterable[str | bytes], ttl: float, *, fence: bool = False) -> list[Any]:
        """Takes many locks, pipelined: ``[Lease | None]`` in the order of ``keys``.

        ``keys`` may be any iterable (a generator of millions too): it is consumed a
        window at a time. The same key twice: the first wins. If a failure leaves the
        outcome undecided, the locks granted so far are released and BatchError says
        how many there were.
        """
        ms = milliseconds(ttl)
        core = self._core
        holder = self._holder_suffix()

        def windows() -> Iterator[_windows.AcquireWindow]:
            for start, chunk in self._chunks(keys):
                raw = core.as_keys(chunk, start)
                if fence:
                    for k in raw:
                        core.fence_key(k)
                values = core.new_values(len(raw), holder)
                yield _windows.AcquireWindow(core, raw, values, chunk, start, ms, fence)

        return self._acquire_windows(windows())

    def dedupe(
        self, job: str, arg_tuples: Iterable[tuple[Any, ...]], ttl: float, *, fence: bool = False
    ) -> list[Any]:
        """One lock per distinct argument tuple of ``job``: ``[Lease | None]`` in order.

        The keys are ``locks.key(job, *args)``, built inside the core. A None means a
        duplicate: another holder (or an earlier tuple in this call) has that lock.
        """
        ms = milliseconds(ttl)
        core = self._core
        holder = self._holder_suffix()
        prefix = self._prefix
        core.build_keys(prefix, job, [], 0)  # checks job before anything is sent

        def windows() -> Iterator[_windows.AcquireWindow]:
            for start, chunk in self._chunks(arg_tuples):
                raw = core.build_keys(prefix, job, chunk, start)
                values = core.new_values(len(raw), holder)
                yield _windows.AcquireWindow(core, raw, values, None, start, ms, fence)

        return self._acquire_windows(windows())

    def _script_many(self, sha: bytes, leases: Iterable[Any], arg: int | None, release: bool) -> list[Any]:
        core = self._core
        out: list[Any] = []
        chunks: list[tuple[list[Any], list[int]]] = []
        failure: list[errors.ReplyError] = []

        def windows() -> Iterator[_windows.ScriptWindow]:
            for start, chunk in self._chunks(leases):
                idx, keys, values = core.lease_fields(chunk, start)
                chunks.append((chunk, idx))
                yield _windows.ScriptWindow(core, sha, keys, values, start, arg, release)

        def handle(window: _windows.Window, replies: list[Any]) -> bool:
            chunk, idx = chunks.pop(0)
            verdicts: list[Any] = [False] * len(chunk)
            failed = core.settle(chunk, idx, replies, verdicts, release)
            if failed:
                i, first = next((i, r) for i, r in enumerate(verdicts) if isinstance(r, errors.ReplyError))
                failure.append(errors.ReplyError(first.message, command="EVALSHA", key=chunk[i]._key))
                verdicts = [v is True for v in verdicts]
            out.extend(verdicts)
            return not failed

        _windows.run(self._pool, windows(), handle)
        if failure:
            raise failure[0]
        return out

    def release_many(self, leases: Iterable[Any]) -> list[bool]:
        """Releases many leases, pipelined: ``[bool]`` in order; None entries give False.

        False means that lock had expired or been taken before the release.
        """
        return self._script_many(RELEASE_SHA, leases, None, True)

    def extend_many(self, leases: Iterable[Any], ttl: float) -> list[bool]:
        """Resets many leases' ttl, pipelined: ``[bool]``, True where the lock is still ours."""
        return self._script_many(EXTEND_SHA, leases, milliseconds(ttl), False)

    # -- jobs ----------------------------------------------------------------------------

    def job(self, **options: Any) -> Callable[[F], F]:
        """Decorates a function (or method) as a job run under its lock.

        ``@locks.job(ttl=3600)`` gives each argument set one run at a time, as
        resque-lock-timeout does. Options: ``name`` (default: the qualified name),
        ``identifier(*args, **kwargs)`` (None: one lock for the whole job; a tuple:
        the arguments to key on), ``key(*args, **kwargs)`` (the whole key),
        ``on_locked`` ("skip", "raise" or a callable given the job's arguments, e.g.
        to re-enqueue), ``on_expired`` (called with the arguments when the lock had
        expired or been taken before release), ``auto_renew`` with ``on_lost``,
        ``wait`` and ``fence``.
        """
        from .jobs import job

        return job(self, **options)

    def _renewer(self) -> Any:
        renewer = self.__dict__.get("_renewer_instance")
        if renewer is None:
            from .renew import Renewer

            renewer = self.__dict__.setdefault("_renewer_instance", Renewer(self))
        return renewer


class _Failed(Exception):
    """An error reply inside an acquire window (turned into ReplyError or BatchError)."""

    def __init__(self, reply: errors.ReplyError, key: bytes) -> None:
        super().__init__(reply.message)
        self.reply = reply
        self.key = key
