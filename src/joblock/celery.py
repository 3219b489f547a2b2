"""Celery tasks under joblock locks: ``@app.task(base=LockedTask, locks=locks, lock_ttl=300)``.

Options, given to ``@app.task`` or set on a subclass of :class:`LockedTask`:

- ``locks``: the Locks (or a function returning one), required.
- ``lock_ttl``: seconds the lock lives without its holder freeing it, required. A
  crashed worker's lock frees itself then; a run extends it to a full ttl when it starts.
- ``lock_lifetime``: ``"while_executing"`` (default), ``"until_executing"``,
  ``"until_executed"``, ``"until_expired"`` or ``"debounce"`` (see ``joblock.frameworks``).
- ``lock_debounce`` (seconds) and ``lock_debounce_max`` (seconds, optional): the
  debounce lifetime's window and the longest a burst may postpone the run.
- ``lock_limit`` (default 1): up to this many runs of one key at a time (a counting
  lock; see ``joblock.frameworks``).
- ``lock_on_conflict``: ``"skip"`` (default), ``"raise"``, ``"reschedule"``, a
  ``Reschedule(...)`` or a callable given the task's arguments.
- ``lock_name`` (default: the task's name), ``lock_identifier`` or ``lock_key``
  (functions of the task's arguments, as for ``@locks.job``), ``lock_on_expired``.
- ``lock_on_lost``: what stops a run whose lock is lost while it runs (see
  ``joblock.frameworks``): ``"exit"`` for the prefork pool (the child exits with
  ``joblock.lost.EXIT_STATUS`` after logging why; Celery fails the task with
  WorkerLostError and starts a new child), ``"interrupt"`` for the threads and solo
  pools (LockLost is raised in the task), a callable given the task's arguments, or
  ``"ignore"`` (the default). A value that does not fit is refused when the task (or
  the subclass) is made.

``delay``, ``apply_async`` and signatures (``task.s(...).delay()``) take the lock of
the until_* lifetimes before the message is sent and put its ticket in the message's
headers; a duplicate is then not sent: ``apply_async`` returns None when skipped (or
the ``lock_on_conflict`` callable's value). A task rescheduled by the worker keeps its
task id, so ``AsyncResult.get()`` waits for the run that finally happens.
``self.retry()`` takes the lock along to the retried run.

A debounced task's message is sent with a countdown (the debounce delay), its token
in the headers; a superseded message is acknowledged at the worker without running
(its result is None).

``apply_group(group(task.s(...) for ...))`` (or a chord) sends it as ``apply_async``
does, with the enqueue locks of its members taken in one pipelined batch; a plain
``group.apply_async()`` (and a chain) takes them one message at a time. A chord sent
with ``apply_async`` whose header has a member dropped at enqueue never runs its
body (the chord counts the member that was never sent): send such chords with
``apply_group``, which leaves the dropped members out before the chord counts them.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from celery import Task, chord, group
from celery.canvas import maybe_signature
from celery.exceptions import Ignore
from celery.utils import uuid

from .frameworks import (
    LOCK_OPTIONS,
    TICKET,
    WHILE_EXECUTING,
    Admission,
    Policy,
    Reschedule,
    Run,
    Ticket,
    Verdict,
    admit,
    admit_many,
    check_on_lost,
    current_run,
)

if TYPE_CHECKING:
    from .locks import Locks

__all__ = ["LockedTask", "apply_group"]

# The members of a group that apply_group admitted, by task id, while it sends the group.
_admitted: contextvars.ContextVar[dict[str, Admission] | None] = contextvars.ContextVar(
    "joblock_admitted", default=None
)

_OPTIONS = ("locks", *LOCK_OPTIONS)


def _static(task: Any, name: str) -> Any:
    # Celery makes task options class attributes: a function given as an option would
    # come back from the instance as a bound method.
    value = inspect.getattr_static(task, name, None)
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _ticket(request: Any) -> Ticket | None:
    # Custom message headers land both in request.headers and as request attributes,
    # depending on the Celery version and message protocol.
    headers = getattr(request, "headers", None) or {}
    data = headers.get(TICKET) if isinstance(headers, dict) else None
    if data is None:
        data = getattr(request, TICKET, None)
    return Ticket.load(data)


class LockedTask(Task):  # type: ignore[misc]  # celery ships no type information
    """A Celery task whose runs (and, per ``lock_lifetime``, enqueues) take a joblock lock."""

    locks: Locks | Callable[[], Locks] | None = None
    lock_ttl: float | None = None
    lock_lifetime: str = WHILE_EXECUTING
    lock_on_conflict: str | Reschedule | Callable[..., object] = "skip"
    lock_name: str | None = None
    lock_identifier: Callable[..., object] | None = None
    lock_key: Callable[..., str | bytes] | None = None
    lock_on_expired: Callable[..., object] | None = None
    lock_debounce: float | None = None
    lock_debounce_max: float | None = None
    lock_limit: int = 1
    lock_on_lost: str | Callable[..., object] | None = None

    _joblock_cache: tuple[tuple[Any, ...], Policy] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Celery makes each task a subclass holding its options: a lock_on_lost that
        # does not fit is refused then, before the task is registered or sent.
        super().__init_subclass__(**kwargs)
        check_on_lost(_static(cls, "lock_on_lost"), _static(cls, "lock_lifetime"), False, "lock_")

    def joblock_policy(self) -> Policy:
        """This task's lock settings, checked (and rebuilt when an option changes)."""
        snapshot = tuple(_static(self, name) for name in _OPTIONS)
        cached = self._joblock_cache
        if (
            cached is not None
            and len(cached[0]) == len(snapshot)
            and all(a is b for a, b in zip(cached[0], snapshot))
        ):
            return cached[1]
        locks, *values = snapshot
        given = dict(zip(LOCK_OPTIONS.values(), values))
        if given["ttl"] is None:
            raise TypeError(f"task {self.name}: LockedTask needs lock_ttl (seconds)")
        try:
            signature: inspect.Signature | None = inspect.signature(self.run)
        except (TypeError, ValueError):
            signature = None
        given["name"] = given["name"] or self.name
        policy = Policy(locks, **given, signature=signature, option_prefix="lock_")
        self._joblock_cache = (snapshot, policy)
        return policy

    def joblock_key(self, *args: Any, **kwargs: Any) -> str | bytes:
        """The lock key of this task called with these arguments."""
        return self.joblock_policy().lock_key(args, kwargs)

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        policy = self.joblock_policy()
        headers = dict(options.pop("headers", None) or {})
        # A ticket copied from the current request (signature_from_request) is stale.
        headers.pop(TICKET, None)
        run = current_run()
        if run is not None and run.policy is policy and task_id is not None and task_id == run.job_id:
            # self.retry(): the same task id sent again from inside its run.
            headers[TICKET] = run.retry_ticket().dump()
            result = super().apply_async(args, kwargs, task_id=task_id, headers=headers, **options)
            run.keep()
            return result
        admitted = _admitted.get()
        admission = None if admitted is None or task_id is None else admitted.pop(task_id, None)
        if admission is None:
            admission = admit(policy, tuple(args or ()), dict(kwargs or {}))
        if not admission.send:
            return cast(Verdict, admission.verdict).value  # not sent: a conflict's verdict
        if admission.ticket is not None:
            headers[TICKET] = admission.ticket.dump()
        if admission.verdict is not None:
            options.pop("eta", None)
            options["countdown"] = admission.verdict.countdown
        try:
            return super().apply_async(args, kwargs, task_id=task_id, headers=headers, **options)
        except BaseException:
            admission.abandon()
            raise

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        policy = self.joblock_policy()
        # A worker (or apply()) pushes the request before calling; a plain call does not.
        direct = self.request_stack.top is None
        request = self.request
        run = Run(
            policy,
            None if direct else _ticket(request),
            args,
            kwargs,
            job_id=None if direct else request.id,
        )
        verdict = run.begin()
        if verdict is not None:
            if verdict.countdown is None:
                return verdict.value
            return self._reschedule(run, verdict, None if direct else request)
        with run, run.guard():
            if direct:
                return super().__call__(*args, **kwargs)
            return self.run(*args, **kwargs)

    def _reschedule(self, run: Run, verdict: Verdict, request: Any) -> Any:
        headers = {TICKET: run.rescheduled(verdict.attempt).dump()}
        if request is None:
            return super().apply_async(run.args, run.kwargs, countdown=verdict.countdown, headers=headers)
        # Same task id, queue, callbacks and chain: the message comes back later as if
        # it had never been taken, and AsyncResult.get() waits for that run.
        options = dict(self.signature_from_request(request, run.args, run.kwargs).options)
        options["headers"] = {**(options.get("headers") or {}), **headers}
        options.pop("eta", None)
        options["countdown"] = verdict.countdown
        super().apply_async(run.args, run.kwargs, **options)
        raise Ignore()


def apply_group(tasks: group | chord, **options: Any) -> Any:
    """``tasks.apply_async(**options)`` for a group or a chord, the enqueue locks of its
    LockedTask members (a chord's header) taken in one batch.

    The members with an until_* lifetime (nested groups' too) have their locks taken
    with one pipelined ``acquire_many`` (per Locks and ttl) before any message is
    sent; a member whose lock is busy (or that repeats an earlier member's arguments)
    meets its ``lock_on_conflict``: skipped (logged) or given its callable's value, it
    is left out; rescheduled, it is sent with a countdown; "raise" raises before
    anything is sent, with the batch's locks freed. A chord's body then gets the
    results of the members sent. Other members (chains, nested chords, other tasks)
    are sent as the group would send them. Returns what ``apply_async`` returns: the
    GroupResult of the members sent, or the chord body's AsyncResult. With
    ``task_always_eager`` it is ``apply_async``, each task taking its lock when it runs.
    """
    if tasks.app.conf.task_always_eager:
        return tasks.apply_async(**options)
    # A chord's header is a group or a list of signatures.
    header = tasks.tasks if isinstance(tasks, chord) else tasks
    if not isinstance(header, group):
        header = group(list(header), app=tasks.app)
    members = list(_members(header))
    batch = [(i, policy) for i, policy in enumerate(map(_enqueue_policy, members)) if policy is not None]
    admissions = admit_many((policy, tuple(members[i].args), dict(members[i].kwargs)) for i, policy in batch)
    admitted: dict[str, Admission] = {}
    for (i, _), admission in zip(batch, admissions):
        if not admission.send:
            members[i] = None
            continue
        # A task id of its own is how LockedTask.apply_async finds the member's admission.
        sig = members[i] = members[i].clone()
        admitted[sig.options.setdefault("task_id", uuid())] = admission
    outer = _admitted.set(admitted)
    try:
        # Left out before the chord counts its header: the body waits for the sent ones only.
        kept = [sig for sig in members if sig is not None]
        sent: group | chord = group(kept, app=tasks.app, **header.options)
        if isinstance(tasks, chord):
            sent = chord(sent, tasks.body, app=tasks.app, **tasks.options)
        return sent.apply_async(**options)
    finally:
        _admitted.reset(outer)
        # Members never sent (the group failed before them) free their locks.
        for admission in admitted.values():
            admission.abandon()


def _enqueue_policy(sig: Any) -> Policy | None:
    """The policy of a signature of a LockedTask that locks at enqueue; None for the rest."""
    if sig.subtask_type is not None:  # a chain, chord, ...: its messages lock one at a time
        return None
    try:
        task = sig.type
    except KeyError:  # a task this process knows only by name: not one of ours to lock
        return None
    if not isinstance(task, LockedTask):
        return None
    policy = task.joblock_policy()
    return policy if policy.at_enqueue else None


def _members(tasks: group) -> Iterator[Any]:
    for member in tasks.tasks:
        sig = maybe_signature(member, app=tasks.app)
        if isinstance(sig, group):
            yield from _members(sig)
        else:
            yield sig
