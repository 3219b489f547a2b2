"""OpenTelemetry metrics of joblock's locks: ``joblock.instrument()``.

``pip install 'joblock[otel]'``, then ``joblock.instrument()`` (the global meter
provider) or ``joblock.instrument(meter_provider=provider)``: from then on every
client of the process records its acquisitions (by outcome and job), how long
acquires waited, locks handed over by a release to a waiter, how long locks were
held, locks lost before release (expired, taken, deadline passed, released by an
operator), renewals and batch
sizes. ``joblock.uninstrument()`` stops.

Until then the clients' methods are the plain ones (``instrument()`` puts reporting
ones in their place), and the engine's verdicts cost one check of the module-level
``recorder`` (None): a batch pays it once, never per lock. The clients, the engine's verdicts,
the renewer and the job layers call in here; this module imports nothing of theirs,
so the engine may use it too.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from . import errors

__all__ = ["Recorder", "instrument", "job", "measured", "recorder", "uninstrument"]

F = TypeVar("F", bound=Callable[..., Any])

# Attribute names, namespaced as OpenTelemetry asks of a library's own attributes.
OUTCOME = "joblock.outcome"
JOB = "joblock.job"
OPERATION = "joblock.operation"
REASON = "joblock.reason"

# Seconds: from a round trip on a local socket (under a millisecond) to a long job's hour.
SECONDS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    300.0, 900.0, 3600.0,
)  # fmt: skip
SIZES = (1.0, 10.0, 100.0, 1000.0, 10_000.0, 100_000.0, 1_000_000.0)

# The batch acquires: their result is a list of leases.
BATCH_ACQUIRES = ("acquire_many", "dedupe")

# The job the acquire in progress is for (``job``), for the acquisitions and the leases.
_job: contextvars.ContextVar[str | None] = contextvars.ContextVar("joblock_metrics_job", default=None)


class Recorder:
    """joblock's instruments on one meter, and what each reported event adds to them.

    Leases granted while instrumented carry a stamp (the grant's monotonic time and
    job) that their release or loss reads; other leases (granted before, or adopted
    from another process) count without a hold time or a job.
    """

    def __init__(self, meter: Any) -> None:
        self.acquisitions = meter.create_counter(
            "joblock.lock.acquisitions", unit="{lock}", description="Locks asked for, by outcome"
        )
        self.wait_time = _histogram(
            meter, "joblock.lock.wait_time", "s", "How long single acquires took, waits included", SECONDS
        )
        self.hold_time = _histogram(
            meter,
            "joblock.lock.hold_time",
            "s",
            "From a lock's grant to its release, or to the extend that found it gone",
            SECONDS,
        )
        self.lost = meter.create_counter(
            "joblock.lock.lost", unit="{lock}", description="Locks found gone before their release"
        )
        self.renewals = meter.create_counter(
            "joblock.lock.renewals", unit="{renewal}", description="Extends of held locks, by outcome"
        )
        self.batch_size = _histogram(meter, "joblock.batch.size", "{lock}", "Locks per batch call", SIZES)
        self.handoffs = meter.create_counter(
            "joblock.lock.handoffs", unit="{lock}", description="Locks a release handed to a waiting acquire"
        )

    def handed_over(self) -> None:
        """A waiting acquire was handed its lock by the release (not found free by itself)."""
        self.handoffs.add(1, _attributes(_job.get(), {}))

    # -- acquires and batches (the clients' calls, through ``measured``) ---------------

    def done(self, operation: str, result: Any, started: float, job: str | None) -> None:
        now = time.monotonic()
        if operation == "acquire":
            outcome = "busy" if result is None else "granted"
            attributes = _attributes(job, {OUTCOME: outcome, OPERATION: operation})
            self.acquisitions.add(1, attributes)
            self.wait_time.record(now - started, _attributes(job, {OUTCOME: outcome}))
            if result is not None:
                _stamp([result], (now, job))
            return
        self.batch_size.record(len(result), {OPERATION: operation})
        if operation in BATCH_ACQUIRES:
            granted = [lease for lease in result if lease is not None]
            for outcome, n in (("granted", len(granted)), ("busy", len(result) - len(granted))):
                if n:
                    self.acquisitions.add(n, _attributes(job, {OUTCOME: outcome, OPERATION: operation}))
            _stamp(granted, (now, job))

    def failed(self, operation: str, started: float, job: str | None) -> None:
        """A call raised a JoblockError: an acquire counts one error (a batch's keys are unknown)."""
        if operation == "acquire" or operation in BATCH_ACQUIRES:
            self.acquisitions.add(1, _attributes(job, {OUTCOME: "error", OPERATION: operation}))
        if operation == "acquire":
            self.wait_time.record(time.monotonic() - started, _attributes(job, {OUTCOME: "error"}))

    # -- verdicts (the engine, as release and extend replies come) ----------------------

    def verdicts(self, release: bool, leases: Sequence[Any], replies: Sequence[Any]) -> None:
        """Release and extend replies: 1 done, 0 expired, -1 taken (see joblock.LockLost's causes)."""
        now = time.monotonic()
        for lease, reply in zip(leases, replies):
            if type(reply) is not int:  # an error reply: the call raises, nothing was decided
                continue
            stamp = getattr(lease, "_stamp", None)
            job = None if stamp is None else stamp[1]
            if not release:
                renewed = reply == 1
                self.renewals.add(1, _attributes(job, {OUTCOME: "renewed" if renewed else "lost"}))
                if renewed:
                    continue
            reason = None if reply == 1 else "expired" if reply == 0 else "taken"
            if reason is not None:
                self.lost.add(1, _attributes(job, {REASON: reason}))
            if stamp is not None:
                outcome = "released" if reason is None else "lost"
                self.hold_time.record(now - stamp[0], _attributes(job, {OUTCOME: outcome}))

    def lost_lease(self, lease: Any) -> None:
        """A lease lost without a reply saying so: its deadline passed unconfirmed, or an
        operator released it (the replies' losses are counted by ``verdicts``)."""
        cause = lease._lost
        if cause in ("deadline", "released"):
            stamp = getattr(lease, "_stamp", None)
            self.lost.add(1, _attributes(None if stamp is None else stamp[1], {REASON: cause}))

    def unrenewed(self, leases: Sequence[Any]) -> None:
        """The auto-renewer could not reach Redis for these leases (it tries again soon)."""
        for lease in leases:
            stamp = getattr(lease, "_stamp", None)
            self.renewals.add(1, _attributes(None if stamp is None else stamp[1], {OUTCOME: "error"}))


def _histogram(meter: Any, name: str, unit: str, description: str, bounds: Sequence[float]) -> Any:
    try:
        return meter.create_histogram(
            name, unit=unit, description=description, explicit_bucket_boundaries_advisory=bounds
        )
    except TypeError:  # opentelemetry-api < 1.23: the SDK's default buckets (or the user's Views)
        return meter.create_histogram(name, unit=unit, description=description)


def _attributes(job: str | None, attributes: dict[str, str]) -> dict[str, str]:
    if job is not None:
        attributes[JOB] = job
    return attributes


def _stamp(leases: list[Any], stamp: tuple[float, str | None]) -> None:
    # Only joblock.Lease has room for a stamp; a RedlockLease counts without a hold time.
    if leases and hasattr(type(leases[0]), "_stamp"):
        for lease in leases:
            lease._stamp = stamp


# What the instrumented calls check first; None until ``instrument()``.
recorder: Recorder | None = None


def instrument(meter_provider: Any = None) -> None:
    """Records joblock's OpenTelemetry metrics from now on (``pip install 'joblock[otel]'``).

    ``meter_provider`` is an OpenTelemetry ``MeterProvider``; None takes the global
    one (``opentelemetry.metrics.set_meter_provider``). Calling it again moves the
    recording to the new provider.
    """
    global recorder  # noqa: PLW0603  # a module attribute: the hooks' one cheap check
    try:
        from opentelemetry import metrics as otel
    except ImportError:
        raise ImportError(
            "joblock.instrument() needs the OpenTelemetry API: pip install 'joblock[otel]'"
        ) from None
    from . import __version__

    recorder = Recorder(otel.get_meter("joblock", __version__, meter_provider=meter_provider))
    _swap(reporting=True)


def uninstrument() -> None:
    """Stops recording: the clients' methods are the plain ones again."""
    global recorder  # noqa: PLW0603  # as in instrument()
    recorder = None
    _swap(reporting=False)


def job(name: str) -> contextlib.AbstractContextManager[None]:
    """``with metrics.job(name):`` around a job layer's acquire: its locks count for that job."""
    return _NO_JOB if recorder is None else _Job(name)


_NO_JOB = contextlib.nullcontext()


class _Job:
    __slots__ = ("name", "outer")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.outer = _job.get()
        _job.set(self.name)

    def __exit__(self, *exc_info: object) -> None:
        # set, not reset: a job adapter's steps may end in another context than they began.
        _job.set(self.outer)


def measured(operation: str) -> Callable[[F], F]:
    """Marks a client method (``acquire``, ``acquire_many``, ...) as one that reports its calls.

    The class keeps the plain method until ``instrument()``, which puts a reporting one
    in its place (``uninstrument()`` takes it out again): uninstrumented, a call costs
    nothing for metrics. The job is the ``job`` argument of ``dedupe``, else the one
    ``job`` set, if any.
    """

    def decorate(fn: F) -> F:
        return cast(F, _Measured(operation, fn))

    return decorate


# (class, name, plain method, reporting method) of every method marked by ``measured``.
_MEASURED: list[tuple[type, str, Callable[..., Any], Callable[..., Any]]] = []


def _swap(reporting: bool) -> None:
    for owner, name, plain, wrapped in _MEASURED:
        setattr(owner, name, wrapped if reporting else plain)


class _Measured:
    """A method marked by ``measured`` while its class is made: it registers the method
    and leaves the plain one in the class (or the reporting one, once instrumented)."""

    def __init__(self, operation: str, fn: Callable[..., Any]) -> None:
        self.operation = operation
        self.fn = fn

    def __set_name__(self, owner: type, name: str) -> None:
        wrapped = _reporting(self.operation, self.fn)
        _MEASURED.append((owner, name, self.fn, wrapped))
        setattr(owner, name, wrapped if recorder is not None else self.fn)


def _reporting(operation: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` reporting its calls to the recorder (while there is one: the benchmarks
    take it away around an uninstrumented run)."""

    def job_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        if operation == "dedupe":
            return cast("str | None", kwargs["job"] if "job" in kwargs else args[1])  # args[0]: the client
        return _job.get()

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def call_async(*args: Any, **kwargs: Any) -> Any:
            record = recorder
            if record is None:
                return await fn(*args, **kwargs)
            started, job = time.monotonic(), job_of(args, kwargs)
            try:
                result = await fn(*args, **kwargs)
            except errors.JoblockError:
                record.failed(operation, started, job)
                raise
            record.done(operation, result, started, job)
            return result

        return call_async

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        record = recorder
        if record is None:
            return fn(*args, **kwargs)
        started, job = time.monotonic(), job_of(args, kwargs)
        try:
            result = fn(*args, **kwargs)
        except errors.JoblockError:
            record.failed(operation, started, job)
            raise
        record.done(operation, result, started, job)
        return result

    return call
