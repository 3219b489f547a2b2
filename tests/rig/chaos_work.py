"""The chaos run's worker processes: callers taking locks through the faults, and the
guarded resource every holder writes to.

Each worker process runs one asyncio loop. Its callers are tasks: some use an
``AsyncLocks`` (``AsyncClusterLocks`` on a Redis Cluster), the others a ``Locks``
(``ClusterLocks``) whose blocking calls go to threads of their own
(so the threaded client is used from several threads at once, as a job runner would).
Each lease is stamped with ``time.monotonic()``, one clock for every process on Linux:
the parent compares stamps across processes (``LeaseRecord``).

The resource is a Redis server the faults do not touch, written by ``GUARD_SCRIPT``. A
holder writes its fencing number to it, as a store guarded by fencing would be written:
a plain lock's key refuses a number lower than the highest it accepted ("stale"), and
every key notices two leases writing with one number ("duplicate"), which a lock
service must never hand out twice. A holder writes only while its own clock says the lease cannot
have expired yet: from the start of the last call that said it held, less than its ttl
minus ``MARGIN`` has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import random
import signal
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from joblock import _core_py, errors
from joblock._core import compiled
from joblock._tools.admin import Node
from joblock.aio import AsyncClusterLocks, AsyncLocks
from joblock.cluster import ClusterLocks
from joblock.jobs import current_lease
from joblock.locks import Locks
from joblock.settings import Settings

__all__ = ["GUARD_SCRIPT", "MARGIN", "LeaseRecord", "Plan", "Tally", "documented", "work"]

# A holder stops writing this many seconds before its lease could expire by its clock.
MARGIN = 1.0
# Seconds a caller waits for a busy lock, when it waits.
WAIT = 2.0
# Counting locks' limit.
LIMIT = 3
# Undocumented errors kept whole (with where they came from) for the report.
EXAMPLES = 10

# KEYS[1]: the hash of a lock key's fencing numbers and the lease that wrote each;
# KEYS[2]: the highest number accepted for it. ARGV: the number, the lease, "1" when
# the key is a plain lock's (the numbers must not go back), "0" for a counting lock's.
GUARD_SCRIPT = """
local owner = redis.call('HGET', KEYS[1], ARGV[1])
if owner and owner ~= ARGV[2] then
  redis.call('HINCRBY', 'chaos:totals', 'duplicate', 1)
  redis.call('RPUSH', 'chaos:duplicates', KEYS[1] .. ' ' .. ARGV[1] .. ': ' .. owner .. ', ' .. ARGV[2])
  return 'duplicate'
end
if ARGV[3] == '1' then
  if tonumber(ARGV[1]) < tonumber(redis.call('GET', KEYS[2]) or '0') then
    redis.call('HINCRBY', 'chaos:totals', 'stale', 1)
    return 'stale'
  end
  redis.call('SET', KEYS[2], ARGV[1])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', 'chaos:totals', 'accepted', 1)
return 'ok'
"""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one worker process does, and until when."""

    index: int
    deployment: str
    url: str | list[str]  # a Redis Cluster's: every node's
    guard_port: int
    core: str  # "c" or "python"
    options: dict[str, Any]  # the Locks' options
    seed: int
    deadline: float  # time.monotonic(): no call starts after it
    ttl: float
    threads: int
    tasks: int
    cluster: bool = False  # ClusterLocks and AsyncClusterLocks


class LeaseRecord(NamedTuple):
    """One lease, as its holder saw it (monotonic stamps)."""

    deployment: str
    key: str
    limit: int
    fence: int
    lease: str  # "worker.caller.n"
    granted: float  # the grant was known (the acquire had returned)
    confirmed: float  # the start of the last call that said the lease held (else ``granted``)
    released: float | None  # the start of a release that returned True
    kept: bool  # never told otherwise: every call said it held, and the release returned True
    stale: int  # writes the guard refused as stale


@dataclasses.dataclass
class Tally:
    """A worker's counts, sent to the parent when it ends."""

    calls: Counter[str] = dataclasses.field(default_factory=Counter)
    grants: Counter[str] = dataclasses.field(default_factory=Counter)
    busy: Counter[str] = dataclasses.field(default_factory=Counter)
    documented: Counter[str] = dataclasses.field(default_factory=Counter)  # by class
    failures: Counter[str] = dataclasses.field(default_factory=Counter)  # documented errors, by call
    undocumented: Counter[str] = dataclasses.field(default_factory=Counter)
    examples: list[str] = dataclasses.field(default_factory=list)
    told: Counter[str] = dataclasses.field(default_factory=Counter)
    leases: list[LeaseRecord] = dataclasses.field(default_factory=list)
    hung: int = 0


def documented(error: BaseException) -> bool:
    """Whether ``error`` is one that docs/guarantees.md names for a network fault, a
    server that stops, restarts or fails over: ConnectionError (TimeoutError,
    BatchConnectionError), ReadOnlyError, ReplicationError (``min_replicas``), or a
    BatchError caused by one of them."""
    if isinstance(error, errors.BatchError) and not isinstance(error, errors.ConnectionError):
        return error.__cause__ is not None and documented(error.__cause__)
    if isinstance(error, errors.AuthenticationError):  # no password here: never a fault's
        return False
    return isinstance(error, (errors.ConnectionError, errors.ReadOnlyError, errors.ReplicationError))


class Holding:
    """A lease being held: what its holder knows, and when it learnt it."""

    def __init__(
        self, caller: Caller, lease: Any, ttl: float, limit: int, asked: float, granted: float
    ) -> None:
        self.caller = caller
        self.lease = lease
        self.ttl = ttl
        self.limit = limit
        self.name = f"{caller.name}.{next(caller.leases)}"
        self.granted = granted
        self.confirmed = granted
        self.valid_until = asked + ttl  # Redis set its expiry after the call started
        self.released: float | None = None
        self.told: str | None = None
        self.stale = 0

    def held(self, asked: float, extended: bool) -> None:
        self.confirmed = asked
        if extended:
            self.valid_until = asked + self.ttl

    def tell(self, why: str) -> None:
        if self.told is None:
            self.told = why
            self.caller.tally.told[why] += 1

    def record(self) -> LeaseRecord:
        plan = self.caller.plan
        kept = self.told is None and self.released is not None
        key = self.lease.key if isinstance(self.lease.key, str) else self.lease.key.decode()
        return LeaseRecord(
            plan.deployment, key, self.limit, self.lease.fence, self.name,
            self.granted, self.confirmed, self.released, kept, self.stale,
        )  # fmt: skip


class Caller:
    """One caller: a task of the worker's loop taking locks until the deadline."""

    def __init__(self, worker: Worker, n: int, threaded: bool) -> None:
        self.worker = worker
        self.plan = worker.plan
        self.tally = worker.tally
        self.threaded = threaded
        self.locks: Locks | AsyncLocks = worker.locks if threaded else worker.async_locks
        self.name = f"{self.plan.index}.{n}"
        self.rng = random.Random(f"{self.plan.seed}.{n}")
        self.leases = iter(range(1 << 62))
        self.doing = "nothing yet"
        wait = {"wait": WAIT}
        self.jobs = {
            waits: self.locks.job(
                ttl=self.plan.ttl, fence=True, name="ChaosJob", identifier=lambda i, *_: (i,),
                on_expired=lambda _i, run: run.expire(), **(wait if waits else {}),
            )(self._job_body if threaded else self._async_job_body)
            for waits in (False, True)
        }  # fmt: skip

    async def call(self, what: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function`` (a Locks or AsyncLocks method) called; a Locks' in a thread."""
        self.tally.calls[what] += 1
        self.doing = what
        if self.threaded:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self.worker.executor, functools.partial(function, *args, **kwargs)
            )
        return await function(*args, **kwargs)

    def failed(self, what: str, error: BaseException) -> str:
        """Counts ``error``; the reason a holder learns from it."""
        name = type(error).__name__
        if documented(error):
            self.tally.documented[name] += 1
            self.tally.failures[what] += 1
        else:
            self.tally.undocumented[name] += 1
            if len(self.tally.examples) < EXAMPLES:
                where = "".join(traceback.format_exception(error)[-6:])
                self.tally.examples.append(f"{self.plan.deployment} {what}: {name}: {error}\n{where}")
        return "error"

    async def run(self) -> None:
        kinds = [self.plain, self.counting, self.batch, self.dedupe, self.job]
        while time.monotonic() < self.plan.deadline:
            operation = self.rng.choices(kinds, weights=[4, 2, 2, 1, 2])[0]
            try:
                await operation()
            except Exception as e:  # a failure of the run itself counts as undocumented
                self.failed(f"{operation.__name__} (harness)", e)
            await asyncio.sleep(self.rng.uniform(0, 0.02))

    def ttl(self) -> float:
        """A lease's ttl: the plan's, or a half or a quarter of it, short enough that some
        stalls and stops outlast it and the lock passes to another holder."""
        return self.plan.ttl / self.rng.choice((1, 2, 4))

    # -- holding a lease ---------------------------------------------------------------

    async def write(self, holding: Holding) -> bool:
        """Writes the lease's fencing number to the guard, while it may; False once told."""
        if holding.told is not None:
            return False
        if time.monotonic() > holding.valid_until - MARGIN:
            holding.tell("time up by its clock")
            return False
        deployment = self.plan.deployment
        key = holding.lease.key if isinstance(holding.lease.key, str) else holding.lease.key.decode()
        reply = await asyncio.to_thread(
            self.worker.guard.call, "EVAL", GUARD_SCRIPT, 2, f"fences:{deployment}:{key}",
            f"high:{deployment}:{key}", holding.lease.fence, holding.name, int(holding.limit == 1),
        )  # fmt: skip
        outcome: str = reply.decode()
        if outcome == "stale":
            holding.stale += 1
            holding.tell("write refused as stale")
        return outcome == "ok"

    async def keep(self, holding: Holding) -> None:
        """A few writes, each followed by a short pause and an extend or a remaining."""
        for _ in range(self.rng.randint(1, 3)):
            if not await self.write(holding):
                return
            await asyncio.sleep(self.rng.uniform(0, 0.03))
            asked = time.monotonic()
            try:
                if self.rng.random() < 0.5:
                    if not await self.call("extend", holding.lease.extend, holding.ttl):
                        holding.tell("extend said False")
                        return
                    holding.held(asked, extended=True)
                else:
                    if await self.call("remaining", holding.lease.remaining) is None:
                        holding.tell("remaining said None")
                        return
                    holding.held(asked, extended=False)
            except Exception as e:
                holding.tell(self.failed(self.doing, e))
                return
        await self.write(holding)

    def released(self, holding: Holding, asked: float, result: bool) -> None:
        if result:
            holding.held(asked, extended=False)
            holding.released = asked
        else:
            holding.tell("release said False")
        self.tally.leases.append(holding.record())

    async def hold_one(self, what: str, lease: Any, ttl: float, limit: int, asked: float) -> None:
        holding = Holding(self, lease, ttl, limit, asked, time.monotonic())
        self.tally.grants[what] += 1
        await self.keep(holding)
        asked = time.monotonic()
        try:
            result = await self.call("release", lease.release)
        except Exception as e:
            holding.tell(self.failed("release", e))
            self.tally.leases.append(holding.record())
            return
        self.released(holding, asked, result)

    async def acquire(self, kind: str, key: str, limit: int) -> None:
        waits = self.rng.random() < 0.3
        options: dict[str, Any] = {"fence": True, "limit": limit, **({"wait": WAIT} if waits else {})}
        what = f"acquire {kind}" + (" (wait)" if waits else "")
        ttl = self.ttl()
        asked = time.monotonic()
        try:
            lease = await self.call(what, self.locks.acquire, key, ttl, **options)
        except Exception as e:
            self.failed(what, e)
            return
        if lease is None:
            self.tally.busy[what] += 1
            return
        await self.hold_one(what, lease, ttl, limit, asked)

    # -- the operations ----------------------------------------------------------------

    async def plain(self) -> None:
        await self.acquire("plain", f"chaos:plain:{self.rng.randrange(4)}", 1)

    async def counting(self) -> None:
        await self.acquire("counting", f"chaos:counting:{self.rng.randrange(2)}", LIMIT)

    async def batch(self) -> None:
        keys = [f"chaos:batch:{i}" for i in self.rng.sample(range(8), self.rng.randint(2, 5))]
        ttl = self.ttl()
        asked = time.monotonic()
        try:
            leases = await self.call("acquire_many", self.locks.acquire_many, keys, ttl, fence=True)
        except Exception as e:
            self.failed("acquire_many", e)
            return
        await self.hold_many("acquire_many", leases, ttl, asked)

    async def dedupe(self) -> None:
        ids = [(self.rng.randrange(6),) for _ in range(self.rng.randint(2, 5))]  # repeats are duplicates
        ttl = self.ttl()
        asked = time.monotonic()
        try:
            leases = await self.call("dedupe", self.locks.dedupe, "ChaosDedupe", ids, ttl, fence=True)
        except Exception as e:
            self.failed("dedupe", e)
            return
        await self.hold_many("dedupe", leases, ttl, asked)

    async def hold_many(self, what: str, leases: list[Any], ttl: float, asked: float) -> None:
        """Writes with each lease of a batch, extends them together, releases them together."""
        granted = time.monotonic()
        holdings = [Holding(self, lease, ttl, 1, asked, granted) for lease in leases if lease is not None]
        self.tally.grants[what] += len(holdings)
        self.tally.busy[what] += len(leases) - len(holdings)
        if not holdings:
            return
        for holding in holdings:
            await self.write(holding)
        asked = time.monotonic()
        try:
            extended = await self.call("extend_many", self.locks.extend_many, leases, ttl)
            for holding, still in zip(
                holdings, (e for e, lease in zip(extended, leases) if lease is not None)
            ):
                if still:
                    holding.held(asked, extended=True)
                else:
                    holding.tell("extend said False")
        except Exception as e:
            why = self.failed("extend_many", e)
            for holding in holdings:
                holding.tell(why)
        for holding in holdings:
            await self.write(holding)
        asked = time.monotonic()
        try:
            results = await self.call("release_many", self.locks.release_many, leases)
        except Exception as e:
            why = self.failed("release_many", e)
            for holding in holdings:
                holding.tell(why)
                self.tally.leases.append(holding.record())
            return
        for holding, result in zip(holdings, (r for r, lease in zip(results, leases) if lease is not None)):
            self.released(holding, asked, result)

    async def job(self) -> None:
        """A run of ``@locks.job(fence=True)``: the body writes with ``current_lease()``."""
        waits = self.rng.random() < 0.3
        what = "job (wait)" if waits else "job"
        run = JobRun(time.monotonic())
        try:
            await self.call(what, self.jobs[waits], self.rng.randrange(3), run)
        except Exception as e:
            why = self.failed(what, e)
            if run.holding is None:
                return  # the run's acquire failed: no lock was taken
            run.holding.tell(why)
        holding = run.holding
        if holding is None:
            self.tally.busy[what] += 1
            return
        self.tally.grants[what] += 1
        if holding.told is None and run.ended is not None:
            # The run's release started after its body ended; it was False if on_expired ran.
            self.released(holding, run.ended, not run.expired)
        else:
            self.tally.leases.append(holding.record())

    async def _job_steps(self, run: JobRun, lease: Any) -> None:
        run.holding = Holding(self, lease, self.plan.ttl, 1, run.asked, time.monotonic())
        await self.keep(run.holding)
        run.ended = time.monotonic()

    def _job_body(self, i: int, run: JobRun) -> None:
        """A threaded job's body: its steps run on the worker's loop, as every caller's do."""
        steps = self._job_steps(run, current_lease())
        asyncio.run_coroutine_threadsafe(steps, self.worker.loop).result()

    async def _async_job_body(self, i: int, run: JobRun) -> None:
        await self._job_steps(run, current_lease())


class JobRun:
    """One call of a job: when it was made, its lease's Holding once the body runs, when
    the body ended, and whether ``on_expired`` was called."""

    def __init__(self, asked: float) -> None:
        self.asked = asked  # the lock's expiry was set after this
        self.holding: Holding | None = None
        self.ended: float | None = None
        self.expired = False

    def expire(self) -> None:
        self.expired = True


class Worker:
    """One worker process: its clients, its guard connection, its callers."""

    def __init__(self, plan: Plan, loop: asyncio.AbstractEventLoop) -> None:
        self.plan = plan
        self.loop = loop
        self.tally = Tally()
        core = compiled() if plan.core == "c" else _core_py
        threaded, asynchronous = (ClusterLocks, AsyncClusterLocks) if plan.cluster else (Locks, AsyncLocks)
        self.locks = type("Locks", (threaded,), {"_core": core})(plan.url, prefix="chaos", **plan.options)
        self.async_locks = type("AsyncLocks", (asynchronous,), {"_core": core})(
            plan.url, prefix="chaos", **plan.options
        )
        self.guard = Node(Settings(port=plan.guard_port, socket_timeout=30))
        # Two threads per threaded caller: its call, and a job body's call made meanwhile.
        self.executor = ThreadPoolExecutor(2 * plan.threads, thread_name_prefix="chaos-caller")
        self.callers = [Caller(self, n, threaded=n < plan.threads) for n in range(plan.threads + plan.tasks)]

    async def run(self, grace: float) -> None:
        tasks = {asyncio.create_task(caller.run()): caller for caller in self.callers}
        _, pending = await asyncio.wait(tasks, timeout=self.plan.deadline - time.monotonic() + grace)
        for task in pending:  # a call that never returned
            caller = tasks[task]
            self.tally.hung += 1
            self.tally.undocumented["hung call"] += 1
            self.tally.examples.append(
                f"{self.plan.deployment} {caller.doing}: no answer {grace} s after the end"
            )


def work(plan: Plan, results: Any, grace: float) -> None:
    """A worker process's body: runs its callers, then sends its Tally to ``results``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends the run, and us
    loop = asyncio.new_event_loop()
    worker = Worker(plan, loop)
    loop.run_until_complete(worker.run(grace))
    results.put((plan.index, worker.tally))
    results.close()
    results.join_thread()
    if worker.tally.hung:  # threads stuck in calls: nothing left to wait for
        os._exit(0)
    with contextlib.suppress(Exception):
        worker.locks.close()
        loop.run_until_complete(worker.async_locks.close())
    worker.executor.shutdown(wait=False)
