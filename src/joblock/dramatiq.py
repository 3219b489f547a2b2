"""Dramatiq actors under joblock locks: ``broker.add_middleware(LockMiddleware(locks))``, then
``@dramatiq.actor(lock_ttl=300)``.

Add the middleware before declaring the actors: Dramatiq accepts only the actor options of
the broker's middleware. The options, on ``@dramatiq.actor`` (an actor without ``lock_ttl``
takes no lock):

- ``lock_ttl``: seconds the lock lives without its holder freeing it, required. A crashed
  worker's lock frees itself then; a run extends it to a full ttl when it starts.
- ``lock_lifetime``: ``"while_executing"`` (default), ``"until_executing"``,
  ``"until_executed"``, ``"until_expired"`` or ``"debounce"`` (see ``joblock.frameworks``).
- ``lock_limit``: at most this many runs (or queued messages, for the until_* lifetimes)
  of one key at a time, on a counting lock (default 1: a plain lock).
- ``lock_debounce`` and ``lock_debounce_max``, seconds, for ``lock_lifetime="debounce"``:
  each send within the window supersedes the pending message (its arguments win) and
  postpones the run to ``lock_debounce`` after it, or to ``lock_debounce_max`` after the
  burst's first send, whichever is sooner. The message goes through Dramatiq's delay
  queue; a superseded one is acked at the worker without running (logged).
- ``lock_on_conflict``: ``"skip"`` (default), ``"raise"``, ``"reschedule"``, a
  ``Reschedule(...)`` or a callable given the actor's arguments.
- ``lock_name`` (default: the actor's name), ``lock_identifier`` or ``lock_key`` (functions
  of the actor's arguments, as for ``@locks.job``), ``lock_on_expired``.
- ``lock_on_lost``: what stops a run whose lock is lost while it runs (see
  ``joblock.frameworks``): ``"interrupt"`` raises LockLost in the worker thread running
  the actor, as Dramatiq's time limit does (the message fails, or Retries retries it);
  ``"exit"`` ends the whole worker process, with the messages its other threads run (the
  broker delivers them again), and the ``dramatiq`` command then stops its other
  processes and exits with ``joblock.lost.EXIT_STATUS`` for its supervisor to restart;
  a callable is given the actor's arguments; ``"ignore"`` (the default) watches nothing.

Sending a message (``actor.send``, ``send_with_options``, pipelines) takes the lock of the
until_* lifetimes and puts its ticket in the message's options. Dramatiq lets middleware
stop a message at enqueue only by raising, so a message its lock keeps back makes ``send``
raise :class:`NotSent` (its ``value``: None when skipped, the ``lock_on_conflict``
callable's value, or the message sent for later by a reschedule or a debounce), or
:class:`Busy` (a ``joblock.LockNotAcquired``) for ``"raise"``; :func:`send` returns that
value instead, so a debounced actor is best sent with :func:`send`.

At the worker, a message whose lock is busy is skipped (Dramatiq acks it; a callable's
value is not stored), fails with :class:`Busy` for ``"raise"`` (dead-lettered, not
retried), or is sent again later with its message id for a reschedule (so the Results
middleware's ``get_result`` waits for the run that finally happens). A message that
Dramatiq's Retries middleware retries takes its lock along to the retried run. The lock
of a run is freed when Dramatiq acknowledges or rejects the message, once every
middleware has seen its outcome. A lock taken for a message that the broker then fails to
take is not given back: it expires at its ``lock_ttl``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dramatiq import Actor, Broker, Message, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware import MiddlewareError, SkipMessage

from . import errors
from .frameworks import LOCK_OPTIONS, TICKET, Policy, Run, Ticket, admit, current_run

if TYPE_CHECKING:
    from .locks import Locks

__all__ = ["Busy", "LockMiddleware", "LockOptionError", "NotSent", "Refused", "send"]


class LockOptionError(MiddlewareError, TypeError, ValueError):
    """An actor's lock options are wrong. A MiddlewareError, because Dramatiq logs and
    drops any other error of a middleware's hook instead of failing the declaration."""


class NotSent(MiddlewareError):
    """Raised by ``send`` for a message its lock kept from being sent now.

    ``value`` is None when skipped, the ``lock_on_conflict`` callable's value, or, for a
    reschedule or a debounce, the Message sent for later.
    """

    def __init__(self, key: str | bytes, value: Any) -> None:
        if isinstance(value, Message):
            super().__init__(f"lock {key!r}: the message was sent to run later")
        else:
            super().__init__(f"lock {key!r} is busy: the message was not sent")
        self.key = key
        self.value = value


class Busy(SkipMessage, errors.LockNotAcquired):
    """``lock_on_conflict="raise"`` met a busy lock: raised by ``send``, or the failure of
    the message at the worker. A MiddlewareError, so that Dramatiq lets it through."""


class Refused(SkipMessage, errors.JoblockError):
    """A message's lock could not be handled (Redis unreachable, a failing
    ``lock_on_conflict`` callable: see ``__cause__``). At the worker the message fails
    rather than running without its lock."""


def _refusal(error: Exception) -> MiddlewareError:
    if isinstance(error, errors.LockNotAcquired):
        return Busy(error.key)
    return Refused(f"joblock could not handle the message's lock: {error!r}")


def send(actor: Actor[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``actor.send(*args, **kwargs)``, or, for a message its lock keeps back, the value of
    :class:`NotSent`: None when skipped, the ``lock_on_conflict`` callable's value, or the
    message sent for later by a reschedule or a debounce."""
    try:
        return actor.send(*args, **kwargs)
    except NotSent as e:
        return e.value


class LockMiddleware(Middleware):
    """Takes, hands over and frees the locks of the actors given ``lock_ttl``.

    ``locks``: a Locks, or a function returning one, called when a lock is needed (so the
    broker can be set up before the application configures Redis).
    """

    def __init__(self, locks: Locks | Callable[[], Locks]) -> None:
        # A Policy checks its locks: one made now rejects an AsyncLocks when the middleware
        # is built rather than when the first locked actor is declared.
        Policy(locks, ttl=1, name="LockMiddleware")
        self.locks = locks
        self._policies: dict[str, Policy] = {}

    @property
    def actor_options(self) -> set[str]:
        return set(LOCK_OPTIONS)

    def lock_key(self, actor: Actor[..., Any], *args: Any, **kwargs: Any) -> str | bytes:
        """The lock key of ``actor`` sent these arguments."""
        policy = self._policies.get(actor.actor_name)
        if policy is None:
            raise TypeError(f"actor {actor.actor_name} takes no lock (it has no lock_ttl)")
        return policy.lock_key(args, kwargs)

    def _declare(self, actor: Actor[..., Any]) -> None:
        given = {LOCK_OPTIONS[name]: value for name, value in actor.options.items() if name in LOCK_OPTIONS}
        if not given:
            self._policies.pop(actor.actor_name, None)
            return
        if "ttl" not in given:
            raise LockOptionError(f"actor {actor.actor_name}: its lock options need lock_ttl (seconds)")
        try:
            signature: inspect.Signature | None = inspect.signature(actor.fn)
        except (TypeError, ValueError):
            signature = None
        given["name"] = given.get("name") or actor.actor_name
        try:
            policy = Policy(self.locks, **given, signature=signature, option_prefix="lock_")
        except (TypeError, ValueError) as e:
            raise LockOptionError(f"actor {actor.actor_name}: {e}") from e
        self._policies[actor.actor_name] = policy
        if policy.on_lost is not None:
            self._gate(actor)

    def _gate(self, actor: Actor[..., Any]) -> None:
        """Puts the run's guard (``lock_on_lost``) around the actor's function alone, in the
        worker thread that runs it: a loss after the function returned stops nothing."""
        fn = actor.fn
        if getattr(fn, "joblock_gate", False):
            return

        @functools.wraps(fn)
        def gate(*args: Any, **kwargs: Any) -> Any:
            run = current_run()
            if run is None or run.policy is not self._policies.get(actor.actor_name):
                return fn(*args, **kwargs)  # called directly, not run for a message
            with run.guard():
                return fn(*args, **kwargs)

        gate.joblock_gate = True  # type: ignore[attr-defined]
        actor.fn = gate

    def before_declare_actor(self, broker: Broker, actor: Actor[..., Any]) -> None:
        self._declare(actor)

    def after_declare_actor(self, broker: Broker, actor: Actor[..., Any]) -> None:
        # Actors declared before the middleware was added come only through here.
        if actor.actor_name not in self._policies:
            self._declare(actor)

    def _own_run(self, message: Message[Any] | MessageProxy) -> Run | None:
        """The run in progress in this worker thread when it is ``message``'s."""
        run = current_run()
        if run is None or run.job_id != message.message_id:
            return None
        return run if run.policy is self._policies.get(message.actor_name) else None

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        policy = self._policies.get(message.actor_name)
        if policy is None:
            return
        run = self._own_run(message)
        if run is not None:
            # Retries (or the actor itself) sending the running message again.
            message.options[TICKET] = run.retry_ticket().dump()
            return
        if TICKET in message.options:
            return  # admitted already: a delayed message moving to its queue, a reschedule
        try:
            admission = admit(policy, tuple(message.args), dict(message.kwargs))
            if admission.ticket is not None:
                message.options[TICKET] = admission.ticket.dump()
            verdict = admission.verdict
            if verdict is None:
                return
            value = verdict.value
            if verdict.countdown is not None:
                # The delay queue, not an eta on this queue: a worker holds messages with an
                # eta among those it prefetches, and a few would stall its queue.
                countdown = round(verdict.countdown * 1000)
                try:
                    value = broker.enqueue(message.copy(), delay=max(delay or 0, countdown))
                except Exception:
                    admission.abandon()  # a debounced burst's previous message runs again
                    raise
        except Exception as e:
            raise _refusal(e) from e
        raise NotSent(policy.lock_key(tuple(message.args), dict(message.kwargs)), value)

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        run = self._own_run(message)
        if run is not None:
            run.keep()  # the retry is out with the lease: the run leaves the lock to it

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        policy = self._policies.get(message.actor_name)
        if policy is None:
            return
        args, kwargs = tuple(message.args), dict(message.kwargs)
        run = Run(policy, Ticket.load(message.options.get(TICKET)), args, kwargs, job_id=message.message_id)
        # Any error here fails the message: Dramatiq would log it and run the actor unlocked.
        try:
            verdict = run.begin()
            if verdict is None:
                run.__enter__()
                return
            if verdict.countdown is not None:
                # Its message id goes along, so the run that finally happens is the message's.
                later = message.copy(options={TICKET: run.rescheduled(verdict.attempt).dump()})
                broker.enqueue(later, delay=round(verdict.countdown * 1000))
                # The Results middleware stores no None for this skip: the rerun's result is
                # the message's, and get_result(block=True) waits for it.
                message.options["store_results"] = False
        except Exception as e:
            message.fail()
            raise _refusal(e) from e
        raise SkipMessage(f"joblock: lock {run.key!r} is busy")

    def _finish(self, message: MessageProxy) -> None:
        # After every middleware's after_process_message: Retries has sent its retry by now.
        run = self._own_run(message)
        if run is not None:
            run.__exit__(None, None, None)

    def before_ack(self, broker: Broker, message: MessageProxy) -> None:
        self._finish(message)

    def before_nack(self, broker: Broker, message: MessageProxy) -> None:
        self._finish(message)
