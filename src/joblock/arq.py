"""arq functions under joblock locks: ``@locked(locks, ttl=300)`` and ``enqueue(redis, func, ...)``.

arq's own ``_job_id`` keeps an id taken until the job's result expires; a joblock lock
is freed when its lifetime says (see ``joblock.frameworks``). ``locks`` is an
``AsyncLocks`` (joblock.aio), or a function returning one.

``locked`` wraps an ``async def f(ctx, ...)`` arq function: run by an arq worker, it
takes or adopts its lock as its ``lifetime`` says; the key is built from the arguments
after ``ctx``. List the wrapped function in ``WorkerSettings.functions`` as it is (arq
names it by its qualified name). ``enqueue`` is ``redis.enqueue_job`` that first takes
the lock of the until_* lifetimes and sends its ticket along as the keyword argument
``joblock`` (the wrapper takes it off before the function sees its arguments); a
duplicate is then not enqueued: ``enqueue`` returns None when skipped (or the
``on_conflict`` callable's value). A job enqueued with plain ``enqueue_job`` takes its
lock when it starts instead. Rescheduling enqueues the job again (a new job id) with
``_defer_by``, on the queue of the worker that met the lock.

``lifetime="debounce"`` (with ``debounce=`` seconds and optionally ``debounce_max=``):
``enqueue`` sends every job, deferred with ``_defer_by`` by the delay the server gives
it; a job superseded by a later enqueue of its key is dropped when its time comes, so a
burst runs once, with the last arguments. ``limit=N`` lets N holders of a key at once.

A run that raises arq's ``Retry`` keeps its lock for the retry: arq runs the same job
again and keeps no state for it but the job's own data, so the retry's ticket (the
lock's token) waits in arq's Redis under ``joblock:arq:retry:<job id>`` for the next
try, which takes it and goes on under the same lock. On the last try (``max_tries``)
the lock is freed, since arq will not run the job again.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from arq.worker import Retry

from .frameworks import TICKET, WHILE_EXECUTING, Policy, Run, Ticket, Verdict, admit_async

if TYPE_CHECKING:
    from arq.connections import ArqRedis
    from arq.jobs import Job

    from .aio import AsyncLocks

__all__ = ["enqueue", "locked"]

logger = logging.getLogger("joblock")

# enqueue_job's own options, passed through as given.
_ARQ_OPTIONS = frozenset({"_job_id", "_queue_name", "_defer_until", "_defer_by", "_expires", "_job_try"})
# arq's Worker(max_tries=...) when neither WorkerSettings nor arq.func change it.
ARQ_MAX_TRIES = 5


async def _value(verdict: Verdict) -> Any:
    # on_conflict may be a coroutine function: its result stands for the job's.
    value = verdict.value
    return await value if inspect.isawaitable(value) else value


def locked(
    locks: AsyncLocks | Callable[[], AsyncLocks],
    *,
    ttl: float,
    lifetime: str = WHILE_EXECUTING,
    on_conflict: object = "skip",
    name: str | None = None,
    identifier: Callable[..., object] | None = None,
    key: Callable[..., str | bytes] | None = None,
    on_expired: Callable[..., object] | None = None,
    max_tries: int = ARQ_MAX_TRIES,
    debounce: float | None = None,
    debounce_max: float | None = None,
    limit: int = 1,
    on_lost: str | Callable[..., object] | None = None,
) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """Makes an ``async def f(ctx, ...)`` an arq function run under a joblock lock.

    ``ttl``: seconds the lock lives without its holder freeing it (a run extends it to
    a full ttl when it starts). ``lifetime``, ``on_conflict``: see
    ``joblock.frameworks``. ``name`` (default: the function's qualified name),
    ``identifier``, ``key`` (given the arguments after ``ctx``) and ``on_expired``
    (may be async) are those of ``@locks.job``. ``max_tries``: the tries arq gives the
    function (its ``WorkerSettings.max_tries`` or ``arq.func(..., max_tries=)``; arq's
    default is 5): a ``Retry`` raised before the last try keeps the lock for the retry,
    one raised at the last try frees it. Give 1 for a worker with ``retry_jobs=False``.
    ``debounce``, ``debounce_max``: seconds, for ``lifetime="debounce"`` (``enqueue``
    defers the job with ``_defer_by``). ``limit``: up to that many runs (or enqueued
    jobs, for the until_* lifetimes) of one key at a time. ``on_lost``: what stops a run
    whose lock is lost while it runs: ``"cancel"`` cancels the job's task (it ends with
    LockLost, which arq records as the job's failure; the worker goes on), ``"exit"`` ends
    the worker process, a callable (may be async) is given the arguments after ``ctx``;
    ``"ignore"`` (the default) watches nothing.
    """
    if isinstance(max_tries, bool) or not isinstance(max_tries, int):
        raise TypeError(f"max_tries must be an int, not {type(max_tries).__name__}")
    if max_tries < 1:
        raise ValueError(f"max_tries must be at least 1, not {max_tries}")

    def decorate(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"@locked takes async def arq functions: {getattr(fn, '__qualname__', fn)!r}")
        signature = inspect.signature(fn)
        params = list(signature.parameters.values())
        if not params:
            raise TypeError(f"{fn.__qualname__}: an arq function takes the worker's ctx first")
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
            signature=signature.replace(parameters=params[1:]),
            asynchronous=True,
        )

        @functools.wraps(fn)
        async def wrapper(ctx: Any, *args: Any, **kwargs: Any) -> Any:
            ticket = Ticket.load(kwargs.pop(TICKET, None))
            worker = isinstance(ctx, dict) and "redis" in ctx
            job_id = ctx.get("job_id") if worker else None
            job_try = ctx.get("job_try", 1) if worker else 1
            if job_id is not None and job_try > 1:
                ticket = await _carried(ctx["redis"], job_id) or ticket
            run = Run(policy, ticket, args, kwargs, job_id=job_id, can_reschedule=worker)
            verdict = await run.begin_async()
            if verdict is not None:
                if verdict.countdown is None:
                    return await _value(verdict)
                options = {"_defer_by": verdict.countdown}
                await _send(ctx["redis"], wrapper, args, kwargs, run.rescheduled(verdict.attempt), options)
                return None
            async with run:
                try:
                    async with run.guard():
                        return await fn(ctx, *args, **kwargs)
                except Retry:
                    if job_id is not None and job_try < max_tries:
                        await _carry(ctx["redis"], job_id, run)
                    raise

        # A function takes attributes; mypy knows none on one.
        wrapper.joblock_policy = policy  # type: ignore[attr-defined]
        wrapper.lock_key = lambda *args, **kwargs: policy.lock_key(args, kwargs)  # type: ignore[attr-defined]
        return wrapper

    return decorate


def _retry_key(job_id: str) -> str:
    return f"{TICKET}:arq:retry:{job_id}"


async def _carry(redis: ArqRedis, job_id: str, run: Run) -> None:
    """Leaves the run's lock to the retry of its job, its ticket stored for the next try."""
    ticket = json.dumps(run.retry_ticket().dump())
    try:
        # Gone with the lock: a retry deferred past the lock's ttl takes a new one.
        await redis.set(_retry_key(job_id), ticket, px=max(1, round(run.policy.ttl * 1000)))
    except Exception as e:  # redis-py's errors: the lock is freed, and the retry takes it again
        logger.warning("Job %s: could not keep its lock %r for its retry: %s", run.policy.name, run.key, e)
        return
    run.keep()


async def _carried(redis: ArqRedis, job_id: str) -> Ticket | None:
    """The ticket a try of this job left to its retry, taken (a later try finds none)."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.get(_retry_key(job_id))
        pipe.delete(_retry_key(job_id))
        stored, _ = await pipe.execute()
    return None if stored is None else Ticket.load(json.loads(stored))


async def _send(
    redis: ArqRedis,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ticket: Ticket | None,
    options: dict[str, Any],
) -> Job | None:
    carried = {} if ticket is None else {TICKET: ticket.dump()}
    return cast(
        "Job | None", await redis.enqueue_job(func.__qualname__, *args, **options, **kwargs, **carried)
    )


async def enqueue(redis: ArqRedis, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``redis.enqueue_job(name, *args, **kwargs)`` for a ``@locked`` function, taking its lock first.

    arq's own options (``_job_id``, ``_queue_name``, ``_defer_by``, ...) are passed
    through. Returns the Job; None when the lock was busy and the job skipped (or the
    ``on_conflict`` callable's value), or when arq refused a ``_job_id`` in use (the
    lock taken for it is freed then); with a reschedule strategy, the Job deferred.
    """
    policy = getattr(func, "joblock_policy", None)
    if not isinstance(policy, Policy):
        raise TypeError(f"joblock.arq enqueues functions decorated with joblock.arq.locked, not {func!r}")
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _ARQ_OPTIONS}
    kwargs.pop(TICKET, None)
    admission = await admit_async(policy, args, kwargs)
    if not admission.send:
        return await _value(cast(Verdict, admission.verdict))  # not sent: a conflict's verdict
    if admission.verdict is not None:
        options.pop("_defer_until", None)
        options["_defer_by"] = max(admission.verdict.countdown or 0.0, float(options.get("_defer_by") or 0))
    try:
        job = await _send(redis, func, args, kwargs, admission.ticket, options)
    except BaseException:
        await admission.abandon_async()
        raise
    if job is None:
        await admission.abandon_async()
    return job
