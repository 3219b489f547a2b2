"""What the job-framework adapters (``joblock.celery``, ``joblock.rq``) share.

Lifetimes, in sidekiq-unique-jobs' words, say when a job's lock is taken and freed:

- ``while_executing`` (the default): the worker takes it when the run starts and
  frees it when the run ends; duplicates may queue, only one runs at a time.
- ``until_executing``: taken at enqueue, freed when the run starts; one copy waits
  in the queue at a time.
- ``until_executed``: taken at enqueue, freed when the run ends; duplicates are
  dropped while one is queued or running (the article's ProductSalesJob pile-up).
- ``until_expired``: taken at enqueue and left to expire: at most one enqueue per ttl.
- ``debounce``: no lock, but one run per burst of enqueues: each enqueue supersedes
  the pending one (its arguments win) and postpones the run to ``debounce`` seconds
  after it, or to ``debounce_max`` after the burst's first enqueue, whichever is
  sooner. The superseded messages are dropped at the worker, logged as such. Runs
  are not excluded from each other: a run that outlasts the window may overlap the
  next burst's.

``limit`` (default 1) makes a locking lifetime's lock a counting lock: up to
``limit`` jobs of one key hold it at once (at most N reports at a time, say), the
next one meets it busy and its ``on_conflict`` applies.

A lock taken at enqueue travels with the job as a *ticket* (a Celery message header,
an RQ job's meta): its key and token. The worker rebuilds the lease from them and
frees it with compare-and-delete, so it never deletes a lock that has since passed to
another holder. A retry's ticket carries the running job's lease, so a job's retry
never meets its own lock as a conflict. A debounced job's ticket carries its
enqueue's token: the worker runs the job only while that token is still the latest.

When the lock is busy, the job's ``on_conflict`` strategy decides: ``"skip"``
(logged), ``"raise"`` (LockNotAcquired), ``"reschedule"`` or a :class:`Reschedule`
(run again later, with jittered exponential backoff and a cap on attempts), or a
callable given the job's arguments, whose return value stands for the job's.

``on_lost`` (``lock_on_lost``) says what stops a run whose lock is lost while it runs
(its deadline passed unconfirmed, an operator released it, another holder took it: see
``joblock.lost``): ``"exit"`` ends the process running the job (a forked worker: Celery's
prefork child, RQ's work horse, a Huey process worker) with ``joblock.lost.EXIT_STATUS``
after logging why; ``"interrupt"`` raises LockLost in the thread running the job (a
thread worker's); ``"cancel"`` cancels the asyncio task running the job (arq, taskiq),
which ends with LockLost; a callable is given the job's arguments; ``"ignore"`` (the
default) watches nothing. Only a run that holds the lock has one to lose: the
while_executing and until_executed lifetimes.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import math
import random
import secrets
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from . import errors, lost, metrics
from ._client import LocksBase, check_limit, holder_suffix, milliseconds, seconds
from ._engine.ops import Call
from ._scripts import DEBOUNCE_CLAIM_SHA, DEBOUNCE_SHA, DEBOUNCE_UNDO_SHA
from .cluster import ClusterBase
from .jobs import describe, entered, key_function, left

if TYPE_CHECKING:
    from .aio import AsyncLocks
    from .locks import Lease, Locks

__all__ = [
    "DEBOUNCE",
    "LIFETIMES",
    "LOCK_OPTIONS",
    "TICKET",
    "UNTIL_EXECUTED",
    "UNTIL_EXECUTING",
    "UNTIL_EXPIRED",
    "WHILE_EXECUTING",
    "Admission",
    "Policy",
    "Reschedule",
    "Run",
    "Ticket",
    "Verdict",
    "admit",
    "admit_async",
    "admit_many",
    "check_on_lost",
    "current_run",
]

logger = logging.getLogger("joblock")

WHILE_EXECUTING = "while_executing"
UNTIL_EXECUTING = "until_executing"
UNTIL_EXECUTED = "until_executed"
UNTIL_EXPIRED = "until_expired"
DEBOUNCE = "debounce"
LIFETIMES = (WHILE_EXECUTING, UNTIL_EXECUTING, UNTIL_EXECUTED, UNTIL_EXPIRED, DEBOUNCE)

# The lock options an adapter reads off a task, actor or its labels (Celery, Dramatiq,
# taskiq), and the Policy argument each one sets; in the order of Policy's arguments.
LOCK_OPTIONS = {
    "lock_ttl": "ttl",
    "lock_lifetime": "lifetime",
    "lock_on_conflict": "on_conflict",
    "lock_name": "name",
    "lock_identifier": "identifier",
    "lock_key": "key",
    "lock_on_expired": "on_expired",
    "lock_debounce": "debounce",
    "lock_debounce_max": "debounce_max",
    "lock_limit": "limit",
    "lock_on_lost": "on_lost",
}

# The name of the ticket in a Celery message's headers and in an RQ job's meta.
TICKET = "joblock"

T = TypeVar("T")

# Lock logic that both kinds of client share is written once, as a generator that
# yields each client call it makes and is sent back its result: a threaded client's
# calls return results, an asyncio client's return awaitables that the driver awaits.
Steps = Generator[Any, Any, T]


def _through(steps: Steps[T]) -> T:
    result = None
    try:
        while True:
            result = steps.send(result)
    except StopIteration as done:
        return cast(T, done.value)


async def _awaiting(steps: Steps[T]) -> T:
    result = None
    while True:
        try:
            call = steps.send(result)
        except StopIteration as done:
            return cast(T, done.value)
        try:
            # A hook (on_expired) given to an asyncio adapter may be a coroutine function.
            result = await call if inspect.isawaitable(call) else call
        except BaseException:
            steps.close()
            raise


_run: contextvars.ContextVar[Run | None] = contextvars.ContextVar("joblock_run", default=None)


def current_run() -> Run | None:
    """The locked job run in progress in this context (the adapters spot retries with it)."""
    return _run.get()


@dataclass(frozen=True)
class Reschedule:
    """The ``reschedule`` strategy: run the job again later, up to ``max_attempts`` times.

    Attempt n waits ``delay * factor ** (n - 1)`` seconds, at most ``max_delay``, less
    a random share of up to ``jitter`` of it, so that duplicates rescheduled together
    spread out instead of colliding again in step. After ``max_attempts`` the job is
    given up as ``then`` says: ``"skip"`` (logged) or ``"raise"`` (LockNotAcquired).
    """

    delay: float = 60.0
    factor: float = 2.0
    max_delay: float = 3600.0
    jitter: float = 0.5
    max_attempts: int = 10
    then: str = "skip"

    def __post_init__(self) -> None:
        seconds(self.delay, "delay")
        seconds(self.max_delay, "max_delay")
        if self.max_delay < self.delay:
            raise ValueError(f"max_delay ({self.max_delay!r}) must be at least delay ({self.delay!r})")
        for name in ("factor", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, not {type(value).__name__}")
        if not (math.isfinite(self.factor) and self.factor >= 1):
            raise ValueError(f"factor must be a finite number >= 1, not {self.factor!r}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be between 0 and 1, not {self.jitter!r}")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise TypeError(f"max_attempts must be an int, not {type(self.max_attempts).__name__}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {self.max_attempts}")
        if self.then not in ("skip", "raise"):
            raise ValueError(f"then must be 'skip' or 'raise', not {self.then!r}")

    def countdown(self, attempt: int) -> float:
        """Seconds to wait before reschedule number ``attempt`` (the first is 1)."""
        try:
            step = self.delay * self.factor ** (attempt - 1)
        except OverflowError:
            step = math.inf
        return min(self.max_delay, step) * (1.0 - self.jitter * random.random())


def _debounce_options(
    lifetime: str, debounce: object, debounce_max: object, prefix: str
) -> tuple[float | None, float | None]:
    """The debounce lifetime's window and cap, checked; (None, None) for the other lifetimes."""
    name, name_max = f"{prefix}debounce", f"{prefix}debounce_max"
    if lifetime != DEBOUNCE:
        if debounce is not None or debounce_max is not None:
            given = name if debounce is not None else name_max
            raise ValueError(f"{given} is for {prefix}lifetime={DEBOUNCE!r}, not {lifetime!r}")
        return None, None
    if debounce is None:
        raise ValueError(
            f"{prefix}lifetime={DEBOUNCE!r} needs {name}: the seconds to wait after the last enqueue"
        )
    window = seconds(debounce, name)
    if debounce_max is None:
        return window, None
    cap = seconds(debounce_max, name_max)
    if cap < window:
        raise ValueError(f"{name_max} ({debounce_max!r}) must be at least {name} ({debounce!r})")
    return window, cap


def _strategy(on_conflict: object) -> str | Reschedule | Callable[..., Any]:
    if on_conflict == "reschedule":
        return Reschedule()
    if isinstance(on_conflict, Reschedule) or on_conflict in ("skip", "raise"):
        return on_conflict
    if callable(on_conflict):
        return on_conflict
    raise ValueError(
        f"on_conflict must be 'skip', 'raise', 'reschedule', a Reschedule or a callable, not {on_conflict!r}"
    )


# The lifetimes whose run holds the lock, and so may lose it.
GUARDED_LIFETIMES = (WHILE_EXECUTING, UNTIL_EXECUTED)


def check_on_lost(on_lost: object, lifetime: str, asynchronous: bool, prefix: str = "") -> Any:
    """A job's ``on_lost`` checked: its strategy (a name or a callable), or None for
    "ignore" (nothing watched). The error names the option as the adapter spells it."""
    if on_lost is None or (isinstance(on_lost, str) and on_lost == "ignore"):
        return None
    strategy = lost.check_on_lost(on_lost, asynchronous, f"{prefix}on_lost")
    if lifetime in LIFETIMES and lifetime not in GUARDED_LIFETIMES:
        raise ValueError(
            f"{prefix}on_lost is for a run that holds its lock ({prefix}lifetime={WHILE_EXECUTING!r} or "
            f"{UNTIL_EXECUTED!r}); a run of {lifetime!r} holds none"
        )
    return strategy


class Policy:
    """One job's lock settings, checked once: which key, how long, when, and what on conflict.

    ``locks`` is a Locks, or a function returning one, called when a lock is needed
    (so the job module can be imported before the application configures Redis).
    ``signature`` binds the job's arguments for the default key, as ``@locks.job`` does.
    ``debounce`` and ``debounce_max`` (seconds) belong to the debounce lifetime; its
    ``ttl`` is how long past its due time a debounced message may wait in the queue
    and still be recognised. ``on_lost``: what stops a run whose lock is lost (see the
    module). ``option_prefix`` is how the adapter's users spell the options (``"lock_"``
    for ``lock_debounce``), for the errors to name them so.
    """

    def __init__(
        self,
        locks: Locks | AsyncLocks | Callable[[], Locks | AsyncLocks],
        *,
        ttl: float,
        name: str,
        lifetime: str = WHILE_EXECUTING,
        on_conflict: object = "skip",
        identifier: Callable[..., object] | None = None,
        key: Callable[..., str | bytes] | None = None,
        on_expired: Callable[..., object] | None = None,
        debounce: float | None = None,
        debounce_max: float | None = None,
        limit: int = 1,
        on_lost: object = None,
        signature: inspect.Signature | None = None,
        asynchronous: bool = False,
        option_prefix: str = "",
    ) -> None:
        self.asynchronous = asynchronous
        self.lifetime = lifetime
        if locks is None or not (isinstance(locks, LocksBase) or callable(locks)):
            raise TypeError(
                f"locks must be a {self._kind} or a function returning one, not {type(locks).__name__}"
            )
        if isinstance(locks, LocksBase):
            self._check(locks, "locks")
        self.ttl = seconds(ttl, "ttl")
        if lifetime not in LIFETIMES:
            raise ValueError(f"lifetime must be one of {', '.join(LIFETIMES)}, not {lifetime!r}")
        self.debounce, self.debounce_max = _debounce_options(lifetime, debounce, debounce_max, option_prefix)
        self.limit = check_limit(limit, f"{option_prefix}limit")
        if self.limit > 1 and lifetime == DEBOUNCE:
            # A debounced run holds no lock: there is nothing to count.
            raise ValueError(f"{option_prefix}limit is for the locking lifetimes, not {DEBOUNCE!r}")
        self.on_lost = check_on_lost(on_lost, lifetime, asynchronous, option_prefix)
        for label, hook in (("identifier", identifier), ("key", key), ("on_expired", on_expired)):
            if hook is not None and not callable(hook):
                raise TypeError(f"{label} must be callable, not {type(hook).__name__}")
        if identifier is not None and key is not None:
            raise ValueError("give identifier or key, not both")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, not {name!r}")
        self._locks = locks
        self.name = name
        self.on_conflict = _strategy(on_conflict)
        self.on_expired = on_expired
        self._key = key_function(lambda: self.locks, name, signature, False, identifier, key)

    @property
    def _kind(self) -> str:
        return "AsyncLocks (joblock.aio)" if self.asynchronous else "Locks"

    def _check(self, locks: LocksBase, what: str) -> None:
        # An adapter of a threaded framework given an AsyncLocks would take the
        # coroutine its acquire returns for a granted lock.
        if locks.asynchronous != self.asynchronous:
            raise TypeError(f"{what} must be a {self._kind}, not {type(locks).__name__}")
        # A debounced enqueue's script goes to the one server of the client (a cluster
        # client would have to route it by slot, which this adapter does not do).
        if self.lifetime == DEBOUNCE and isinstance(locks, ClusterBase):
            raise TypeError(f"the debounce lifetime needs a client of one server, not {type(locks).__name__}")

    @property
    def locks(self) -> Locks | AsyncLocks:
        if isinstance(self._locks, LocksBase):
            return self._locks
        locks = self._locks()
        if not isinstance(locks, LocksBase):
            raise TypeError(f"the locks function returned {type(locks).__name__}, not a {self._kind}")
        self._check(locks, "the locks function's result")
        return locks

    @property
    def at_enqueue(self) -> bool:
        """Whether enqueueing the job goes to Redis first (every lifetime but while_executing)."""
        return self.lifetime != WHILE_EXECUTING

    def lock_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | bytes:
        return self._key(args, kwargs)

    def __repr__(self) -> str:
        return f"<Policy {self.name!r} {self.lifetime} ttl={self.ttl}>"


@dataclass
class Ticket:
    """What travels with a job about its lock.

    ``token`` is set while the job owns the lock (taken at enqueue, or kept by a
    retry); ``started`` marks a retry's ticket (the run began once already);
    ``attempt`` counts the reschedules so far.
    """

    key: str | bytes | None = None
    token: bytes | None = None
    started: bool = False
    attempt: int = 0

    def dump(self) -> dict[str, Any]:
        """A JSON-safe dict: bytes travel as latin-1 text, which maps each byte to one character."""
        out: dict[str, Any] = {"v": 1, "attempt": self.attempt}
        if isinstance(self.key, bytes):
            out["key"] = self.key.decode("latin-1")
            out["key_bytes"] = True
        elif self.key is not None:
            out["key"] = self.key
        if self.token is not None:
            out["token"] = self.token.decode("latin-1")
        if self.started:
            out["started"] = True
        return out

    @classmethod
    def load(cls, data: object) -> Ticket | None:
        """The ticket in ``data``; None when there is none or it is not one this version reads."""
        if not isinstance(data, dict) or data.get("v") != 1:
            if data is not None:
                logger.warning("joblock: ignoring a job's unreadable lock ticket %r", data)
            return None
        key = data.get("key")
        token = data.get("token")
        attempt = data.get("attempt", 0)
        if (
            (key is not None and not isinstance(key, str))
            or (token is not None and not isinstance(token, str))
            or not isinstance(attempt, int)
        ):
            logger.warning("joblock: ignoring a job's malformed lock ticket %r", data)
            return None
        return cls(
            key=key.encode("latin-1") if key is not None and data.get("key_bytes") else key,
            token=None if token is None else token.encode("latin-1"),
            started=bool(data.get("started", False)),
            attempt=attempt,
        )


@dataclass
class Verdict:
    """What a conflict came to: ``value`` stands for the job's result, unless ``countdown``
    says to run the job again that many seconds later (as reschedule ``attempt``)."""

    value: Any = None
    countdown: float | None = None
    attempt: int = 0


def conflict(
    policy: Policy,
    key: str | bytes,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    attempt: int,
    queued: bool,
    can_reschedule: bool = True,
) -> Verdict:
    """Applies the job's ``on_conflict`` strategy to a busy lock; ``queued``: at enqueue."""
    strategy = policy.on_conflict
    shown = describe(args, kwargs)
    if isinstance(strategy, Reschedule):
        if can_reschedule and attempt < strategy.max_attempts:
            countdown = strategy.countdown(attempt + 1)
            logger.info(
                "Job locked: %s with %s; rescheduled in %.3f s (attempt %d of %d)",
                policy.name, shown, countdown, attempt + 1, strategy.max_attempts,
            )  # fmt: skip
            return Verdict(countdown=countdown, attempt=attempt + 1)
        if can_reschedule:
            logger.info("Job %s with %s: lock still busy after %d reschedules", policy.name, shown, attempt)
        strategy = strategy.then
    if strategy == "raise":
        raise errors.LockNotAcquired(key)
    if strategy == "skip":
        # The article's words; "queued" for a duplicate dropped at enqueue.
        state = "queued" if queued else "running"
        logger.info("Job already %s: %s with %s", state, policy.name, shown)
        return Verdict()
    return Verdict(value=cast("Callable[..., object]", strategy)(*args, **kwargs))  # not skip nor raise


@dataclass
class Admission:
    """The outcome of enqueueing a job: send it with ``ticket`` (None: no ticket), after
    ``verdict.countdown`` when rescheduled or debounced; not at all when ``verdict`` has
    no countdown. ``superseded``: the debounced enqueue's policy and the token of the
    message it superseded (b"" for none), which ``abandon`` makes pending again."""

    ticket: Ticket | None = None
    lease: Lease | None = None
    verdict: Verdict | None = None
    superseded: tuple[Policy, bytes] | None = None

    @property
    def send(self) -> bool:
        return self.verdict is None or self.verdict.countdown is not None

    def abandon(self) -> None:
        """Frees the lock taken for a job whose message could not be sent."""
        _through(self._abandoning())

    async def abandon_async(self) -> None:
        """``abandon`` for a lock of an AsyncLocks."""
        await _awaiting(self._abandoning())

    def _abandoning(self) -> Steps[None]:
        try:
            if self.lease is not None:
                yield self.lease.release()
            elif self.superseded is not None and self.ticket is not None and self.ticket.token is not None:
                policy, previous = self.superseded
                assert self.ticket.key is not None  # a debounced ticket names its key
                yield _script(policy, DEBOUNCE_UNDO_SHA, self.ticket.key, self.ticket.token, previous)
        except errors.JoblockError as e:
            logger.warning("joblock could not free an unsent job's lock (it expires at its ttl): %s", e)


def _script(policy: Policy, sha: bytes, key: str | bytes, *args: bytes | int) -> Any:
    """One EVALSHA of a debounce script on the policy's client: its replies (an awaitable
    with an AsyncLocks). Each script answers a retry after a lost reply as it did the
    first time, so the client may send it again."""
    locks = policy.locks
    core = locks._core
    command = (b"EVALSHA", sha, 1, core.as_key(key), *args)
    return locks._driver.run(
        Call(None, core, [command], locks.settings.retries, idempotent=True, scripted=True)
    )


def _debouncing(
    policy: Policy, key: str | bytes, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Steps[Admission]:
    """A debounced enqueue: a fresh token supersedes the pending message; the new one goes
    out after the delay the server worked out."""
    token = secrets.token_hex(16).encode() + holder_suffix()  # a lock's token, as `joblock inspect` reads it
    cap = 0 if policy.debounce_max is None else milliseconds(policy.debounce_max)
    ms = milliseconds(policy.debounce)
    replies = yield _script(policy, DEBOUNCE_SHA, key, token, ms, cap, milliseconds(policy.ttl))
    delay, previous = replies[0]
    logger.debug(
        "Job %s with %s: debounced, runs in %.3f s unless a later enqueue supersedes it%s",
        policy.name, describe(args, kwargs), delay / 1000, "" if previous is None else " (superseding one)",
    )  # fmt: skip
    return Admission(Ticket(key, token), None, Verdict(countdown=delay / 1000), (policy, previous or b""))


def admit(policy: Policy, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Admission:
    """Enqueue-time locking: takes the lock of the until_* lifetimes, or applies on_conflict;
    debounces a debounce job."""
    return _through(_admitting(policy, args, kwargs))


async def admit_async(policy: Policy, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Admission:
    """``admit`` for a Policy on an AsyncLocks (the asyncio adapters)."""
    return await _awaiting(_admitting(policy, args, kwargs))


def _admitting(policy: Policy, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Steps[Admission]:
    if not policy.at_enqueue:
        return Admission()
    key = policy.lock_key(args, kwargs)
    if policy.lifetime == DEBOUNCE:
        return (yield from _debouncing(policy, key, args, kwargs))
    # The job stays set while the step is suspended, so an asyncio client's awaited acquire counts too.
    with metrics.job(policy.name):
        lease = yield cast("Locks", policy.locks).acquire(key, policy.ttl, limit=policy.limit)  # either kind
    return _admitted(policy, key, lease, args, kwargs)


def _admitted(
    policy: Policy, key: str | bytes, lease: Lease | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Admission:
    if lease is not None:
        return Admission(Ticket(key, lease.token), lease)
    verdict = conflict(policy, key, args, kwargs, 0, queued=True)
    # A rescheduled job goes without a token: it takes the lock when it starts.
    ticket = None if verdict.countdown is None else Ticket(key, attempt=verdict.attempt)
    return Admission(ticket, None, verdict)


def admit_many(jobs: Iterable[tuple[Policy, tuple[Any, ...], dict[str, Any]]]) -> list[Admission]:
    """``admit`` for a bulk enqueue of ``(policy, args, kwargs)``: one Admission per job, in order.

    The until_* locks are taken with one pipelined ``acquire_many`` per Locks and ttl
    (one for a batch of the same job); the same key twice in a batch: the first wins
    and the others meet it as a conflict. ``on_conflict`` then runs for the refused
    ones in order. Debounced jobs are debounced one by one, in order (the same key
    twice: the later supersedes the earlier). When a strategy raises, every lock the
    batch took is freed first, so that no job it leaves unsent holds one.
    """
    jobs = list(jobs)
    keys: dict[int, str | bytes] = {}
    # (id of the Locks, ttl, limit) -> the Locks, and the indexes of its jobs in ``jobs``.
    batches: dict[tuple[int, float, int], tuple[Locks, list[int]]] = {}
    for i, (policy, args, kwargs) in enumerate(jobs):
        if policy.at_enqueue and policy.lifetime != DEBOUNCE:
            keys[i] = policy.lock_key(args, kwargs)
            locks = cast("Locks", policy.locks)
            batches.setdefault((id(locks), policy.ttl, policy.limit), (locks, []))[1].append(i)
    leases: dict[int, Lease | None] = {}
    admissions: list[Admission] = []
    try:
        for (_, ttl, limit), (locks, where) in batches.items():
            leases.update(zip(where, locks.acquire_many([keys[i] for i in where], ttl, limit=limit)))
        for i, (policy, args, kwargs) in enumerate(jobs):
            if i in keys:
                admissions.append(_admitted(policy, keys[i], leases[i], args, kwargs))
            else:
                admissions.append(admit(policy, args, kwargs))
        return admissions
    except BaseException:
        for lease in leases.values():
            Admission(lease=lease).abandon()
        for admission in admissions:
            if admission.lease is None:  # the leases went back just now
                admission.abandon()
        raise


class Run:
    """One run of a locked job at the worker: ``begin()``, then ``with run:`` around the body
    (with an AsyncLocks: ``await begin_async()``, then ``async with run:``).

    ``begin`` adopts the lock that came with the job or takes it, as the lifetime
    says; ``None`` means go ahead, a Verdict that the lock was busy (or, debounced,
    that a later enqueue superseded the job, or that the job came without a token and
    was debounced now: run it again after ``countdown``). Leaving the ``with`` block
    frees the lock of while_executing and until_executed, unless a retry took it
    along (``retry_ticket``).
    """

    def __init__(
        self,
        policy: Policy,
        ticket: Ticket | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        job_id: str | None = None,
        can_reschedule: bool = True,
    ) -> None:
        self.policy = policy
        self.ticket = ticket
        self.args = args
        self.kwargs = kwargs
        self.job_id = job_id
        self.can_reschedule = can_reschedule
        self.key: str | bytes | None = None
        self.lease: Lease | None = None
        # The token of a debounced run, or of the job debounced at the worker.
        self.debounced: bytes | None = None
        self.kept = False
        self._tokens: tuple[contextvars.Token[Any], contextvars.Token[Run | None]] | None = None

    def begin(self) -> Verdict | None:
        return _through(self._beginning())

    async def begin_async(self) -> Verdict | None:
        return await _awaiting(self._beginning())

    def _beginning(self) -> Steps[Verdict | None]:
        policy = self.policy
        lifetime = policy.lifetime
        ticket = self.ticket
        key = ticket.key if ticket is not None and ticket.key is not None else None
        self.key = key = policy.lock_key(self.args, self.kwargs) if key is None else key
        if lifetime == DEBOUNCE:
            return (yield from self._claiming(key))
        locks = cast("Locks", policy.locks)  # its calls' results come back from yield, either kind
        lease: Lease | None
        if ticket is not None and ticket.token is not None:
            lease = locks._adopt(key, ticket.token)
            if lifetime == UNTIL_EXECUTING:
                yield lease.release()  # False when it expired in the queue: nothing to free then
                return None
            if lifetime == UNTIL_EXPIRED:
                return None
            # until_executed, or a retry that kept its lock: the run gets a full ttl.
            if (yield lease.extend(policy.ttl)):
                self.lease = lease
                return None
            logger.warning(
                "Job %s: its lock %r expired or was taken before the run started", policy.name, key
            )
        elif ticket is not None and ticket.started and lifetime in (UNTIL_EXECUTING, UNTIL_EXPIRED):
            return None  # a retry: the lock did its work at the first enqueue
        # No lock came with the job: while_executing, a rescheduled job, a lost lock, or
        # a job enqueued around the adapter (Celery's send_task, beat): it is taken now.
        with metrics.job(policy.name):
            lease = yield locks.acquire(key, policy.ttl, limit=policy.limit)
        if lease is None:
            attempt = 0 if ticket is None else ticket.attempt
            return conflict(policy, key, self.args, self.kwargs, attempt, False, self.can_reschedule)
        if lifetime == UNTIL_EXECUTING:
            yield lease.release()
        elif lifetime != UNTIL_EXPIRED:
            self.lease = lease
        return None

    def _claiming(self, key: str | bytes) -> Steps[Verdict | None]:
        policy = self.policy
        token = None if self.ticket is None else self.ticket.token
        if token is None:
            # Enqueued around the adapter (Celery's send_task, RQ's queue.enqueue): it is
            # debounced now and sent again for later; a direct call just runs.
            if not self.can_reschedule:
                return None
            admission = yield from _debouncing(policy, key, self.args, self.kwargs)
            self.debounced = cast(Ticket, admission.ticket).token
            return admission.verdict
        replies = yield _script(policy, DEBOUNCE_CLAIM_SHA, key, token, milliseconds(policy.ttl))
        claim = replies[0]
        if claim == -1:
            logger.info(
                "Job superseded: %s with %s (a later enqueue runs instead)",
                policy.name,
                describe(self.args, self.kwargs),
            )
            return Verdict()
        if claim == 0:
            logger.warning(
                "Job %s: its debounce key %r had expired (the job waited longer than its ttl past its due "
                "time); it runs, but may not be the burst's last enqueue",
                policy.name, key,
            )  # fmt: skip
        self.debounced = token
        return None

    def rescheduled(self, attempt: int) -> Ticket:
        """The ticket of this job sent again later as reschedule ``attempt`` (a job debounced
        at the worker: with its token)."""
        return Ticket(self.key, self.debounced, attempt=attempt)

    def retry_ticket(self) -> Ticket:
        """The ticket of this job's retry: it carries the lease (or the debounced token) along."""
        attempt = 0 if self.ticket is None else self.ticket.attempt
        token = self.debounced if self.lease is None else self.lease.token
        return Ticket(self.key, token, started=True, attempt=attempt)

    def guard(self) -> Any:
        """What stops the run's body once its lock is lost (the policy's ``on_lost``): a
        context manager (``async with`` on an AsyncLocks) around the body alone, entered
        in the thread or the task that runs it; it does nothing when nothing is watched.

        The body ends with LockLost once the lock is lost ("interrupt", "cancel"), or its
        process exits ("exit"); a callable is given the job's arguments and the body goes on.
        """
        strategy = self.policy.on_lost
        lease = self.lease
        if strategy is None or lease is None:
            return contextlib.nullcontext()
        if callable(strategy):
            hook, args, kwargs = strategy, self.args, self.kwargs
            strategy = lambda _lease: hook(*args, **kwargs)  # noqa: E731  # given the job's arguments
        guard = lost.AsyncGuard if self.policy.asynchronous else lost.Guard
        return guard(lease._owner, lease, strategy)

    def keep(self) -> None:
        """The retry's message is out: the lock stays for it instead of being freed."""
        self.kept = self.lease is not None

    def __enter__(self) -> Run:
        self._tokens = (entered(self.lease), _run.set(self))
        return self

    def __exit__(self, *exc_info: object) -> None:
        _through(self._ending())

    async def __aenter__(self) -> Run:
        return self.__enter__()

    async def __aexit__(self, *exc_info: object) -> None:
        await _awaiting(self._ending())

    def _ending(self) -> Steps[None]:
        if self._tokens is not None:
            _run.reset(self._tokens[1])
            left(self._tokens[0])
            self._tokens = None
        lease = self.lease
        if lease is None or self.kept:
            return
        if not (yield lease.release()):
            # Another run may have held the lock while this one finished.
            if self.policy.on_expired is not None:
                yield self.policy.on_expired(*self.args, **self.kwargs)
            else:
                logger.warning(
                    "Job %s finished after its lock %r expired or was taken", self.policy.name, lease.key
                )
