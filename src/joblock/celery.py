"""Celery tasks under joblock locks: ``@app.task(base=LockedTask, locks=locks, lock_ttl=300)``.

Options, given to ``@app.task`` or set on a subclass of :class:`LockedTask`:

- ``locks``: the Locks (or a function returning one), required.
- ``lock_ttl``: seconds the lock lives without its holder freeing it, required. A
  crashed worker's lock frees itself then; a run extends it to a full ttl when it starts.
- ``lock_lifetime``: ``"while_executing"`` (default), ``"until_executing"``,
  ``"until_executed"`` or ``"until_expired"`` (see ``joblock.frameworks``).
- ``lock_on_conflict``: ``"skip"`` (default), ``"raise"``, ``"reschedule"``, a
  ``Reschedule(...)`` or a callable given the task's arguments.
- ``lock_name`` (default: the task's name), ``lock_identifier`` or ``lock_key``
  (functions of the task's arguments, as for ``@locks.job``), ``lock_on_expired``.

``delay``, ``apply_async`` and signatures (``task.s(...).delay()``) take the lock of
the until_* lifetimes before the message is sent and put its ticket in the message's
headers; a duplicate is then not sent: ``apply_async`` returns None when skipped (or
the ``lock_on_conflict`` callable's value). A task rescheduled by the worker keeps its
task id, so ``AsyncResult.get()`` waits for the run that finally happens.
``self.retry()`` takes the lock along to the retried run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from celery import Task
from celery.exceptions import Ignore

from .frameworks import TICKET, WHILE_EXECUTING, Policy, Reschedule, Run, Ticket, Verdict, admit, current_run

if TYPE_CHECKING:
    from .locks import Locks

__all__ = ["LockedTask"]

_OPTIONS = (
    "locks",
    "lock_ttl",
    "lock_lifetime",
    "lock_on_conflict",
    "lock_name",
    "lock_identifier",
    "lock_key",
    "lock_on_expired",
)


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

    _joblock_cache: tuple[tuple[Any, ...], Policy] | None = None

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
        locks, ttl, lifetime, on_conflict, name, identifier, key, on_expired = snapshot
        if ttl is None:
            raise TypeError(f"task {self.name}: LockedTask needs lock_ttl (seconds)")
        try:
            signature: inspect.Signature | None = inspect.signature(self.run)
        except (TypeError, ValueError):
            signature = None
        policy = Policy(
            locks,
            ttl=ttl,
            name=name or self.name,
            lifetime=lifetime,
            on_conflict=on_conflict,
            identifier=identifier,
            key=key,
            on_expired=on_expired,
            signature=signature,
        )
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
        with run:
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
