"""``@locks.job``: resque-lock-timeout's job locks for plain functions and methods.

By default a job holds one lock per argument set while it runs: a second run with
the same arguments is skipped (logged "Job already running: ..."). ``identifier``
and ``key`` reshape the lock; ``on_locked`` chooses what a busy run does (skip,
raise, or a callable that can re-enqueue the job); ``on_expired`` hears of a lock
that expired before release; ``auto_renew`` keeps a long job's lock alive.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from . import errors
from ._client import seconds

__all__ = ["current_lease", "job"]

logger = logging.getLogger("joblock")

F = TypeVar("F", bound=Callable[..., Any])

_current: contextvars.ContextVar[Any] = contextvars.ContextVar("joblock_lease", default=None)

_DEFAULT = object()


def current_lease() -> Any:
    """The lease of the innermost job running in this context, or None.

    Job code passes ``current_lease().fence`` to the store it writes, so a store can
    refuse writes from a holder whose lock has since passed to another.
    """
    return _current.get()


async def _settle(result: Any) -> Any:
    """A hook's result, awaited when the hook was a coroutine function."""
    return await result if inspect.isawaitable(result) else result


def entered(lease: Any) -> contextvars.Token[Any]:
    """Makes ``lease`` the current lease (``current_lease()``) until ``left`` is given the token."""
    return _current.set(lease)


def left(token: contextvars.Token[Any]) -> None:
    _current.reset(token)


def describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A job's arguments as log lines show them."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return ", ".join(parts) or "no arguments"


def key_function(
    get_locks: Callable[[], Any],
    job_name: str,
    signature: inspect.Signature | None,
    receiver: bool,
    identifier: Callable[..., Any] | None,
    key: Callable[..., str | bytes] | None,
) -> Callable[[tuple[Any, ...], dict[str, Any]], str | bytes]:
    """``lock_key(args, kwargs)`` of a job: its ``key`` hook, its ``identifier``, or its arguments.

    Shared with the framework adapters, whose Locks may be looked up late (hence
    ``get_locks``). ``signature`` binds the arguments so that f(1), f(x=1) and
    f(1, flag=False) (a default) are one key; None keys on them as given.
    """

    def lock_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | bytes:
        if key is not None:
            return key(*args, **kwargs)
        locks = get_locks()
        if identifier is not None:
            ident = identifier(*args, **kwargs)
            if ident is None:
                return locks.key(job_name)  # type: ignore[no-any-return]
            return locks.key(job_name, *(ident if isinstance(ident, tuple) else (ident,)))  # type: ignore[no-any-return]
        if signature is None:
            return locks.key(job_name, *args, **kwargs)  # type: ignore[no-any-return]
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        positional = bound.args[1:] if receiver else bound.args
        return locks.key(job_name, *positional, **bound.kwargs)  # type: ignore[no-any-return]

    return lock_key


def job(
    locks: Any,
    *,
    ttl: float,
    name: str | None = None,
    identifier: Callable[..., Any] | None = None,
    key: Callable[..., str | bytes] | None = None,
    on_locked: str | Callable[..., Any] = "skip",
    on_expired: Callable[..., object] | None = None,
    auto_renew: bool = False,
    on_lost: Callable[..., object] | None = None,
    wait: float | None = None,
    fence: bool = False,
) -> Callable[[F], F]:
    """Makes a function a locked job; see ``Locks.job``."""
    seconds(ttl, "ttl")
    if wait is not None:
        seconds(wait, "wait", allow_zero=True)
    if on_locked not in ("skip", "raise") and not callable(on_locked):
        raise ValueError(f"on_locked must be 'skip', 'raise' or a callable, not {on_locked!r}")
    for label, hook in (
        ("identifier", identifier),
        ("key", key),
        ("on_expired", on_expired),
        ("on_lost", on_lost),
    ):
        if hook is not None and not callable(hook):
            raise TypeError(f"{label} must be callable, not {type(hook).__name__}")
    if identifier is not None and key is not None:
        raise ValueError("give identifier or key, not both")

    asynchronous = getattr(locks, "asynchronous", False)

    def decorate(fn: F) -> F:
        if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            # The wrapper would return the generator at once, releasing the lock
            # before the body ran.
            raise TypeError(f"@locks.job takes functions, not generators: {fn.__qualname__}")
        if inspect.iscoroutinefunction(fn) != asynchronous:
            wanted = "AsyncLocks (joblock.aio) for async def" if not asynchronous else "Locks for plain"
            raise TypeError(f"{fn.__qualname__}: use {wanted} functions")
        job_name = name or fn.__qualname__
        signature = inspect.signature(fn)
        params = list(signature.parameters)
        # A method's receiver is not part of its arguments' identity.
        receiver = bool(params) and params[0] in ("self", "cls") and "." in fn.__qualname__
        lock_key = key_function(lambda: locks, job_name, signature, receiver, identifier, key)

        def busy(args: tuple[Any, ...], kwargs: dict[str, Any], lock: str | bytes) -> Any:
            if on_locked == "raise":
                raise errors.LockNotAcquired(lock)
            shown = args[1:] if receiver else args
            if on_locked == "skip":
                logger.info("Job already running: %s with %s", job_name, describe(shown, kwargs))
                return None
            return on_locked(*args, **kwargs)  # type: ignore[operator]

        def start(lease: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> contextvars.Token[Any]:
            if auto_renew:
                lost = None if on_lost is None else (lambda _lease: on_lost(*args, **kwargs))
                locks._renewer().add(lease, ttl, lost)
            return entered(lease)

        def stop(lease: Any, token: contextvars.Token[Any]) -> None:
            left(token)
            if auto_renew:
                locks._renewer().remove(lease)

        def expired(lease: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # Another run may have held the lock while this one finished.
            if on_expired is not None:
                return on_expired(*args, **kwargs)
            logger.warning("Job %s finished after its lock %r expired or was taken", job_name, lease.key)
            return None

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            lock = lock_key(args, kwargs)
            lease = locks.acquire(lock, ttl, wait=wait, fence=fence)
            if lease is None:
                return busy(args, kwargs, lock)
            token = start(lease, args, kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                stop(lease, token)
                if not lease.release():
                    expired(lease, args, kwargs)

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            lock = lock_key(args, kwargs)
            lease = await locks.acquire(lock, ttl, wait=wait, fence=fence)
            if lease is None:
                return await _settle(busy(args, kwargs, lock))
            token = start(lease, args, kwargs)
            try:
                return await fn(*args, **kwargs)
            finally:
                stop(lease, token)
                if not await lease.release():
                    await _settle(expired(lease, args, kwargs))

        wrapper: Any = run_async if asynchronous else run
        wrapper.lock_key = lambda *args, **kwargs: lock_key(args, kwargs)
        return wrapper  # type: ignore[no-any-return]

    return decorate
