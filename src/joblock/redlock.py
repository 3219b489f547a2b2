"""``Redlock``: one lock over N independent Redis servers, granted by a majority.

The algorithm of the Redis documentation ("Distributed locks with Redis"): the same
random token is set with ``SET NX PX`` on every server at once; the lock is ours when
a quorum (N // 2 + 1) granted it and time is left, its validity being the ttl minus
the time the round took minus an allowance for clock drift (1 % of the ttl + 2 ms).
Otherwise it is released on every server, including those whose reply never came.
Batches go to all servers concurrently, each pipelined in windows as ``Locks`` does.

Read the README's caveats before relying on it for correctness: Redlock assumes
bounded clock drift and process pauses; for safety under pauses, pass a fencing
token to the resource itself (a single ``Locks`` with ``fence=True`` gives one).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from . import _windows, errors
from ._base import backoff, milliseconds, seconds
from ._core import core as _active_core
from .locks import Locks

__all__ = ["Redlock", "RedlockLease"]

logger = logging.getLogger("joblock")

CLOCK_DRIFT_FACTOR = 0.01
CLOCK_DRIFT_MS = 2


class RedlockLease:
    """A lock granted by a quorum of the servers of a ``Redlock``.

    The same API as ``Lease``: ``key``, ``token``, ``held``, ``release()``,
    ``extend(ttl)``, ``remaining()``, and use as a context manager. ``fence`` is
    always None (counters on independent servers give no order). ``validity`` is
    the number of seconds the lock was known to be safe for when it was granted
    (or last extended).
    """

    __slots__ = ("_deadline", "_held", "_key", "_name", "_owner", "_value", "validity")

    def __init__(
        self, owner: Redlock, key: bytes, name: Any, value: bytes, deadline: float, validity: float
    ) -> None:
        self._owner = owner
        self._key = key
        self._name = name
        self._value = value
        self._deadline = deadline
        self._held = True
        self.validity = validity

    @property
    def key(self) -> str | bytes:
        """The key as given (str or bytes); built keys are str."""
        return self._key.decode() if self._name is None else self._name

    @property
    def token(self) -> bytes:
        """The lock's value, the same on every server."""
        return self._value

    @property
    def fence(self) -> None:
        return None

    @property
    def held(self) -> bool:
        """False once released, or once an extend failed to reach a quorum."""
        return self._held

    def release(self) -> bool:
        """True when a quorum still held the lock and released it; it goes from every server."""
        return self._owner.release_many([self])[0]

    def extend(self, ttl: float) -> bool:
        """True when a quorum reset the lock's ttl to ``ttl`` in time; else the lock is dropped."""
        return self._owner.extend_many([self], ttl)[0]

    def remaining(self) -> float | None:
        """Seconds of validity left by the local monotonic clock, or None once none is."""
        if not self._held:
            return None
        left = self._deadline - time.monotonic()
        return left if left > 0 else None

    def __enter__(self) -> RedlockLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._held and not self.release():
            logger.warning("lock %r expired or was taken before release", self.key)

    def __repr__(self) -> str:
        state = "held" if self._held else "released"
        return f"<RedlockLease {self.key!r} {state}>"


class Redlock:
    """Locks granted by a majority of N independent Redis servers (the Redlock algorithm).

    ``urls`` name the servers (each one ``redis://``, ``rediss://`` or ``unix://``);
    the other options are those of ``Locks`` and apply to every server. A server
    that cannot be reached counts as a no; when fewer than a quorum can be reached
    the call raises ``joblock.ConnectionError``.
    """

    _core: ModuleType = _active_core

    def __init__(
        self,
        urls: Sequence[str],
        *,
        prefix: str = "joblock",
        window: int = 1000,
        drift_factor: float = CLOCK_DRIFT_FACTOR,
        **options: Any,
    ) -> None:
        if isinstance(urls, (str, bytes)) or not isinstance(urls, Sequence):
            raise TypeError("urls must be a list of server URLs")
        if not urls:
            raise ValueError("urls must name at least one server")
        if isinstance(drift_factor, bool) or not isinstance(drift_factor, (int, float)):
            raise TypeError(f"drift_factor must be a number, not {type(drift_factor).__name__}")
        if not 0 <= drift_factor < 1:
            raise ValueError(f"drift_factor must be >= 0 and < 1, not {drift_factor!r}")
        cls = Locks if self._core is Locks._core else type("Locks", (Locks,), {"_core": self._core})
        self.servers: list[Locks] = [cls(url, prefix=prefix, window=window, **options) for url in urls]
        self.quorum = len(self.servers) // 2 + 1
        self.prefix = prefix
        self.drift_factor = float(drift_factor)
        self._window = window
        self._executor: ThreadPoolExecutor | None = None
        self._executor_pid = -1
        self._executor_lock = threading.Lock()

    def __repr__(self) -> str:
        urls = ", ".join(s.settings.url() for s in self.servers)
        return f"<Redlock [{urls}] quorum={self.quorum} prefix={self.prefix!r}>"

    def close(self) -> None:
        """Closes idle connections and the worker threads; the Redlock stays usable."""
        for server in self.servers:
            server.close()
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)

    def __enter__(self) -> Redlock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def key(self, job: str, *args: Any, **kwargs: Any) -> str:
        """The lock key of ``job`` run with these arguments, as ``Locks.key`` builds it."""
        return self.servers[0].key(job, *args, **kwargs)

    def drift(self, ttl: float) -> float:
        """The clock drift allowance in seconds for a lock of ``ttl`` seconds."""
        return ttl * self.drift_factor + CLOCK_DRIFT_MS / 1000

    # -- fan-out --------------------------------------------------------------------

    def _on_all(self, call: Callable[[Locks], Any]) -> list[Any]:
        """``call(server)`` on every server at once: its result, or the exception it raised."""

        def guarded(server: Locks) -> Any:
            try:
                return call(server)
            except Exception as e:
                return e

        if len(self.servers) == 1:
            return [guarded(self.servers[0])]
        pid = os.getpid()
        with self._executor_lock:
            if self._executor is None or self._executor_pid != pid:
                # A forked child cannot use its parent's threads.
                self._executor = ThreadPoolExecutor(len(self.servers), thread_name_prefix="joblock-redlock")
                self._executor_pid = pid
            executor = self._executor
        return list(executor.map(guarded, self.servers))

    def _check(self, results: list[Any], what: str) -> None:
        """Raises the first non-connection error; ConnectionError when a quorum is out of reach."""
        for r in results:
            if isinstance(r, Exception) and not isinstance(r, errors.ConnectionError):
                raise r
        down = [r for r in results if isinstance(r, errors.ConnectionError)]
        if len(results) - len(down) < self.quorum:
            error = errors.ConnectionError(
                f"Redlock {what}: only {len(results) - len(down)} of {len(results)} servers reachable, "
                f"{self.quorum} needed: {down[0]}"
            )
            error.__cause__ = down[0]
            raise error

    def _sub_leases(self, leases: list[Any]) -> list[list[Any]]:
        """Per server, a Lease of it for each held RedlockLease (the token is the same everywhere)."""
        idx = [i for i, lease in enumerate(leases) if lease is not None and lease._held]
        keys = [leases[i]._key for i in idx]
        values = [leases[i]._value for i in idx]
        out = []
        for server in self.servers:
            made, _ = self._core.make_leases(server, keys, None, values, [b"OK"] * len(idx))
            per: list[Any] = [None] * len(leases)
            for i, lease in zip(idx, made):
                per[i] = lease
            out.append(per)
        return out

    def _release_everywhere(self, leases: list[Any]) -> list[Any]:
        subs = self._sub_leases(leases)
        return self._on_all(lambda server: server.release_many(subs[self.servers.index(server)]))

    # -- acquire ----------------------------------------------------------------------

    def acquire(self, key: str | bytes, ttl: float, *, wait: float | None = None) -> RedlockLease | None:
        """Takes the lock on a quorum: a RedlockLease, or None while someone else holds it.

        ``wait`` (seconds) keeps trying, with jittered pauses, until then.
        """
        raw = self._core.as_key(key)
        milliseconds(ttl)
        patience = 0.0 if wait is None else seconds(wait, "wait", allow_zero=True)
        pauses = backoff(patience)
        while True:
            lease: RedlockLease | None = self._round([raw], [key], ttl, 0)[0]
            if lease is not None:
                return lease
            pause = next(pauses, None)
            if pause is None:
                return None
            time.sleep(pause)

    @contextmanager
    def lock(self, key: str | bytes, ttl: float, *, wait: float | None = None) -> Iterator[RedlockLease]:
        """``with redlock.lock(key, ttl):`` holds the lock for the block (LockNotAcquired when busy)."""
        lease = self.acquire(key, ttl, wait=wait)
        if lease is None:
            raise errors.LockNotAcquired(key)
        with lease:
            yield lease

    def _round(self, raw: list[bytes], names: list[Any] | None, ttl: float, start: int) -> list[Any]:
        """One window of keys asked of every server at once; RedlockLeases where a quorum granted."""
        core = self._core
        ms = milliseconds(ttl)
        values = core.new_values(len(raw), self.servers[0]._holder_suffix())
        t0 = time.monotonic()

        def ask(server: Locks) -> list[Any]:
            window = _windows.AcquireWindow(core, raw, values, names, start, ms, False)
            return server._acquire_run(iter((window,)))

        results = self._on_all(ask)
        now = time.monotonic()
        deadline = t0 + ttl - self.drift(ttl)
        validity = deadline - now
        granted = [0] * len(raw)
        for r in results:
            if isinstance(r, list):
                for i, lease in enumerate(r):
                    if lease is not None:
                        granted[i] += 1
        out: list[Any] = []
        lost: list[Any] = []
        for i, k in enumerate(raw):
            lease = RedlockLease(self, k, None if names is None else names[i], values[i], deadline, validity)
            if granted[i] >= self.quorum and validity > 0:
                out.append(lease)
            else:
                out.append(None)
                if granted[i] or any(not isinstance(r, list) for r in results):
                    lost.append(lease)
        # Release on every server what did not make a quorum, and where a reply was lost.
        if lost:
            self._release_everywhere(lost)
        try:
            self._check(results, "acquire")
        except BaseException:
            self._release_everywhere([lease for lease in out if lease is not None])
            raise
        return out

    def _acquire_batch(
        self, chunks: Iterator[tuple[list[bytes], list[Any] | None, int]], ttl: float
    ) -> list[Any]:
        out: list[Any] = []
        try:
            for raw, names, start in chunks:
                out.extend(self._round(raw, names, ttl, start))
        except errors.ConnectionError as e:
            granted = [lease for lease in out if lease is not None]
            results = self._release_everywhere(granted) if granted else []
            unreleased = len(granted) if any(isinstance(r, Exception) for r in results) else 0
            error = errors.BatchConnectionError(
                f"batch acquire failed: {e}. {len(granted)} locks had been granted: "
                f"{len(granted) - unreleased} released, {unreleased} not",
                granted=len(granted),
                unreleased=unreleased,
            )
            raise error from e
        except BaseException:
            granted = [lease for lease in out if lease is not None]
            if granted:
                self._release_everywhere(granted)
            raise
        return out

    def _chunks(self, items: Iterable[Any]) -> Iterator[tuple[int, list[Any]]]:
        return self.servers[0]._chunks(items)

    def acquire_many(self, keys: Iterable[str | bytes], ttl: float) -> list[RedlockLease | None]:
        """Takes many locks, each on a quorum: ``[RedlockLease | None]`` in the order of ``keys``.

        Every server gets the batch at once, pipelined in windows.
        """
        milliseconds(ttl)
        core = self._core

        def chunks() -> Iterator[tuple[list[bytes], list[Any] | None, int]]:
            for start, chunk in self._chunks(keys):
                yield core.as_keys(chunk, start), chunk, start

        return self._acquire_batch(chunks(), ttl)

    def dedupe(
        self, job: str, arg_tuples: Iterable[tuple[Any, ...]], ttl: float
    ) -> list[RedlockLease | None]:
        """One lock per distinct argument tuple of ``job``, each on a quorum (see ``Locks.dedupe``)."""
        milliseconds(ttl)
        core = self._core
        prefix = self.servers[0]._prefix
        core.build_keys(prefix, job, [], 0)

        def chunks() -> Iterator[tuple[list[bytes], list[Any] | None, int]]:
            for start, chunk in self._chunks(arg_tuples):
                yield core.build_keys(prefix, job, chunk, start), None, start

        return self._acquire_batch(chunks(), ttl)

    # -- release and extend ----------------------------------------------------------

    def _leases(self, leases: Iterable[Any]) -> list[Any]:
        out = list(leases)
        for i, lease in enumerate(out):
            if lease is not None and type(lease) is not RedlockLease:
                raise TypeError(f"leases[{i}] must be a RedlockLease or None, not {type(lease).__name__}")
        return out

    def release_many(self, leases: Iterable[Any]) -> list[bool]:
        """Releases many leases on every server: ``[bool]``, True where a quorum still held it."""
        items = self._leases(leases)
        results = self._release_everywhere(items)
        for lease in items:
            if lease is not None:
                lease._held = False
        self._check(results, "release")
        return [
            lease is not None and sum(1 for r in results if isinstance(r, list) and r[i]) >= self.quorum
            for i, lease in enumerate(items)
        ]

    def extend_many(self, leases: Iterable[Any], ttl: float) -> list[bool]:
        """Resets many leases' ttl on every server: True where a quorum did so in time.

        A lease that fails is dropped on every server and is no longer held.
        """
        ms = milliseconds(ttl)
        items = self._leases(leases)
        subs = self._sub_leases(items)
        t0 = time.monotonic()
        results = self._on_all(lambda server: server.extend_many(subs[self.servers.index(server)], ttl))
        now = time.monotonic()
        deadline = t0 + ms / 1000 - self.drift(ms / 1000)
        out: list[bool] = []
        lost: list[Any] = []
        for i, lease in enumerate(items):
            if lease is None or not lease._held:
                out.append(False)
                continue
            ok = sum(1 for r in results if isinstance(r, list) and r[i]) >= self.quorum and deadline > now
            if ok:
                lease._deadline = deadline
                lease.validity = deadline - now
            else:
                lost.append(lease)
            out.append(ok)
        if lost:
            self._release_everywhere(lost)
            for lease in lost:
                lease._held = False
        self._check(results, "extend")
        return out
