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
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypedDict, TypeVar, cast, overload

from . import errors, lost, metrics
from ._client import check_flags, check_limit, seconds
from .settings import check_bool

if TYPE_CHECKING:
    from .aio import AsyncLease, AsyncLocks
    from .locks import Lease, Locks

__all__ = ["JobOptions", "LockedJob", "current_lease", "job"]

logger = logging.getLogger("joblock")

P = ParamSpec("P")
Q = ParamSpec("Q")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
S = TypeVar("S")


class LockedJob(Protocol[P, R_co]):
    """A function made a locked job (``@locks.job``, ``joblock.rq.locked``), for annotations.

    Called with the function's arguments; returns what the function returns, or what
    a busy lock's strategy gives instead (None for skip). ``lock_key`` takes the same
    arguments (a method's receiver too, as ``Class.method.lock_key(obj, ...)``).
    """

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...
    def lock_key(self, *args: P.args, **kwargs: P.kwargs) -> str | bytes: ...

    # Read from an instance, a method job binds its receiver as a function does.
    @overload
    def __get__(self, instance: None, owner: type[Any]) -> LockedJob[P, R_co]: ...
    @overload
    def __get__(self: LockedJob[Concatenate[S, Q], R], instance: S, owner: type[Any]) -> Callable[Q, R]: ...


class JobOptions(TypedDict, total=False):
    """The options of ``@locks.job`` besides ``ttl`` and ``on_locked``."""

    name: str | None
    identifier: Callable[..., object] | None
    key: Callable[..., str | bytes] | None
    on_expired: Callable[..., object] | None
    auto_renew: bool
    on_lost: str | Callable[..., object] | None
    wait: float | timedelta | None
    fence: bool
    limit: int
    fair: bool


_current: contextvars.ContextVar[Lease | AsyncLease | None] = contextvars.ContextVar(
    "joblock_lease", default=None
)

_DEFAULT = object()


def current_lease() -> Lease | AsyncLease | None:
    """The lease of the innermost job running in this context, or None.

    Job code passes ``current_lease().fence`` to the store it writes, so a store can
    refuse writes from a holder whose lock has since passed to another.
    """
    return _current.get()


async def _settle(result: Any) -> Any:
    """A hook's result, awaited when the hook was a coroutine function."""
    return await result if inspect.isawaitable(result) else result


def entered(lease: Lease | AsyncLease | None) -> contextvars.Token[Lease | AsyncLease | None]:
    """Makes ``lease`` the current lease (``current_lease()``) until ``left`` is given the token."""
    return _current.set(lease)


def left(token: contextvars.Token[Lease | AsyncLease | None]) -> None:
    _current.reset(token)


def describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A job's arguments as log lines show them."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return ", ".join(parts) or "no arguments"


def key_function(
    get_locks: Callable[[], Locks | AsyncLocks],
    job_name: str,
    signature: inspect.Signature | None,
    receiver: bool,
    identifier: Callable[..., object] | None,
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
                return locks.key(job_name)
            return locks.key(job_name, *(ident if isinstance(ident, tuple) else (ident,)))
        if signature is None:
            return locks.key(job_name, *args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        positional = bound.args[1:] if receiver else bound.args
        return locks.key(job_name, *positional, **bound.kwargs)

    return lock_key


# The overloads of Locks.job and AsyncLocks.job give the wrapped job's own types.
def job(
    locks: Locks | AsyncLocks,
    *,
    ttl: float | timedelta,
    name: str | None = None,
    identifier: Callable[..., object] | None = None,
    key: Callable[..., str | bytes] | None = None,
    on_locked: str | Callable[..., object] = "skip",
    on_expired: Callable[..., object] | None = None,
    auto_renew: bool = False,
    on_lost: str | Callable[..., object] | None = None,
    wait: float | timedelta | None = None,
    fence: bool = False,
    limit: int = 1,
    fair: bool = False,
) -> Callable[[Callable[..., Any]], LockedJob[..., Any]]:
    """Makes a function a locked job; see ``Locks.job``."""
    ttl = seconds(ttl, "ttl")  # in seconds from here on: the renewer divides it
    check_limit(limit)
    check_bool(auto_renew, "auto_renew")
    check_flags(fence, fair)
    if wait is not None:
        seconds(wait, "wait", allow_zero=True)
    if on_locked not in ("skip", "raise") and not callable(on_locked):
        raise ValueError(f"on_locked must be 'skip', 'raise' or a callable, not {on_locked!r}")
    asynchronous = getattr(locks, "asynchronous", False)
    # None and "ignore": nothing watched. A callable is given the job's arguments.
    guarded = None if on_lost is None or on_lost == "ignore" else lost.check_on_lost(on_lost, asynchronous)
    for label, hook in (
        ("identifier", identifier),
        ("key", key),
        ("on_expired", on_expired),
    ):
        if hook is not None and not callable(hook):
            raise TypeError(f"{label} must be callable, not {type(hook).__name__}")
    if identifier is not None and key is not None:
        raise ValueError("give identifier or key, not both")

    # The same client, as each of the two wrappers below sees it.
    threaded = cast("Locks", locks)
    asyncio_locks = cast("AsyncLocks", locks)

    def decorate(fn: Callable[..., Any]) -> LockedJob[..., Any]:
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
            return cast("Callable[..., object]", on_locked)(*args, **kwargs)  # neither "raise" nor "skip"

        # The lease is a Lease or an AsyncLease, as the client is (and so its renewer).
        def start(lease: Any) -> contextvars.Token[Lease | AsyncLease | None]:
            if auto_renew:
                locks._renewer().add(lease, ttl)
            return entered(lease)

        def strategy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if callable(guarded):
                hook = cast("Callable[..., object]", guarded)
                return lambda _lease: hook(*args, **kwargs)
            return guarded

        def stop(lease: Any, token: contextvars.Token[Lease | AsyncLease | None]) -> None:
            left(token)
            if auto_renew:
                locks._renewer().remove(lease)

        def expired(lease: Lease | AsyncLease, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
            # Another run may have held the lock while this one finished.
            if on_expired is not None:
                return on_expired(*args, **kwargs)
            logger.warning("Job %s finished after its lock %r expired or was taken", job_name, lease.key)
            return None

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            lock = lock_key(args, kwargs)
            with metrics.job(job_name):
                lease = threaded.acquire(lock, ttl, wait=wait, fence=fence, limit=limit, fair=fair)
            if lease is None:
                return busy(args, kwargs, lock)
            token = start(lease)
            try:
                if guarded is None:
                    return fn(*args, **kwargs)
                with lost.Guard(threaded, lease, strategy(args, kwargs)):
                    return fn(*args, **kwargs)
            finally:
                stop(lease, token)
                if not lease.release():
                    expired(lease, args, kwargs)

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            lock = lock_key(args, kwargs)
            with metrics.job(job_name):
                lease = await asyncio_locks.acquire(lock, ttl, wait=wait, fence=fence, limit=limit, fair=fair)
            if lease is None:
                return await _settle(busy(args, kwargs, lock))
            token = start(lease)
            try:
                if guarded is None:
                    return await fn(*args, **kwargs)
                async with lost.AsyncGuard(asyncio_locks, lease, strategy(args, kwargs)):
                    return await fn(*args, **kwargs)
            finally:
                stop(lease, token)
                if not await lease.release():
                    await _settle(expired(lease, args, kwargs))

        wrapper: Any = run_async if asynchronous else run
        wrapper.lock_key = lambda *args, **kwargs: lock_key(args, kwargs)
        return cast("LockedJob[..., Any]", wrapper)

    return decorate
