"""taskiq tasks under joblock locks: ``LockMiddleware(locks)`` and ``lock_*`` task labels.

Add the middleware to the broker and give a task its options as labels of
``@broker.task`` (they stay in the process: the worker reads them from the task it
has registered, and ``pre_send`` takes them off the message):

- ``lock_ttl``: seconds the lock lives without its holder freeing it, required (a task
  without it is not locked). A run extends it to a full ttl when it starts.
- ``lock_lifetime``, ``lock_on_conflict``: see ``joblock.frameworks``.
- ``lock_name`` (default: the task's name), ``lock_identifier`` or ``lock_key``
  (functions of the task's arguments), ``lock_on_expired`` (may be async).
- ``lock_debounce``, ``lock_debounce_max``: seconds, for ``lock_lifetime="debounce"``.
- ``lock_limit``: up to that many holders of a key at once (default 1).
- ``lock_on_lost``: what stops a run whose lock is lost while it runs: ``"cancel"``
  cancels the task running its function (it ends with LockLost, the task's error; the
  worker goes on), ``"exit"`` ends the worker process, a callable (may be async) is
  given the task's arguments; ``"ignore"`` (the default) watches nothing.

``locks`` is an ``AsyncLocks`` (joblock.aio), or a function returning one; locked
tasks are ``async def``. ``await kiq(task, ...)`` is ``task.kiq(...)`` that first takes
the lock of the until_* lifetimes and sends its ticket in the message's labels; a
duplicate is then not sent: ``kiq`` returns None when skipped (or the
``lock_on_conflict`` callable's value). A task sent with plain ``task.kiq()`` takes its
lock when it starts instead.

At the worker, ``pre_execute`` adopts or takes the lock and ``post_execute`` frees it
(after a failure too), unless the run's task was sent again under its own id before
then: a retry middleware (``SimpleRetryMiddleware``, ``SmartRetryMiddleware``) does that
from ``on_error``, and the retry takes the lock along in its ticket, so the lock is
freed when the last try ends. A retry that ``SmartRetryMiddleware`` hands to a
``schedule_source`` is sent later by the scheduler, out of the middleware's sight: the
failed try frees the lock then, and the retry takes it again when it starts.

A middleware cannot stop taskiq from calling the task, so the middleware puts a gate
before each locked task's function: a run whose lock was busy returns what
``lock_on_conflict`` says without running the body. taskiq brokers have no delayed
delivery, so a rescheduled run waits out its backoff at the worker (in one of its
``--max-async-tasks`` slots) and then sends the task again; a task rescheduled at
enqueue is sent at once and waits at the worker.

A debounced task is sent at once too, by ``kiq``, with its delay (the one the server
gave it) in the message's ``joblock_delay`` label: the worker sleeps that long in
``pre_execute`` (in a ``--max-async-tasks`` slot, before ``Executing task``), then
asks whether the message is still its key's latest; a superseded one returns None
without running the body. So the delay counts from when a worker takes the message,
and a message a worker loses while it waits (a crash before its ack) is gone, as any
message of that broker would be.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from taskiq import TaskiqMessage, TaskiqMiddleware, TaskiqResult
from taskiq.labels import prepare_label

from ._client import LocksBase
from .frameworks import (
    DEBOUNCE,
    LOCK_OPTIONS,
    TICKET,
    WHILE_EXECUTING,
    Policy,
    Run,
    Ticket,
    Verdict,
    admit_async,
)

if TYPE_CHECKING:
    from taskiq import AsyncTaskiqDecoratedTask

    from .aio import AsyncLocks

__all__ = ["LockMiddleware", "kiq"]

# The label of a debounced message's delay in seconds, waited out at the worker.
DELAY = f"{TICKET}_delay"


@dataclass
class _Running:
    """What pre_execute decided for the task run in this context."""

    task_id: str
    run: Run
    verdict: Verdict | None
    error: Exception | None = None


_running: contextvars.ContextVar[_Running | None] = contextvars.ContextVar("joblock_taskiq", default=None)


async def _value(verdict: Verdict) -> Any:
    value = verdict.value
    return await value if inspect.isawaitable(value) else value


class LockMiddleware(TaskiqMiddleware):  # type: ignore[misc]  # taskiq's types are not checked here
    """Takes and frees the joblock locks of the tasks that have a ``lock_ttl`` label."""

    def __init__(self, locks: AsyncLocks | Callable[[], AsyncLocks]) -> None:
        super().__init__()
        if isinstance(locks, LocksBase) and not locks.asynchronous:
            raise TypeError(f"locks must be an AsyncLocks (joblock.aio), not {type(locks).__name__}")
        self.locks = locks
        self._policies: dict[str, Policy | None] = {}

    def policy(self, task_name: str) -> Policy | None:
        """The lock settings of the task registered as ``task_name``; None when it has no lock_ttl."""
        if task_name in self._policies:
            return self._policies[task_name]
        task = self.broker.find_task(task_name)
        if task is None:
            return None  # not registered (yet): looked up again next time
        labels = task.labels
        policy = None
        if labels.get("lock_ttl") is not None:
            fn = task.original_func
            if not inspect.iscoroutinefunction(inspect.unwrap(fn)):
                raise TypeError(f"task {task_name}: joblock.taskiq locks async def tasks")
            given = LOCK_OPTIONS.items()
            options = {arg: labels[label] for label, arg in given if labels.get(label) is not None}
            options.setdefault("name", task_name)
            options.setdefault("lifetime", WHILE_EXECUTING)
            policy = Policy(
                self.locks,
                signature=inspect.signature(fn),
                asynchronous=True,
                option_prefix="lock_",
                **options,
            )
        self._policies[task_name] = policy
        return policy

    def _own_run(self, message: TaskiqMessage) -> Run | None:
        """The run in progress in this context when it is ``message``'s (same task id)."""
        running = _running.get()
        if running is None or running.task_id != message.task_id:
            return None
        return running.run if running.run.policy is self._policies.get(message.task_name) else None

    def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        # The options may be functions: the worker has them from its own registry.
        for label in LOCK_OPTIONS:
            message.labels.pop(label, None)
            if message.labels_types is not None:
                message.labels_types.pop(label, None)
        run = self._own_run(message)
        if run is not None:
            # A retry middleware's on_error (or the task itself) sending the running task
            # again under its id: the retry's ticket carries the lease along, and a
            # debounced retry runs when it comes, its delay waited out already.
            message.labels.pop(DELAY, None)
            label, kind = prepare_label(json.dumps(run.retry_ticket().dump()))
            message.labels[TICKET] = label
            if message.labels_types is not None:
                message.labels_types[TICKET] = kind
        return message

    def post_send(self, message: TaskiqMessage) -> None:
        run = self._own_run(message)
        if run is not None:
            run.keep()  # the retry is out with the lease: post_execute leaves the lock to it

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        policy = self.policy(message.task_name)
        if policy is None:
            return message
        self._gate(message.task_name)
        data = message.labels.get(TICKET)
        ticket = Ticket.load(json.loads(data) if isinstance(data, str) else data)
        delay = message.labels.get(DELAY)
        if delay is not None:
            await asyncio.sleep(float(delay))
        run = Run(policy, ticket, tuple(message.args), dict(message.kwargs), job_id=message.task_id)
        try:
            verdict = await run.begin_async()
        except Exception as e:
            # lock_on_conflict="raise", or Redis unreachable: the task's failure, raised
            # by the gate, since what pre_execute raises would end taskiq's handling of
            # the message instead.
            _running.set(_Running(message.task_id, run, None, e))
            return message
        if verdict is None:
            run.__enter__()  # current_lease() for the task's body, which runs in this context
        _running.set(_Running(message.task_id, run, verdict))
        return message

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        running = _running.get()
        if running is None or running.task_id != message.task_id:
            return
        _running.set(None)
        if running.verdict is None and running.error is None:
            await running.run.__aexit__(None, None, None)

    def _gate(self, task_name: str) -> None:
        task = self.broker.find_task(task_name)
        fn = task.original_func
        if getattr(fn, "joblock_gate", False):
            return

        @functools.wraps(fn)
        async def gate(*args: Any, **kwargs: Any) -> Any:
            running = _running.get()
            if running is None or running.run.policy is not self._policies.get(task_name):
                return await fn(*args, **kwargs)  # called from another task's body, not run by taskiq
            if running.error is not None:
                raise running.error
            verdict = running.verdict
            if verdict is None:
                async with running.run.guard():
                    return await fn(*args, **kwargs)
            if verdict.countdown is None:
                return await _value(verdict)
            await asyncio.sleep(verdict.countdown)
            await _send(task, running.run.rescheduled(verdict.attempt), args, kwargs)
            return None

        gate.joblock_gate = True  # type: ignore[attr-defined]
        task.original_func = gate


def _send(
    task: AsyncTaskiqDecoratedTask[Any, Any],
    ticket: Ticket | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    delay: float | None = None,
) -> Any:
    labels = {} if ticket is None else {TICKET: json.dumps(ticket.dump())}
    if delay:
        labels[DELAY] = repr(delay)
    kicker = task.kicker()
    if labels:
        kicker = kicker.with_labels(**labels)
    return kicker.kiq(*args, **kwargs)


async def kiq(task: AsyncTaskiqDecoratedTask[Any, Any], *args: Any, **kwargs: Any) -> Any:
    """``task.kiq(*args, **kwargs)`` for a task with a ``lock_ttl`` label, taking its lock first.

    Returns the AsyncTaskiqTask; None when the lock was busy and the task skipped (or
    the ``lock_on_conflict`` callable's value).
    """
    middleware = next((m for m in task.broker.middlewares if isinstance(m, LockMiddleware)), None)
    policy = None if middleware is None else middleware.policy(task.task_name)
    if policy is None:
        raise TypeError(
            f"joblock.taskiq sends tasks with a lock_ttl label on a broker with LockMiddleware, not {task!r}"
        )
    admission = await admit_async(policy, args, kwargs)
    if not admission.send:
        return await _value(cast(Verdict, admission.verdict))  # not sent: a conflict's verdict
    # A debounced task's delay; a task rescheduled at enqueue waits at the worker instead.
    delay = cast(Verdict, admission.verdict).countdown if policy.lifetime == DEBOUNCE else None
    try:
        return await _send(task, admission.ticket, args, kwargs, delay)
    except BaseException:
        await admission.abandon_async()
        raise
