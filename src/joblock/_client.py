"""What every lock client shares, whichever driver carries it out.

``Locks`` and ``joblock.aio.AsyncLocks`` (and their Redis Cluster kin) differ only
in how they wait for Redis. Everything else is here once: checking arguments,
building keys and operations, and the *plans* of calls that take more than one
operation (an acquire that waits, a batch that gives back its grants when it
fails). A plan is a generator that yields operations and is sent their results;
``Driver.drive`` carries it out with threads or with asyncio.
"""

from __future__ import annotations

import math
import os
import random
import socket
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from . import errors, lost
from ._core import core as _active_core
from ._core import name_of
from ._engine.batches import (
    Acquired,
    Batch,
    Router,
    Settled,
    acquire_chunks,
    acquire_form,
    dedupe_chunks,
    lease_chunks,
    script_form,
)
from ._engine.ops import EXTEND, AcquireOne, Operation, Pause, ScriptOne
from ._engine.replicas import Replicas
from ._engine.requests import Resolver, Target
from ._engine.sentinel import Primary
from ._engine.waits import Listen, Park, QueueOne, waiting
from ._scripts import EXTEND_SHA, RELEASE_SHA
from .settings import (
    MAX_REPLICAS,
    ConnectionOptions,
    Settings,
    check_bool,
    from_redis_options,
    parse_url,
    replica_timeout_error,
)

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

    from ._core_py import Lease

__all__ = [
    "ClientOptions",
    "FromRedisOptions",
    "LocksBase",
    "Plan",
    "backoff",
    "check_flags",
    "check_limit",
    "check_queueable",
    "check_replicas",
    "check_shared",
    "holder_suffix",
    "milliseconds",
    "queueable",
    "seconds",
]

# Longest ttl accepted: about 31 years, far below where Redis' PX would overflow.
MAX_SECONDS = 1e9

T = TypeVar("T")
# A plan yields operations, pauses and the steps of a wait, is sent each one's result
# (which depends on the operation, hence Any) and returns T.
Plan = Generator["Operation | Pause | Listen | Park", Any, T]


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
    if (type(ttl) is int or type(ttl) is float) and 0 < ttl <= MAX_SECONDS:  # the common case, checked
        return max(1, round(ttl * 1000))
    return max(1, round(seconds(ttl, "ttl") * 1000))


def backoff(patience: float) -> Iterator[float]:
    """Pauses between attempts to take a busy lock, until ``patience`` seconds are spent
    (Redlock's waits: its quorum has no one server to queue on).

    Jittered and growing (2 ms doubling to 100 ms): contenders spread out instead of
    polling in step.
    """
    deadline = time.monotonic() + patience
    delay = 0.002
    while (left := deadline - time.monotonic()) > 0:
        yield min(left, delay * random.uniform(0.5, 1.0))
        delay = min(delay * 2, 0.1)


_holder: list[bytes] = []  # this process's, once known; a forked child forgets it


def holder_suffix(counting: bool = False) -> bytes:
    """``@host:pid`` after each token, so `joblock inspect` can name a lock's holder; a
    counting lock's holder has ``~`` before it, which tells the release, extend and
    remaining scripts to look for its token in a sorted set."""
    if not _holder:
        host = socket.gethostname().encode("ascii", "replace").replace(b" ", b"_") or b"?"
        _holder.append(b"@%s:%d" % (host, os.getpid()))
    return b"~" + _holder[0] if counting else _holder[0]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_holder.clear)


class FromRedisOptions(ConnectionOptions, total=False):
    """The keyword options of ``from_redis``: the connection's and the keys per pipelined window."""

    window: int


class ClientOptions(FromRedisOptions, total=False):
    """The keyword options of a client: the connection's, the window and the key prefix."""

    prefix: str


# Most holders a counting lock may admit: each acquire reads them all (a fenced one
# looks for its own among them), so the bound keeps a script's work small.
MAX_LIMIT = 10_000


def check_limit(limit: object, name: str = "limit") -> int:
    """Checks ``limit``: 1 is a plain lock, N > 1 a counting lock of N holders."""
    if limit == 1 and type(limit) is int:  # the common case
        return 1
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"{name} must be an int, not {type(limit).__name__}")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"{name} must be between 1 and {MAX_LIMIT}, not {limit}")
    return limit


def check_flags(fence: object, fair: object = False, shared: object = False) -> None:
    """Checks an acquire's flags; callers skip it when all three are False (the common case)."""
    check_bool(fence, "fence")
    check_bool(fair, "fair")
    check_bool(shared, "shared")


def check_replicas(min_replicas: object) -> int:
    """Checks a call's ``min_replicas`` (how many replicas must confirm its grants)."""
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int):
        raise TypeError(f"min_replicas must be an int, not {type(min_replicas).__name__}")
    if not 0 <= min_replicas <= MAX_REPLICAS:
        raise ValueError(f"min_replicas must be between 0 and {MAX_REPLICAS}, not {min_replicas}")
    return min_replicas


def queueable(core: Any, raw: bytes) -> bool:
    """Whether waiters can queue for the lock at ``raw``: at a key of its hash slot, as
    its fencing counter is kept; a key with a "}" but no hash tag has none."""
    try:
        core.fence_key(raw)
    except ValueError:
        return False
    return True


def check_queueable(core: Any, raw: bytes, key: object) -> None:
    if not queueable(core, raw):
        raise ValueError(f"waiting for a lock needs a key without an unmatched '}}', not {key!r}")


def check_shared(limit: object, fence: object) -> int:
    """A reader's limit (0, as its queued request says): readers come in any number, and
    fencing numbers are for writers."""
    if limit != 1 or type(limit) is not int:
        raise ValueError(f"shared=True takes no limit (readers come in any number), not limit={limit!r}")
    if fence:
        raise ValueError("shared=True takes no fence: fencing numbers are for the writer")
    return 0


def check_prefix_and_window(prefix: object, window: object) -> None:
    """The options every client takes: the key prefix, and the keys per pipelined window."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be an int, not {type(window).__name__}")
    if not 1 <= window <= 100_000:
        raise ValueError(f"window must be between 1 and 100000, not {window}")


class LocksBase:
    """Settings, keys, operations and plans shared by every client of one server or cluster."""

    # The core this class uses; tests run every API test on each twin through it.
    _core = _active_core
    # Where batches go: one server here; a Redis Cluster client routes by hash slot.
    _router: Router = Router()
    # Whether the methods are coroutines (AsyncLocks and its kin).
    asynchronous = False

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "joblock",
        window: int = 1000,
        **options: Unpack[ConnectionOptions],
    ) -> None:
        check_prefix_and_window(prefix, window)
        self.settings: Settings = parse_url(url, **options)
        self.prefix = prefix
        self._prefix = self._core.as_key(prefix, "prefix") if prefix else b""
        self._window = window

    @classmethod
    def from_redis(cls, client: Any, *, prefix: str = "joblock", **options: Unpack[FromRedisOptions]) -> Self:
        """A client that reaches the same server, database and credentials as a redis-py client."""
        url, found = from_redis_options(client)
        found.update(options)
        return cls(url, prefix=prefix, **found)

    def _where(self) -> tuple[Callable[[Target], Settings], Resolver | None]:
        """Where the driver's connections go: the settings, or a Sentinel service's primary."""
        settings = self.settings
        if settings.service is None:
            return (lambda _: settings), None
        primary = Primary(self._core, settings)
        return primary.settings_for, primary

    @property
    def implementation(self) -> str:
        """The core this client runs on: ``"c"`` or ``"python"``."""
        return name_of(self._core)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.settings.url()} prefix={self.prefix!r} core={self.implementation}>"
        )

    def key(self, job: str, *args: Any, **kwargs: Any) -> str:
        """The lock key of ``job`` run with these arguments: ``prefix:job:identifier``.

        The same arguments give the same key in every process; different arguments
        never share one (``key("J", "a-b") != key("J", "a", "b")``). Identifiers over
        200 bytes become a 128-bit digest.
        """
        key: bytes = self._core.build_key(self._prefix, job, args, kwargs)
        return key.decode()

    # -- operations (arguments are checked as they are built, before anything is sent) -----

    def _one_acquire(
        self, raw: bytes, name: Any, value: bytes, ms: int, fence: bool, limit: int
    ) -> Operation:
        return AcquireOne(self, None, self._core, raw, name, value, ms, fence, limit, self.settings.retries)

    def _one_script(self, kind: str, lease: Any, arg: int | None) -> Operation:
        return ScriptOne(lease, None, self._core, kind, arg, self.settings.retries)

    def _acquire_op(self, key: str | bytes, ttl: object, fence: bool, limit: object) -> Operation:
        core = self._core
        raw = core.as_key(key)
        ms = milliseconds(ttl)
        n = check_limit(limit)
        if fence or n > 1:
            core.fence_key(raw)
        return self._one_acquire(raw, key, core.new_values(1, holder_suffix(n > 1))[0], ms, fence, n)

    def _lease_op(self, kind: str, lease: Any, ttl: object = None) -> Operation | None:
        """The release, extend or remaining of ``lease``; None when it is not held (nothing to ask)."""
        arg = milliseconds(ttl) if kind == EXTEND else None
        if type(lease) is not self._core.Lease:
            raise TypeError(f"lease must be a Lease, not {type(lease).__name__}")
        return self._one_script(kind, lease, arg) if lease._held else None

    def _acquire_batch(self, keys: Iterable[str | bytes], ttl: object, fence: bool, limit: object) -> Batch:
        check_bool(fence, "fence")
        ms = milliseconds(ttl)
        n = check_limit(limit)
        core = self._core
        source = acquire_chunks(core, keys, self._window, fence or n > 1, holder_suffix(n > 1))
        return self._batch(source, acquire_form(core, ms, fence, n), Acquired(self, core, fence, n))

    def _dedupe_batch(
        self, job: str, arg_tuples: Iterable[Any], ttl: object, fence: bool, limit: object
    ) -> Batch:
        check_bool(fence, "fence")
        ms = milliseconds(ttl)
        n = check_limit(limit)
        core = self._core
        source = dedupe_chunks(core, self._prefix, job, arg_tuples, self._window, holder_suffix(n > 1))
        return self._batch(source, acquire_form(core, ms, fence, n), Acquired(self, core, fence, n))

    def _script_batch(self, sha: bytes, leases: Iterable[Any], arg: int | None) -> Batch:
        core = self._core
        settled = Settled(core, release=sha == RELEASE_SHA)
        source = lease_chunks(core, leases, self._window, settled)
        return self._batch(source, script_form(core, sha, arg), settled)

    def _batch(self, source: Any, form: Any, collector: Acquired | Settled) -> Batch:
        return Batch(source, form, collector, self._router, self.settings.retries, self._window)

    # -- plans ---------------------------------------------------------------------------

    def _queue_target(self, raw: bytes) -> Target:
        """Where the queue of ``raw``'s waiters lives: the server of the lock key."""
        return None

    def _acquiring(
        self,
        key: str | bytes,
        ttl: object,
        wait: object,
        fence: bool,
        limit: object,
        fair: bool = False,
        shared: bool = False,
    ) -> Plan[Lease | None]:
        """acquire(..., wait=), fair and shared (reader's) acquires: queued in Redis until
        a release hands the lock over (see ``_engine.waits``), or until it would expire."""
        core = self._core
        raw = core.as_key(key)
        ms = milliseconds(ttl)
        n = check_shared(limit, fence) if shared else check_limit(limit)
        patience = 0.0 if wait is None else seconds(wait, "wait", allow_zero=True)
        check_queueable(core, raw, key)
        value = core.new_values(1, holder_suffix(n != 1))[0]
        first = QueueOne(
            self,
            self._queue_target(raw),
            core,
            raw,
            key,
            value,
            ms,
            fence,
            n,
            self.settings.retries,
            fair=fair,
        )
        if patience <= 0:  # no wait: fair ones and readers pass no waiter
            lease: Lease | None = yield first
            return lease
        return cast("Lease | None", (yield from waiting(first, patience)))

    def _watching(self, lease: Any) -> Plan[Any]:
        """The client's subscription on the lease's server, made if need be: an operator's
        release of the lease is heard there (``joblock.lost``)."""
        wakeups = yield Listen(self._queue_target(lease._key), key=lease._key, lost=True)
        return wakeups

    def _lost_signal(self, lease: Any) -> Any:
        """``lease.lost``, in the style of this client."""
        return lost.signal(lease, self.asynchronous)

    def _acquiring_many(
        self, batch: Batch, replicas: int = 0, ttl: object = None
    ) -> Plan[list[Lease | None]]:
        """A batch acquire that, when it fails, gives back what it was granted before raising;
        with ``replicas``, only once that many replicas confirmed its grants."""
        confirm = self._confirmer(batch, replicas)
        acquired: Acquired = yield batch
        if acquired.passthrough is not None:
            yield from self._releasing_quietly(acquired.granted())
            raise acquired.passthrough
        if acquired.failure is not None:
            unreleased = yield from self._releasing_quietly(acquired.granted())
            raise acquired.error(unreleased)
        if confirm is not None:
            yield from self._confirming(acquired.granted(), replicas, milliseconds(ttl), confirm)
        return acquired.out

    # -- min_replicas: grants confirmed by replicas (see _engine/replicas.py) -------------------

    def _replicas(self, min_replicas: object) -> int:
        """How many replicas a call's grants need: its own ``min_replicas``, else the client's."""
        return self.settings.min_replicas if min_replicas is None else check_replicas(min_replicas)

    def _confirmer(self, op: Operation, replicas: int) -> Replicas | None:
        """Has the wire write ``WAIT replicas`` behind ``op``'s requests: behind each of a
        single call's, behind a batch's last window to each server."""
        if replicas:
            settings = self.settings
            if settings.replica_timeout >= settings.socket_timeout:  # the default, on a short socket_timeout
                raise ValueError(replica_timeout_error(settings))
            batched = isinstance(op, Batch) and op.together
            op.replicas = Replicas(op, self._core, replicas, settings.replica_timeout, batched)
        return op.replicas

    def _confirmed(self, op: Operation, replicas: int, ttl: object, lease: Any = None) -> Plan[Any]:
        """A single acquire (or, given its ``lease``, extend) that hands out only what
        ``replicas`` replicas confirmed."""
        ms = milliseconds(ttl)
        confirm = self._confirmer(op, replicas)
        before = None if lease is None else [lease._deadline]
        result = yield op
        granted = result if lease is None else (lease if result else None)
        if granted is not None:
            yield from self._unconfirmed_back([granted], before, replicas, ms, confirm)
        return result

    def _confirmed_wait(self, plan: Plan[Lease | None], replicas: int, ttl: object) -> Plan[Lease | None]:
        """A waiting acquire that hands out only a lease ``replicas`` replicas confirmed.

        The lock may have been handed over by another client's release, whose write no
        WAIT of ours would count: the lease is confirmed by an extend and a WAIT behind it.
        """
        lease = yield from plan
        if lease is not None and replicas:
            yield from self._confirming([lease], replicas, milliseconds(ttl), None)
        return lease

    def _confirming(
        self, leases: list[Any], n: int, ms: int, confirm: Replicas | None, extend: bool = False
    ) -> Plan[None]:
        """Returns once ``n`` replicas confirmed ``leases`` (``confirm``: the WAITs behind
        their grants or extends; None: none that count). Else raises ReplicationError, a
        grant released first; an extend keeps its lock, confirmed until its previous expiry.

        A count that a broken connection hid (``unsure``) is learned again by an extend
        of the leases with WAIT behind it: the extend is a write on the connection the
        WAIT goes on, after the grants in the replication stream, so acknowledging it
        acknowledges them. Should the caller stop meanwhile, that extend gives the grants back.
        """
        if not leases:
            return
        refused = failure = None
        tries = self.settings.retries + 1
        while (confirm is None or confirm.unsure) and tries:
            if confirm is not None and confirm.refused is not None:  # WAIT not allowed (NOPERM)
                refused = confirm.refused
                break
            tries -= 1
            batch = self._script_batch(EXTEND_SHA, leases, ms)
            if not extend:
                batch.give_back = leases
            again = self._confirmer(batch, n)
            try:
                settled: Settled = yield batch
                verdicts = settled.result()
            except errors.ConnectionError:
                continue  # still unsure: try again while retries last
            except errors.JoblockError as e:  # the server refused the extend (OOM, READONLY)
                failure = e
                break
            confirm = again
            if confirm is not None and not all(verdicts):  # a lease lost meanwhile: unconfirmable
                confirm.unsure = False
                confirm.acks = 0
        if confirm is not None and confirm.confirmed and failure is None and refused is None:
            return
        unreleased = 0 if extend else (yield from self._releasing_quietly(leases))
        if refused is not None:
            raise errors.reply_error(refused.message, command="WAIT")
        acks = None if confirm is None or confirm.unsure else confirm.acks
        error = errors.ReplicationError(
            leases[0].key,
            acks,
            n,
            released=not extend and not unreleased,
            extend=extend,
            more=len(leases) - 1,
        )
        raise error from failure

    def _releasing_quietly(self, leases: list[Any]) -> Plan[int]:
        """Releases leases after a failure; returns how many could not be released."""
        if not leases:
            return 0
        try:
            settled: Settled = yield self._script_batch(RELEASE_SHA, leases, None)
            settled.result()
        except errors.JoblockError:
            return sum(1 for lease in leases if lease._held)
        return 0

    def _settling(
        self, sha: bytes, leases: Iterable[Any], ttl: object = None, replicas: int = 0
    ) -> Plan[list[bool]]:
        arg = None if sha == RELEASE_SHA else milliseconds(ttl)
        before = None
        if replicas:  # kept, to confirm the ones extended
            leases = list(leases)
            before = [lease._deadline if lease is not None else 0.0 for lease in leases]
        batch = self._script_batch(sha, leases, arg)
        confirm = self._confirmer(batch, replicas)
        settled: Settled = yield batch
        verdicts = settled.result()
        if confirm is not None and arg is not None and before is not None:
            kept = [(lease, was) for lease, was, ok in zip(cast(list[Any], leases), before, verdicts) if ok]
            extended = [lease for lease, _ in kept]
            yield from self._unconfirmed_back(extended, [was for _, was in kept], replicas, arg, confirm)
        return verdicts

    def _unconfirmed_back(
        self, leases: list[Any], before: list[float] | None, n: int, ms: int, confirm: Replicas | None
    ) -> Plan[None]:
        """``_confirming`` grants (``before`` None) or extends (their deadlines before): an
        extend the replicas did not acknowledge does not move its lease's deadline."""
        try:
            yield from self._confirming(leases, n, ms, confirm, extend=before is not None)
        except errors.ReplicationError:
            if before is not None:
                for lease, was in zip(leases, before):
                    lease._deadline = min(lease._deadline, was)
                    if lease._watch is not None:
                        lease._watch.moved(lease)
            raise

    def _releasing_many(self, leases: Iterable[Any]) -> Plan[list[bool]]:
        return self._settling(RELEASE_SHA, leases)

    def _extending_many(self, leases: Iterable[Any], ttl: object, replicas: int = 0) -> Plan[list[bool]]:
        return self._settling(EXTEND_SHA, leases, ttl, replicas)

    def _adopt(self, key: str | bytes, token: bytes) -> Lease:
        """A lease on a lock that another process took with ``token``; nothing is sent.

        Release and extend compare the token in Redis, so the adopted lease acts on the
        lock only while it is still that grant. The job adapters use it: a worker ends
        the lock its job's enqueuer took, knowing only the key and token that travelled
        with the job.
        """
        raw = self._core.as_key(key)
        if type(token) is not bytes:
            raise TypeError(f"token must be bytes, not {type(token).__name__}")
        if not token:
            raise ValueError("token must not be empty")
        # Its deadline is not known here (0.0) until an extend confirms it.
        leases, _ = self._core.make_leases(self, [raw], [key], [token], [b"OK"], 0.0)
        return cast("Lease", leases[0])  # an OK reply makes a Lease
