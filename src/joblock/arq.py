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
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from .frameworks import TICKET, WHILE_EXECUTING, Policy, Run, Ticket, Verdict, admit_async

if TYPE_CHECKING:
    from arq.connections import ArqRedis
    from arq.jobs import Job

    from .aio import AsyncLocks

__all__ = ["enqueue", "locked"]

# enqueue_job's own options, passed through as given.
_ARQ_OPTIONS = frozenset({"_job_id", "_queue_name", "_defer_until", "_defer_by", "_expires", "_job_try"})


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
) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """Makes an ``async def f(ctx, ...)`` an arq function run under a joblock lock.

    ``ttl``: seconds the lock lives without its holder freeing it (a run extends it to
    a full ttl when it starts). ``lifetime``, ``on_conflict``: see
    ``joblock.frameworks``. ``name`` (default: the function's qualified name),
    ``identifier``, ``key`` (given the arguments after ``ctx``) and ``on_expired``
    (may be async) are those of ``@locks.job``.
    """

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
            signature=signature.replace(parameters=params[1:]),
            asynchronous=True,
        )

        @functools.wraps(fn)
        async def wrapper(ctx: Any, *args: Any, **kwargs: Any) -> Any:
            ticket = Ticket.load(kwargs.pop(TICKET, None))
            worker = isinstance(ctx, dict) and "redis" in ctx
            job_id = ctx.get("job_id") if worker else None
            run = Run(policy, ticket, args, kwargs, job_id=job_id, can_reschedule=worker)
            verdict = await run.begin_async()
            if verdict is not None:
                if verdict.countdown is None:
                    return await _value(verdict)
                options = {"_defer_by": verdict.countdown}
                await _send(ctx["redis"], wrapper, args, kwargs, run.rescheduled(verdict.attempt), options)
                return None
            async with run:
                return await fn(ctx, *args, **kwargs)

        # A function takes attributes; mypy knows none on one.
        wrapper.joblock_policy = policy  # type: ignore[attr-defined]
        wrapper.lock_key = lambda *args, **kwargs: policy.lock_key(args, kwargs)  # type: ignore[attr-defined]
        return wrapper

    return decorate


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
