"""RQ jobs under joblock locks: ``@locked(locks, ttl=300)`` and ``enqueue(queue, func, ...)``.

``locked`` wraps a job function so that, run by any RQ worker (the forking
``Worker``, ``SimpleWorker``, ...), it takes or adopts its lock as its ``lifetime``
says (see ``joblock.frameworks``). ``enqueue`` is ``queue.enqueue`` that first takes
the lock of the until_* lifetimes and puts its ticket in the job's meta; a duplicate
is then not enqueued: ``enqueue`` returns None when skipped (or the ``on_conflict``
callable's value). ``enqueue_many`` is ``queue.enqueue_many`` that takes the locks of
all its jobs in one pipelined batch. A job enqueued with plain ``queue.enqueue`` takes
its lock when it starts instead.

Rescheduling enqueues a new job (its id is in the old one's meta under
``joblock_rescheduled_as``) for later, which needs a worker started with
``--with-scheduler`` (``Worker(..., with_scheduler=True)``). So does the debounce
lifetime: ``enqueue`` schedules each debounced job for its due time (``enqueue_at``),
its token in the meta; a superseded job finishes at the worker without running (its
return value None). A debounced job enqueued with plain ``queue.enqueue`` is
debounced when a worker first takes it, and scheduled again as a new job. A job that fails with
retries left (``retry=Retry(...)``), or returns ``Retry(...)``, keeps its lock for the
retried run.
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast, overload

import rq
from rq.job import Job, JobStatus
from rq.queue import EnqueueData

from .frameworks import (
    TICKET,
    WHILE_EXECUTING,
    Policy,
    Reschedule,
    Run,
    Ticket,
    Verdict,
    admit,
    admit_many,
    current_run,
)
from .jobs import LockedJob

if TYPE_CHECKING:
    from redis.client import Pipeline

    from .locks import Locks

__all__ = ["RESCHEDULED_AS", "enqueue", "enqueue_at", "enqueue_in", "enqueue_many", "locked"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

# The meta field of a job rescheduled by its lock's strategy: the id of the new job.
RESCHEDULED_AS = "joblock_rescheduled_as"


# A busy run returns on_conflict's result when it is a callable, else None (or raises).
@overload
def locked(
    locks: Locks | Callable[[], Locks],
    *,
    ttl: float,
    lifetime: str = ...,
    on_conflict: Callable[..., T],
    name: str | None = ...,
    identifier: Callable[..., object] | None = ...,
    key: Callable[..., str | bytes] | None = ...,
    on_expired: Callable[..., object] | None = ...,
    debounce: float | None = ...,
    debounce_max: float | None = ...,
    limit: int = ...,
    on_lost: str | Callable[..., object] | None = ...,
) -> Callable[[Callable[P, R]], LockedJob[P, R | T]]: ...
@overload
def locked(
    locks: Locks | Callable[[], Locks],
    *,
    ttl: float,
    lifetime: str = ...,
    on_conflict: str | Reschedule = ...,
    name: str | None = ...,
    identifier: Callable[..., object] | None = ...,
    key: Callable[..., str | bytes] | None = ...,
    on_expired: Callable[..., object] | None = ...,
    debounce: float | None = ...,
    debounce_max: float | None = ...,
    limit: int = ...,
    on_lost: str | Callable[..., object] | None = ...,
) -> Callable[[Callable[P, R]], LockedJob[P, R | None]]: ...
def locked(
    locks: Locks | Callable[[], Locks],
    *,
    ttl: float,
    lifetime: str = WHILE_EXECUTING,
    on_conflict: object = "skip",
    name: str | None = None,
    identifier: Callable[..., object] | None = None,
    key: Callable[..., str | bytes] | None = None,
    on_expired: Callable[..., object] | None = None,
    debounce: float | None = None,
    debounce_max: float | None = None,
    limit: int = 1,
    on_lost: str | Callable[..., object] | None = None,
) -> Callable[[Callable[P, R]], LockedJob[P, Any]]:
    """Makes a function an RQ job run under a joblock lock.

    ``locks``: a Locks, or a function returning one. ``ttl``: seconds the lock lives
    without its holder freeing it (a run extends it to a full ttl when it starts).
    ``lifetime``, ``on_conflict``: see ``joblock.frameworks``. ``name`` (default: the
    function's qualified name), ``identifier``, ``key`` and ``on_expired`` are those of
    ``@locks.job``. ``debounce`` and ``debounce_max`` (seconds): the ``"debounce"``
    lifetime's window and the longest a burst may postpone the run. ``limit``: up to
    this many jobs of one key hold its lock at once (a counting lock). ``on_lost``: what
    stops a run whose lock is lost while it runs: ``"exit"`` under the forking
    ``Worker`` (the work horse exits with ``joblock.lost.EXIT_STATUS`` after logging why;
    RQ fails the job, or retries it if it has retries left, and the worker goes on),
    ``"interrupt"`` under ``SimpleWorker`` or a thread of your own (LockLost is raised in
    the job), a callable given the job's arguments, or ``"ignore"`` (the default).
    """

    def decorate(fn: Callable[P, R]) -> LockedJob[P, Any]:
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
            raise TypeError(f"@locked takes plain functions: {fn.__qualname__}")
        policy = Policy(
            locks,
            ttl=ttl,
            name=name or fn.__qualname__,
            lifetime=lifetime,
            on_conflict=on_conflict,
            identifier=identifier,
            key=key,
            on_expired=on_expired,
            debounce=debounce,
            debounce_max=debounce_max,
            limit=limit,
            on_lost=on_lost,
            signature=inspect.signature(fn),
        )
        # RQ stores a function as "module.qualname" and the worker imports that: the
        # wrapper, which takes the original's names.
        path = f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            job = rq.get_current_job()
            outer = current_run()
            # Only the job's own function reads its ticket, not one it calls directly.
            mine = job is not None and job.func_name == path and (outer is None or outer.job_id != job.id)
            # A job of its own (mine) is a Job, not None.
            ticket = Ticket.load(cast(Job, job).meta.get(TICKET)) if mine else None
            run = Run(
                policy,
                ticket,
                args,
                kwargs,
                job_id=cast(Job, job).id if mine else None,
                can_reschedule=mine,
            )
            verdict = run.begin()
            if verdict is not None:
                if verdict.countdown is not None:
                    _reschedule(cast(Job, job), run, verdict)  # only its own job reschedules
                return verdict.value
            with run:
                try:
                    with run.guard():
                        result = fn(*args, **kwargs)
                except BaseException:
                    if mine and (getattr(job, "retries_left", None) or 0) > 0:
                        _keep(cast(Job, job), run)
                    raise
                # RQ >= 2 also retries a job that returns Retry(...).
                if (
                    mine
                    and isinstance(result, rq.Retry)
                    and (getattr(job, "number_of_retries", None) or 0) < result.max
                ):
                    _keep(cast(Job, job), run)
                return result

        # A function takes attributes; mypy knows none on one (LockedJob declares lock_key).
        wrapper.joblock_policy = policy  # type: ignore[attr-defined]
        wrapper.lock_key = lambda *args, **kwargs: policy.lock_key(args, kwargs)  # type: ignore[attr-defined]
        return cast("LockedJob[P, Any]", wrapper)

    return decorate


def _keep(job: Job, run: Run) -> None:
    # The worker saves the job it retries from this very object; save_meta also
    # covers versions that reload it first.
    job.meta[TICKET] = run.retry_ticket().dump()
    job.save_meta()  # type: ignore[no-untyped-call]  # RQ leaves save_meta unannotated
    run.keep()


def _reschedule(job: Job, run: Run, verdict: Verdict) -> Job:
    queue = rq.Queue(job.origin, connection=job.connection, serializer=job.serializer)
    meta = {k: v for k, v in job.meta.items() if k != RESCHEDULED_AS}
    meta[TICKET] = run.rescheduled(verdict.attempt).dump()
    options: dict[str, Any] = {
        "timeout": job.timeout,
        "result_ttl": job.result_ttl,
        "ttl": job.ttl,
        "failure_ttl": job.failure_ttl,
        "description": job.description,
        "meta": meta,
    }
    retries_left = getattr(job, "retries_left", None)
    if retries_left:
        options["retry"] = rq.Retry(max=retries_left, interval=list(job.retry_intervals or [0]))
    later = queue.create_job(job.func_name or "", args=job.args, kwargs=job.kwargs, **options)
    queue.schedule_job(later, _after(verdict.countdown or 0.0))
    job.meta[RESCHEDULED_AS] = later.id
    job.save_meta()  # type: ignore[no-untyped-call]  # as in _keep
    return later


def _after(countdown: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=countdown)


@functools.lru_cache(maxsize=8)
def _option_names(enqueue_call: Callable[..., Any]) -> frozenset[str]:
    # queue.enqueue takes RQ's own options among the job's keyword arguments; their
    # names are those of enqueue_call, but for "timeout", spelled "job_timeout" there.
    names = set(inspect.signature(enqueue_call).parameters) - {"self", "func", "args", "kwargs"}
    if "timeout" in names:
        names = (names - {"timeout"}) | {"job_timeout"}
    return frozenset(names)


def enqueue(queue: rq.Queue, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``queue.enqueue(func, *args, **kwargs)`` for a ``@locked`` function, taking its lock first.

    RQ's own options (``job_timeout``, ``retry``, ``meta``, ..., or explicit ``args=``
    and ``kwargs=``) are accepted as ``queue.enqueue`` takes them. Returns the Job, or
    (when the lock was busy) None for skip or the ``on_conflict`` callable's value;
    with a reschedule strategy, the Job scheduled for later.
    """
    return _enqueue(queue, None, func, args, kwargs)


def enqueue_at(queue: rq.Queue, when: datetime, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``queue.enqueue_at`` for a ``@locked`` function, taking its lock now (see ``enqueue``).

    The job waits in RQ's scheduled registry (run by ``--with-scheduler`` workers)
    with its lock held: give the lock a ttl that covers the wait.
    """
    return _enqueue(queue, when, func, args, kwargs)


def enqueue_in(
    queue: rq.Queue, delay: timedelta | float, func: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``queue.enqueue_in`` for a ``@locked`` function: ``delay`` is a timedelta or seconds."""
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    return _enqueue(queue, _after(seconds), func, args, kwargs)


def _policy(func: object) -> Policy:
    policy = getattr(func, "joblock_policy", None)
    if not isinstance(policy, Policy):
        raise TypeError(f"joblock.rq enqueues functions decorated with joblock.rq.locked, not {func!r}")
    return policy


def _enqueue(
    queue: rq.Queue,
    when: datetime | None,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    policy = _policy(func)
    names = _option_names(type(queue).enqueue_call)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    if "args" in kwargs or "kwargs" in kwargs:
        if args:
            raise TypeError("give the job's arguments positionally or as args=/kwargs=, not both")
        args = tuple(kwargs.pop("args", None) or ())
        kwargs = dict(kwargs.pop("kwargs", None) or {})
    admission = admit(policy, args, kwargs)
    if not admission.send:
        return cast(Verdict, admission.verdict).value  # not sent: a conflict's verdict
    meta = dict(options.pop("meta", None) or {})
    meta.pop(TICKET, None)
    if admission.ticket is not None:
        meta[TICKET] = admission.ticket.dump()
    if admission.verdict is not None:
        later = _after(admission.verdict.countdown or 0.0)
        # A naive datetime is local time to RQ, as to astimezone().
        when = later if when is None else max(when.astimezone(timezone.utc), later)
    try:
        if when is not None:
            return queue.enqueue_at(when, func, args=args, kwargs=kwargs, meta=meta, **options)
        return queue.enqueue(func, args=args, kwargs=kwargs, meta=meta, **options)
    except BaseException:
        admission.abandon()
        raise


def enqueue_many(
    queue: rq.Queue,
    job_datas: Iterable[EnqueueData | Sequence[Any]],
    pipeline: Pipeline | None = None,
) -> list[Any]:
    """``queue.enqueue_many(job_datas)`` for ``@locked`` functions, their locks taken in one batch.

    Each item is ``Queue.prepare_data(func, args, kwargs, ...)`` or a plain ``(func,
    args[, kwargs])``. The locks of the until_* lifetimes are taken with one pipelined
    ``acquire_many`` (per Locks and ttl) before anything is enqueued; the jobs whose
    lock was free go out with RQ's ``enqueue_many``, and each refused one meets its own
    ``on_conflict``. Returns one entry per item, in order: the Job; None for a skipped
    duplicate (also one earlier in the same batch) or the ``on_conflict`` callable's
    value; with a reschedule strategy, the Job scheduled for later. When a strategy
    raises, nothing is enqueued and the batch's locks are freed. ``pipeline`` is RQ's:
    given one, the jobs are written when its owner executes it.
    """
    datas = [_enqueue_data(item) for item in job_datas]
    admissions = admit_many((_policy(d.func), tuple(d.args or ()), dict(d.kwargs or {})) for d in datas)
    out: list[Any] = [None] * len(datas)
    now: list[tuple[int, EnqueueData]] = []
    later: list[tuple[int, EnqueueData, datetime]] = []
    for i, (data, admission) in enumerate(zip(datas, admissions)):
        if not admission.send:
            out[i] = cast(Verdict, admission.verdict).value  # not sent: a conflict's verdict
            continue
        meta = dict(data.meta or {})
        meta.pop(TICKET, None)
        if admission.ticket is not None:
            meta[TICKET] = admission.ticket.dump()
        # RQ returns the jobs of enqueue_many grouped by their dependencies, not in
        # order: an id of our own (a uuid4, as RQ gives) finds each one's place.
        data = data._replace(meta=meta, job_id=data.job_id or str(uuid.uuid4()))
        if admission.verdict is None:
            now.append((i, data))
        else:
            later.append((i, data, _after(admission.verdict.countdown or 0.0)))
    try:
        if now:
            place = {data.job_id: i for i, data in now}
            for job in queue.enqueue_many([data for _, data in now], pipeline=pipeline):
                out[place[job.id]] = job
        for i, data, when in later:
            out[i] = _schedule(queue, data, when, pipeline)
    except BaseException:
        for admission in admissions:
            admission.abandon()
        raise
    return out


def _enqueue_data(item: EnqueueData | Sequence[Any]) -> EnqueueData:
    if isinstance(item, EnqueueData):
        return item
    if isinstance(item, (tuple, list)) and 1 <= len(item) <= 3:
        return rq.Queue.prepare_data(*item)
    raise TypeError(f"enqueue_many takes Queue.prepare_data(...) or (func, args, kwargs) items, not {item!r}")


def _schedule(queue: rq.Queue, data: EnqueueData, when: datetime, pipeline: Pipeline | None) -> Job:
    # enqueue_many has no schedule: a job rescheduled at enqueue is created from its
    # data as enqueue_at would create it.
    options = {name: value for name, value in data._asdict().items() if name not in ("func", "at_front")}
    job = queue.create_job(data.func, status=JobStatus.SCHEDULED, **options)
    if data.at_front:
        job.enqueue_at_front = True
    return queue.schedule_job(job, when, pipeline=pipeline)
