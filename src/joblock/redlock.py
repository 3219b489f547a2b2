"""``Redlock``: one lock over N independent Redis servers, granted by a majority.

The algorithm of the Redis documentation ("Distributed locks with Redis"): the same
random token is set with ``SET NX PX`` on every server at once; the lock is ours when
a quorum (N // 2 + 1) granted it and time is left, its validity being the ttl minus
the time the round took minus an allowance for clock drift (1 % of the ttl + 2 ms).
Otherwise it is released on every server, including those whose reply never came.
Every server gets each window at once, over one driver that talks to all of them
(no thread per server); ``joblock.aio.AsyncRedlock`` is the same for asyncio.

Read the README's caveats before relying on it for correctness: Redlock assumes
bounded clock drift and process pauses; for safety under pauses, pass a fencing
token to the resource itself (a single ``Locks`` with ``fence=True`` gives one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

from . import errors, lost, metrics
from ._client import (
    ClientOptions,
    Plan,
    backoff,
    check_prefix_and_window,
    holder_suffix,
    milliseconds,
    seconds,
)
from ._core import core as _active_core
from ._core_py import LeaseWatch, Sure, lose
from ._engine.batches import chunks, iterate
from ._engine.ops import Pause
from ._engine.quorum import OnEvery
from ._engine.requests import AcquireWindow, ScriptWindow
from ._engine.sync import Driver
from ._scripts import EXTEND_SHA, RELEASE_SHA
from .settings import ConnectionOptions, Settings, parse_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Redlock", "RedlockBase", "RedlockLease", "RedlockOptions"]

logger = logging.getLogger("joblock")

CLOCK_DRIFT_FACTOR = 0.01
CLOCK_DRIFT_MS = 2


class RedlockOptions(ClientOptions, total=False):
    """The keyword options of ``Redlock`` and ``AsyncRedlock``; the connection's apply to every server."""

    drift_factor: float


class RedlockLeaseOwner(Protocol):
    """The Redlock whose lock a RedlockLease is, as a lease of a ``Redlock`` sees it.

    An AsyncRedlock owner returns coroutines instead; type checkers see its leases
    as ``joblock.aio.AsyncRedlockLease``.
    """

    def _release(self, lease: RedlockLease) -> bool: ...
    def _extend(self, lease: RedlockLease, ttl: float | timedelta) -> bool: ...
    def _exit(self, lease: RedlockLease) -> None: ...


class RedlockLease(Sure):
    """A lock granted by a quorum of the servers of a ``Redlock``.

    The same API as ``Lease``: ``key``, ``token``, ``held``, ``release()``,
    ``extend(ttl)``, ``remaining()``, and use as a context manager. ``fence`` is
    always None (counters on independent servers give no order). ``validity`` is
    the number of seconds the lock was known to be safe for when it was granted
    (or last extended). With an ``AsyncRedlock``, the methods are coroutines.
    """

    __slots__ = ("_deadline", "_held", "_key", "_lost", "_name", "_owner", "_value", "_watch", "validity")

    def __init__(
        self,
        owner: Any,
        key: bytes,
        name: str | bytes | None,
        value: bytes,
        deadline: float,
        validity: float,
    ) -> None:
        self._owner: RedlockLeaseOwner = owner  # a Redlock or an AsyncRedlock
        self._key = key
        self._name = name
        self._value = value
        self._deadline = deadline
        self._held = True
        self._lost: str | None = None
        self._watch: LeaseWatch | None = None
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
        return self._owner._release(self)

    def extend(self, ttl: float | timedelta) -> bool:
        """True when a quorum reset the lock's ttl to ``ttl`` in time; else the lock is dropped."""
        return self._owner._extend(self, ttl)

    def remaining(self) -> float | None:
        """Seconds of validity left by the local monotonic clock, or None once none is."""
        if not self._held:
            return None
        left = self._deadline - time.monotonic()
        return left if left > 0 else None

    def __enter__(self) -> RedlockLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._owner._exit(self)

    def __repr__(self) -> str:
        state = "held" if self._held else "released"
        return f"<RedlockLease {self.key!r} {state}>"


class RedlockBase:
    """The Redlock algorithm as plans, shared by ``Redlock`` and ``AsyncRedlock``."""

    _core = _active_core
    # Whether the methods are coroutines (AsyncRedlock).
    asynchronous = False

    def _lost_signal(self, lease: RedlockLease) -> lost.Lost:
        """``lease.lost``, in the style of this client."""
        return lost.signal(lease, self.asynchronous)

    def _listen_for(self, lease: RedlockLease) -> Any:
        # A Redlock's lease is lost by its deadline or an extend's verdicts; an operator
        # releasing it on one server does not end it (a quorum may still hold it).
        return None

    def __init__(
        self,
        urls: Sequence[str],
        *,
        prefix: str = "joblock",
        window: int = 1000,
        drift_factor: float = CLOCK_DRIFT_FACTOR,
        **options: Unpack[ConnectionOptions],
    ) -> None:
        if isinstance(urls, (str, bytes)) or not isinstance(urls, Sequence):
            raise TypeError("urls must be a list of server URLs")
        if not urls:
            raise ValueError("urls must name at least one server")
        if isinstance(drift_factor, bool) or not isinstance(drift_factor, (int, float)):
            raise TypeError(f"drift_factor must be a number, not {type(drift_factor).__name__}")
        if not 0 <= drift_factor < 1:
            raise ValueError(f"drift_factor must be >= 0 and < 1, not {drift_factor!r}")
        check_prefix_and_window(prefix, window)
        # The servers' settings, in the order of ``urls``.
        self.servers: list[Settings] = [parse_url(url, **options) for url in urls]
        if any(settings.min_replicas for settings in self.servers):
            # Its safety is the quorum of independent servers, not their replicas: a
            # setting it ignored would promise what it does not do.
            raise ValueError(
                "min_replicas is not a Redlock option: Redlock's servers are independent primaries"
            )
        self.quorum = len(self.servers) // 2 + 1
        self.prefix = prefix
        self._prefix = self._core.as_key(prefix, "prefix") if prefix else b""
        self.drift_factor = float(drift_factor)
        self._window = window
        self._retries = self.servers[0].retries

    def __repr__(self) -> str:
        urls = ", ".join(s.url() for s in self.servers)
        return f"<{type(self).__name__} [{urls}] quorum={self.quorum} prefix={self.prefix!r}>"

    def key(self, job: str, *args: Any, **kwargs: Any) -> str:
        """The lock key of ``job`` run with these arguments, as ``Locks.key`` builds it."""
        key: bytes = self._core.build_key(self._prefix, job, args, kwargs)
        return key.decode()

    def drift(self, ttl: float) -> float:
        """The clock drift allowance in seconds for a lock of ``ttl`` seconds."""
        return ttl * self.drift_factor + CLOCK_DRIFT_MS / 1000

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

    # -- plans ---------------------------------------------------------------------------

    def _on_every(self, kind: str, leases: list[Any], ms: int | None = None) -> OnEvery:
        """Release or extend of the held ``leases`` on every server (replies in their order)."""
        held = [lease for lease in leases if lease is not None and lease._held]
        keys = [lease._key for lease in held]
        values = [lease._value for lease in held]
        sha = RELEASE_SHA if kind == "release" else EXTEND_SHA
        core = self._core
        windows = [
            ScriptWindow(None, i, core, sha, keys, values, None, 0, ms, kind == "release")
            for i in range(len(self.servers))
        ]
        return OnEvery(windows, self._retries)

    def _verdicts(self, leases: list[Any], results: list[Any]) -> list[bool]:
        """Per lease: whether a quorum of servers said yes (1) to its held key."""
        held = [i for i, lease in enumerate(leases) if lease is not None and lease._held]
        yes = [0] * len(leases)
        for r in results:
            if isinstance(r, list):
                for i, reply in zip(held, r):
                    if reply == 1 and type(reply) is int:
                        yes[i] += 1
        return [n >= self.quorum for n in yes]

    def _release_everywhere(self, leases: list[Any]) -> Plan[list[Any]]:
        results: list[Any] = yield self._on_every("release", leases)
        return results

    def _round(
        self, raw: list[bytes], names: list[Any] | None, ttl: float, start: int
    ) -> Plan[list[RedlockLease | None]]:
        """One window of keys asked of every server at once; RedlockLeases where a quorum granted."""
        core = self._core
        ms = milliseconds(ttl)
        values = core.new_values(len(raw), holder_suffix())
        windows = [
            AcquireWindow(None, i, core, raw, values, names, start, ms, False, 1)
            for i in range(len(self.servers))
        ]
        t0 = time.monotonic()
        results = yield OnEvery(windows, self._retries)
        now = time.monotonic()
        deadline = t0 + ttl - self.drift(ttl)
        validity = deadline - now
        granted = [0] * len(raw)
        for r in results:
            if isinstance(r, list):
                for i, reply in enumerate(r):
                    if type(reply) is bytes:
                        granted[i] += 1
        out: list[Any] = []
        lost: list[Any] = []
        failed = any(not isinstance(r, list) for r in results)
        for i, k in enumerate(raw):
            lease = RedlockLease(self, k, None if names is None else names[i], values[i], deadline, validity)
            if granted[i] >= self.quorum and validity > 0:
                out.append(lease)
            else:
                out.append(None)
                if granted[i] or failed:
                    lost.append(lease)
        # Released on every server where a quorum was not reached, and where a reply was lost.
        if lost:
            yield from self._release_everywhere(lost)
        try:
            self._check(results, "acquire")
        except errors.JoblockError:
            yield from self._release_everywhere([lease for lease in out if lease is not None])
            raise
        return out

    def _acquiring(
        self, key: str | bytes, ttl: float | timedelta, wait: float | timedelta | None
    ) -> Plan[RedlockLease | None]:
        raw = self._core.as_key(key)
        ttl = seconds(ttl, "ttl")  # seconds from here on: the round adds it to clock readings
        patience = 0.0 if wait is None else seconds(wait, "wait", allow_zero=True)
        pauses = backoff(patience)
        while True:
            leases = yield from self._round([raw], [key], ttl, 0)
            if leases[0] is not None:
                return leases[0]
            pause = next(pauses, None)
            if pause is None:
                return None
            yield Pause(pause)

    def _acquiring_batch(
        self, pieces: Iterator[tuple[list[bytes], list[Any] | None, int]], ttl: float
    ) -> Plan[list[RedlockLease | None]]:
        out: list[Any] = []
        try:
            for raw, names, start in pieces:
                out.extend((yield from self._round(raw, names, ttl, start)))
        except errors.ConnectionError as e:
            granted = [lease for lease in out if lease is not None]
            results = (yield from self._release_everywhere(granted)) if granted else []
            unreleased = len(granted) if any(isinstance(r, Exception) for r in results) else 0
            error = errors.BatchConnectionError(
                f"batch acquire failed: {e}. {len(granted)} locks had been granted: "
                f"{len(granted) - unreleased} released, {unreleased} not",
                granted=len(granted),
                unreleased=unreleased,
            )
            raise error from e
        except Exception:
            granted = [lease for lease in out if lease is not None]
            if granted:
                yield from self._release_everywhere(granted)
            raise
        return out

    def _acquiring_many(
        self, keys: Iterable[str | bytes], ttl: float | timedelta
    ) -> Plan[list[RedlockLease | None]]:
        ttl = seconds(ttl, "ttl")  # seconds from here on: the round adds it to clock readings
        core = self._core
        items = iterate(keys, "keys", "str or bytes keys")

        def pieces() -> Iterator[tuple[list[bytes], list[Any] | None, int]]:
            for start, chunk in chunks(items, self._window):
                yield core.as_keys(chunk, start), chunk, start

        return self._acquiring_batch(pieces(), ttl)

    def _deduping(
        self, job: str, arg_tuples: Iterable[tuple[Any, ...] | list[Any]], ttl: float | timedelta
    ) -> Plan[list[RedlockLease | None]]:
        ttl = seconds(ttl, "ttl")  # seconds from here on: the round adds it to clock readings
        core = self._core
        prefix = self._prefix
        core.build_keys(prefix, job, [], 0)
        items = iterate(arg_tuples, "arg_tuples", "argument tuples")

        def pieces() -> Iterator[tuple[list[bytes], list[Any] | None, int]]:
            for start, chunk in chunks(items, self._window):
                yield core.build_keys(prefix, job, chunk, start), None, start

        return self._acquiring_batch(pieces(), ttl)

    def _leases(self, leases: Iterable[object]) -> list[RedlockLease | None]:
        out = list(iterate(leases, "leases", "leases"))
        for i, lease in enumerate(out):
            if lease is not None and type(lease) is not RedlockLease:
                raise TypeError(f"leases[{i}] must be a RedlockLease or None, not {type(lease).__name__}")
        return cast("list[RedlockLease | None]", out)  # checked just above

    def _releasing_many(self, leases: Iterable[object]) -> Plan[list[bool]]:
        items = self._leases(leases)
        results = yield from self._release_everywhere(items)
        verdicts = self._verdicts(items, results)
        for lease, ok in zip(items, verdicts):
            if lease is not None:
                lease._held = False
                lose(lease, "ended" if ok else "expired")  # type: ignore[arg-type]
        self._check(results, "release")
        return verdicts

    def _extending_many(self, leases: Iterable[object], ttl: float | timedelta) -> Plan[list[bool]]:
        """True where a quorum reset the ttl in time; a lease that fails is dropped everywhere."""
        ms = milliseconds(ttl)
        items = self._leases(leases)
        t0 = time.monotonic()
        results = yield self._on_every("extend", items, ms)
        now = time.monotonic()
        deadline = t0 + ms / 1000 - self.drift(ms / 1000)
        verdicts = self._verdicts(items, results)
        out: list[bool] = []
        gone: list[Any] = []
        for lease, ok in zip(items, verdicts):
            if lease is None or not lease._held:
                out.append(False)
                continue
            ok = ok and deadline > now and lease._lost is None and now < lease._deadline
            if ok:
                lease._deadline = deadline
                lease.validity = deadline - now
                if lease._watch is not None:  # the kernel's stop of its "exit" blocks moves too
                    lease._watch.moved(lease)
            else:
                gone.append(lease)
            out.append(ok)
        if gone:
            yield from self._release_everywhere(gone)
            for lease in gone:
                lease._held = False
                lose(lease, "deadline" if now >= lease._deadline else "expired")
        self._check(results, "extend")
        return out

    def _releasing_one(self, lease: RedlockLease) -> Plan[bool]:
        verdicts = yield from self._releasing_many([lease])
        return verdicts[0]

    def _extending_one(self, lease: RedlockLease, ttl: float | timedelta) -> Plan[bool]:
        verdicts = yield from self._extending_many([lease], ttl)
        return verdicts[0]


class Redlock(RedlockBase):
    """Locks granted by a majority of N independent Redis servers (the Redlock algorithm).

    ``urls`` name the servers (each one ``redis://``, ``rediss://`` or ``unix://``);
    the other options are those of ``Locks`` and apply to every server. A server
    that cannot be reached counts as a no; when fewer than a quorum can be reached
    the call raises ``joblock.ConnectionError``.
    """

    def __init__(self, urls: Sequence[str], **options: Unpack[RedlockOptions]) -> None:
        super().__init__(urls, **options)
        servers = self.servers
        self._driver = Driver(self._core, lambda i: servers[i], multi=True)

    def close(self) -> None:
        """Closes the connections; the Redlock stays usable (it reconnects)."""
        self._driver.close()

    def __enter__(self) -> Redlock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @metrics.measured("acquire")
    def acquire(
        self, key: str | bytes, ttl: float | timedelta, *, wait: float | timedelta | None = None
    ) -> RedlockLease | None:
        """Takes the lock on a quorum: a RedlockLease, or None while someone else holds it.

        ``wait`` (seconds) keeps trying, with jittered pauses, until then.
        """
        return self._driver.drive(self._acquiring(key, ttl, wait))

    @contextmanager
    def lock(
        self,
        key: str | bytes,
        ttl: float | timedelta,
        *,
        wait: float | timedelta | None = None,
        on_lost: str | Callable[[RedlockLease], object] = "ignore",
    ) -> Iterator[RedlockLease]:
        """``with redlock.lock(key, ttl):`` holds the lock for the block (LockNotAcquired when busy).

        ``on_lost`` as ``Locks.lock``'s: what stops the block once its validity ends unconfirmed.
        """
        guarded = on_lost != "ignore" and lost.check_on_lost(on_lost, False)
        lease = self.acquire(key, ttl, wait=wait)
        if lease is None:
            raise errors.LockNotAcquired(key)
        with lease:
            if not guarded:
                yield lease
                return
            with lost.Guard(self, lease, guarded):
                yield lease

    @metrics.measured("acquire_many")
    def acquire_many(self, keys: Iterable[str | bytes], ttl: float | timedelta) -> list[RedlockLease | None]:
        """Takes many locks, each on a quorum: ``[RedlockLease | None]`` in the order of ``keys``.

        Every server gets each window at once.
        """
        return self._driver.drive(self._acquiring_many(keys, ttl))

    @metrics.measured("dedupe")
    def dedupe(
        self, job: str, arg_tuples: Iterable[tuple[Any, ...] | list[Any]], ttl: float | timedelta
    ) -> list[RedlockLease | None]:
        """One lock per distinct argument tuple of ``job``, each on a quorum (see ``Locks.dedupe``)."""
        return self._driver.drive(self._deduping(job, arg_tuples, ttl))

    @metrics.measured("release_many")
    def release_many(self, leases: Iterable[RedlockLease | None]) -> list[bool]:
        """Releases many leases on every server: ``[bool]``, True where a quorum still held it."""
        return self._driver.drive(self._releasing_many(leases))

    @metrics.measured("extend_many")
    def extend_many(self, leases: Iterable[RedlockLease | None], ttl: float | timedelta) -> list[bool]:
        """Resets many leases' ttl on every server: True where a quorum did so in time.

        A lease that fails is dropped on every server and is no longer held.
        """
        return self._driver.drive(self._extending_many(leases, ttl))

    def _release(self, lease: RedlockLease) -> bool:
        return self._driver.drive(self._releasing_one(lease))

    def _extend(self, lease: RedlockLease, ttl: float | timedelta) -> bool:
        return self._driver.drive(self._extending_one(lease, ttl))

    def _exit(self, lease: RedlockLease) -> None:
        if lease._held and not self._release(lease):
            logger.warning("lock %r expired or was taken before release", lease.key)
