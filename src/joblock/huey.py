"""Huey tasks under joblock locks: ``tasks = TaskLocks(huey, locks)``, then
``@tasks.task(lock_ttl=300)`` (or ``@tasks.periodic_task(crontab(...), lock_ttl=300)``).

``tasks.task`` is ``huey.task`` with the lock options, those of ``joblock.frameworks``
spelled ``lock_...``; every other option goes to Huey as it is (``retries``,
``retry_delay``, ``priority``, ``context``, ``name``, ...):

- ``lock_ttl``: seconds the lock lives without its holder freeing it, required. A
  crashed consumer's lock frees itself then; a run extends it to a full ttl when it starts.
- ``lock_lifetime``: ``"while_executing"`` (default), ``"until_executing"``,
  ``"until_executed"``, ``"until_expired"`` or ``"debounce"``.
- ``lock_limit``: at most this many runs (or queued tasks, for the until_* lifetimes) of
  one key at a time, on a counting lock (default 1: a plain lock).
- ``lock_debounce`` and ``lock_debounce_max``, seconds, for ``lock_lifetime="debounce"``.
- ``lock_on_conflict``: ``"skip"`` (default), ``"raise"``, ``"reschedule"``, a
  ``Reschedule(...)`` or a callable given the task's arguments.
- ``lock_name`` (default: the task's name), ``lock_identifier`` or ``lock_key``
  (functions of the task's arguments, as for ``@locks.job``), ``lock_on_expired``.
- ``lock_on_lost``: what stops a run whose lock is lost while it runs (see
  ``joblock.frameworks``): ``"exit"`` for process workers (``-k process``: the worker
  exits with ``joblock.lost.EXIT_STATUS`` after logging why, and the consumer's health
  check starts a new one; the task is not retried, nor its result stored),
  ``"interrupt"`` for thread workers (``-k thread``: LockLost is raised in the task,
  which fails, or is retried if it has retries left), a callable given the task's
  arguments, or ``"ignore"`` (the default).

Every enqueue of a locked task goes through ``huey.enqueue``, which ``TaskLocks`` wraps:
calling the task, ``schedule``, ``map``, pipelines, periodic tasks enqueued by the
scheduler. It takes the lock of the until_* lifetimes and puts its ticket in the task's
keyword arguments, under ``joblock`` (the task's function never sees it); a duplicate is
then not enqueued, and the call returns None when skipped (or the ``lock_on_conflict``
callable's value). ``huey.enqueue(group([...]))`` and chords take the locks of their
members in one pipelined batch and leave the refused members out (Huey 3). A task
rescheduled at enqueue, or debounced, is enqueued with its eta set to run later. A task
that carries a ticket (a scheduled task coming due, a retry) is enqueued as it is.

At the consumer, the task's function adopts or takes the lock (a pre-execute hook tells
it which task it runs). A busy lock gives the task the result None when skipped, fails it
with ``joblock.LockNotAcquired`` for ``"raise"`` (Huey retries it if it has retries left),
gives it the callable's value, or, for a reschedule, raises Huey's ``RetryTask`` with the
backoff as its delay: the same task, under the same id, comes back then, and
``result.get(blocking=True)`` waits for the run that finally happens (before Huey 3.5,
Huey stores the RetryTask as the task's result until then). A task that fails
and that Huey retries (retries left, or ``RetryTask``) takes its lock along to the retried
run: a post-execute hook, which Huey runs before it requeues the task, puts the lock's
ticket in it. A task revoked or expired in the queue keeps the lock of its until_* lifetime
until its ttl.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, cast

from huey.api import Huey, TaskWrapper
from huey.exceptions import RetryTask

from .frameworks import (
    LOCK_OPTIONS,
    TICKET,
    Admission,
    Policy,
    Run,
    Ticket,
    Verdict,
    admit,
    admit_many,
    current_run,
)

if TYPE_CHECKING:
    from .locks import Locks

try:  # Huey >= 3
    from huey.api import chord, group
except ImportError:  # Huey 2 has neither
    chord = group = None
_GROUPS = tuple(kind for kind in (group, chord) if kind is not None)

__all__ = ["TaskLocks"]

# The attribute of a locked task's class (a Huey task setting) that holds its Policy.
POLICY = "joblock_policy"

# The task that this worker thread or process executes, set by the pre-execute hook.
_executing: contextvars.ContextVar[Any] = contextvars.ContextVar("joblock_huey_task", default=None)
# A run whose task raised: Huey decides after the run whether it retries the task, and
# the post-execute hook then hands the lock to the retry or frees it.
_undecided: contextvars.ContextVar[Run | None] = contextvars.ContextVar("joblock_huey_run", default=None)
# The admissions of a group's members, by task id, while Huey enqueues them one by one.
_admitted: contextvars.ContextVar[dict[str, Admission] | None] = contextvars.ContextVar(
    "joblock_huey_admitted", default=None
)


def _policy(task: object) -> Policy | None:
    policy = getattr(task, POLICY, None)
    return policy if isinstance(policy, Policy) else None


class TaskLocks:
    """The joblock locks of a Huey instance's tasks: declares locked tasks, and hooks into
    ``huey`` (its enqueue, a pre- and a post-execute hook named ``joblock``) to take, hand
    over and free their locks.

    ``locks``: a Locks, or a function returning one, called when a lock is needed (so the
    tasks module can be imported before the application configures Redis). Several
    TaskLocks may share one Huey instance; each task uses the Locks it was declared with.
    """

    def __init__(self, huey: Huey, locks: Locks | Callable[[], Locks]) -> None:
        if not isinstance(huey, Huey):
            raise TypeError(f"huey must be a Huey instance, not {type(huey).__name__}")
        # A Policy checks its locks: one made now rejects an AsyncLocks before any task is declared.
        Policy(locks, ttl=1, name="TaskLocks")
        self.huey = huey
        self.locks = locks
        if not isinstance(vars(huey).get("enqueue"), _Enqueue):
            huey.enqueue = _Enqueue(huey, huey.enqueue)
            huey.pre_execute(name=TICKET)(_before_execute)
            huey.post_execute(name=TICKET)(_after_execute)

    def task(self, *, lock_ttl: float, **options: Any) -> Callable[[Callable[..., Any]], TaskWrapper]:
        """``huey.task(**options)`` for a task under a joblock lock: ``lock_ttl`` and the other
        ``lock_...`` options as the module says, Huey's own options passed through."""
        return self._declaring(self.huey.task, (), lock_ttl, options)

    def periodic_task(
        self, validate_datetime: Callable[[datetime], bool], *, lock_ttl: float, **options: Any
    ) -> Callable[[Callable[..., Any]], TaskWrapper]:
        """``huey.periodic_task(validate_datetime, **options)`` under a joblock lock: each
        run the scheduler enqueues is admitted as any enqueue is."""
        return self._declaring(self.huey.periodic_task, (validate_datetime,), lock_ttl, options)

    def lock_key(self, task: TaskWrapper, *args: Any, **kwargs: Any) -> str | bytes:
        """The lock key of ``task`` (a task declared here) called with these arguments."""
        policy = _policy(getattr(task, "task_class", None))
        if policy is None:
            raise TypeError(f"{task!r} is not a task declared with TaskLocks")
        return policy.lock_key(args, kwargs)

    def _declaring(
        self, declare: Callable[..., Any], positional: tuple[Any, ...], ttl: float, options: dict[str, Any]
    ) -> Callable[[Callable[..., Any]], TaskWrapper]:
        given: dict[str, Any] = {"ttl": ttl}
        for option in list(options):
            if option in LOCK_OPTIONS:
                given[LOCK_OPTIONS[option]] = options.pop(option)
            elif option.startswith("lock_"):
                # Huey would keep a misspelt option as a task setting and lock nothing by it.
                raise TypeError(
                    f"unknown lock option {option!r}: the lock options are {', '.join(LOCK_OPTIONS)}"
                )
        context = bool(options.get("context"))

        def decorate(fn: Callable[..., Any]) -> TaskWrapper:
            if isinstance(fn, TaskWrapper) or not callable(fn) or inspect.iscoroutinefunction(fn):
                raise TypeError(f"TaskLocks locks plain functions, not {fn!r}")
            signature = inspect.signature(fn)
            if context:  # Huey passes the task itself as `task`: not one of the arguments a key is made of
                params = [p for p in signature.parameters.values() if p.name != "task"]
                signature = signature.replace(parameters=params)
            settings = dict(given)
            settings["name"] = settings.get("name") or options.get("name") or fn.__name__
            policy = Policy(self.locks, **settings, signature=signature, option_prefix="lock_")
            return declare(*positional, **options, **{POLICY: policy})(_gate(policy, fn, context))

        return decorate


class _Enqueue:
    """``huey.enqueue`` admitting the locked tasks first (the until_* locks, debounce)."""

    def __init__(self, huey: Huey, enqueue: Callable[[Any], Any]) -> None:
        self.huey = huey
        self.enqueue = enqueue

    def __call__(self, task: Any) -> Any:
        if isinstance(task, _GROUPS):
            return self._group(task)
        policy = _policy(task)
        if policy is None or TICKET in task.kwargs:
            # Not locked; or admitted already: a scheduled task coming due, a retry, a reschedule.
            return self.enqueue(task)
        admitted = _admitted.get()
        admission = None if admitted is None else admitted.pop(task.id, None)
        if admission is None:
            admission = admit(policy, tuple(task.args), dict(task.kwargs))
        if not admission.send:
            return cast(Verdict, admission.verdict).value  # not sent: a conflict's verdict
        if admission.ticket is not None:
            task.kwargs[TICKET] = admission.ticket.dump()
        if admission.verdict is not None:
            later = self._now() + timedelta(seconds=admission.verdict.countdown or 0.0)
            task.eta = later if task.eta is None else max(task.eta, later)
        try:
            return self.enqueue(task)
        except BaseException:
            admission.abandon()
            raise

    def _now(self) -> datetime:
        # Huey's etas are naive: UTC, or local time for a Huey(utc=False).
        if self.huey.utc:
            return datetime.now(timezone.utc).replace(tzinfo=None)
        return datetime.now()

    def _group(self, tasks: Any) -> Any:
        """A group or a chord: its members' enqueue locks in one batch, the refused members
        left out (before a chord counts them, so that its callback waits for the sent ones)."""
        members = list(tasks.tasks)
        batch = [
            (i, policy)
            for i, policy in enumerate(map(_policy, members))
            if policy is not None and policy.at_enqueue and TICKET not in members[i].kwargs
        ]
        admissions = admit_many(
            (policy, tuple(members[i].args), dict(members[i].kwargs)) for i, policy in batch
        )
        admitted: dict[str, Admission] = {}
        for (i, _), admission in zip(batch, admissions):
            if admission.send:
                admitted[members[i].id] = admission
            else:
                members[i] = None
        kept = [task for task in members if task is not None]
        outer = _admitted.set(admitted)
        try:
            if isinstance(tasks, chord):
                return self.enqueue(chord(kept, tasks.callback))
            return self.enqueue(group(kept))
        finally:
            _admitted.reset(outer)
            # Members never sent (the enqueue failed before them) free their locks.
            for admission in admitted.values():
                admission.abandon()


def _gate(policy: Policy, fn: Callable[..., Any], context: bool) -> Callable[..., Any]:
    """The function Huey runs for a locked task: the task's function inside its lock's run."""

    @functools.wraps(fn)
    def gate(*args: Any, **kwargs: Any) -> Any:
        data = kwargs.pop(TICKET, None)
        task = _executing.get()
        outer = current_run()
        # The consumer running this very task, not a direct call (call_local, or from
        # another task's function).
        mine = _policy(task) is policy and (outer is None or outer.job_id != task.id)
        keyed = {k: v for k, v in kwargs.items() if k != "task"} if context else kwargs
        run = Run(
            policy,
            Ticket.load(data) if mine else None,
            args,
            keyed,
            job_id=task.id if mine else None,
            can_reschedule=mine,
        )
        verdict = run.begin()
        if verdict is not None:
            if verdict.countdown is None:
                return verdict.value
            # Huey's own way to run a task later (only its own task reschedules): the same
            # task and id come back after the delay, the ticket in their arguments.
            task.kwargs[TICKET] = run.rescheduled(verdict.attempt).dump()
            raise RetryTask(delay=verdict.countdown)
        run.__enter__()
        undecided = False
        try:
            with run.guard():
                return fn(*args, **kwargs)
        except Exception:
            if mine:
                # Whether Huey retries the task depends on its retries left and the
                # exception: the post-execute hook, which Huey runs before it requeues
                # the task, hands the lock over to the retry or frees it.
                _undecided.set(run)
                undecided = True
            raise
        finally:
            if not undecided:
                run.__exit__(None, None, None)

    return gate


def _before_execute(task: Any) -> None:
    _executing.set(task)
    stale = _undecided.get()
    if stale is not None:
        # Huey failed between a task's run and its post-execute hooks (storing its result):
        # it will not retry that task, so its lock goes.
        _undecided.set(None)
        stale.__exit__(None, None, None)


def _after_execute(task: Any, value: Any, exception: BaseException | None) -> None:
    _executing.set(None)
    run = _undecided.get()
    if run is None or run.job_id != task.id:
        return
    _undecided.set(None)
    if exception is not None and task.retries:
        # Huey requeues this very task object after its post-execute hooks.
        task.kwargs[TICKET] = run.retry_ticket().dump()
        run.keep()
    run.__exit__(None, None, None)
