"""The contenders of ``joblock bench`` and ``benchmarks/``: what each one does.

``GROUPS`` names the operations and who competes in each; ``make_case`` gives one
contender's ``Case`` (make its input, then run it) in an ``Arena`` (``arena``).
``RedisBenchmark`` runs the reference of the batch groups. The groups of many callers
at once, the bare-socket references and the Redis Cluster group are in ``crowds``; the
contention group (processes taking turns at one key) is ``contention``'s, contenders,
measuring and all. Measuring and reporting are ``bench``'s.

The asyncio groups drive joblock's ``AsyncLocks`` and redis-py's asyncio client
(``redis.asyncio``) on one event loop of the arena's, a call at a time
(``run_until_complete``), so they are timed by the same code as the others.
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .. import _core_py, metrics
from .._scripts import (
    EXTEND_PLAIN,
    EXTEND_PLAIN_SHA,
    EXTEND_SHA,
    RELEASE_PLAIN,
    RELEASE_PLAIN_SHA,
    RELEASE_SHA,
)
from ..aio import AsyncLocks
from ..locks import Locks
from ..settings import Settings
from . import contention, crowds
from .arena import (
    JOB,
    MISSING,
    RB_KEYSPACE,
    RB_PATTERN,
    REFERENCE,
    WINDOW,
    WITHOUT_GET,
    Arena,
    Case,
    Group,
    Unavailable,
    chunks,
    compiled_core,
    peer,
    succeeded,
)

__all__ = [
    "AIO_GROUPS", "BATCHED", "CONTENDERS", "GROUPS", "GROUP_SETS", "JOB", "LABELS", "LOCKERS", "MISSING",
    "REFERENCE", "RB_PATTERN", "WINDOW", "WITHOUT_GET", "Arena", "Case", "Group", "RedisBenchmark",
    "Unavailable", "label", "make_case", "one_call_contenders", "succeeded",
]  # fmt: skip


PEERS = ("redis-py-lock", "redis-py-pipeline", "python-redis-lock", "pottery")
LOCKERS = ("joblock-c", "joblock-py", *PEERS)
# The same peers' asyncio client; joblock-c and joblock-py are AsyncLocks in the asyncio groups.
AIO_PEERS = ("redis-py-asyncio-lock", "redis-py-asyncio-pipeline")
AIO_LOCKERS = ("joblock-c", "joblock-py", *AIO_PEERS)
# joblock-c-calls: the compiled core called once per 1000 keys, as the peers are.
# joblock-c-limit: counting locks (limit=2), the compiled core, beside the plain ones.
# joblock-c-scripts: the compiled core with native_commands=False (scripts on every server).
# joblock-c-unmeasured: the batch methods without joblock.metrics' wrapper, the path as it
# was before metrics; joblock-c-instrumented: recording into an OpenTelemetry SDK meter.
METERED = ("joblock-c", "joblock-c-unmeasured", "joblock-c-instrumented")
# What a client with no overhead of its own would do, for one caller (see ``crowds``).
BARE = ("bare-socket", "bare-protocol")
CLUSTER_PEERS = ("joblock-c-one-server", "redis-py-cluster-pipeline")
CONTENDERS = (
    *LOCKERS, "joblock-c-calls", "joblock-c-limit", "joblock-c-scripts", *METERED[1:], "handwritten",
    *AIO_PEERS, *BARE,
    *CLUSTER_PEERS, *contention.OWN,
)  # fmt: skip
BATCHED = ("joblock-c", "joblock-c-calls", *LOCKERS[1:])

GROUPS: dict[str, Group] = {
    g.id: g
    for g in (
        Group("single", "single acquire + release, one caller", "acquire+release pairs", 1, "redis-py-lock",
              (*LOCKERS, "joblock-c-limit", "bare-socket")),
        Group("acquire", "batch acquire (windows of 1000)", "locks acquired", WINDOW, REFERENCE, BATCHED),
        Group("acquire_held", "batch acquire of held locks (windows of 1000)", "locks found held", WINDOW,
              REFERENCE, BATCHED, held_every=1),
        Group("release", "batch release (windows of 1000)", "locks released", WINDOW, REFERENCE,
              (*BATCHED, "joblock-c-scripts")),
        Group("extend", "batch extend (windows of 1000)", "locks extended", WINDOW, REFERENCE,
              (*BATCHED, "joblock-c-scripts")),
        Group(
            "acquire_release", "batch acquire + release (windows of 1000)", "locks acquired and released",
            WINDOW, "redis-py-pipeline", (*LOCKERS, "joblock-c-limit", "joblock-c-scripts"),
        ),
        Group("metrics", "batch acquire + release (windows of 1000), metrics", "locks acquired and released",
              WINDOW, "joblock-c-unmeasured", METERED, alike=True),
        Group("dedupe", "dedupe with key building (windows of 1000)", "argument tuples", WINDOW,
              "redis-py-pipeline", LOCKERS, held_every=10),
        Group("keys", "key building alone (dedupe's keys, calls of 1000)", "keys built", WINDOW, "joblock-py",
              ("joblock-c", "joblock-py", "handwritten")),
        Group("aio_single", "asyncio: single acquire + release, one task", "acquire+release pairs", 1,
              "redis-py-asyncio-lock", (*AIO_LOCKERS, "bare-protocol")),
        Group("aio_acquire", "asyncio: batch acquire (windows of 1000)", "locks acquired", WINDOW,
              "redis-py-asyncio-pipeline", AIO_LOCKERS),
    )
}  # fmt: skip
GROUPS.update({g.id: g for g in crowds.CROWD_GROUPS})
GROUPS[contention.GROUP.id] = contention.GROUP  # measured by ``contention`` itself, not by cases
AIO_GROUPS = ("aio_single", "aio_acquire", *(g for g in GROUPS if g.startswith("aio_tasks")))
# Names that select several groups at once (``joblock bench --only asyncio``).
GROUP_SETS = {
    "asyncio": AIO_GROUPS,
    "concurrency": ("single", "aio_single", *(g for g in GROUPS if g.startswith(("threads", "aio_tasks")))),
    "cluster": ("cluster_acquire", "redlock_single", "redlock_acquire"),
}

# Labels per contender; a group may name what a peer does there more precisely.
LABELS = {
    "redis-benchmark": "redis-benchmark -c 1 -P 1000",
    "joblock-c": "joblock (compiled)",
    "joblock-py": "joblock (pure)",
    "joblock-c-calls": "joblock (compiled), calls of 1000",
    "joblock-c-limit": "joblock (compiled), counting locks, limit=2",
    "joblock-c-scripts": "joblock (compiled), native_commands=False",
    "joblock-c-unmeasured": "joblock (compiled), no metrics layer",
    "joblock-c-instrumented": "joblock (compiled), instrumented",
    "redis-py-lock": "redis-py Lock",
    "redis-py-pipeline": "redis-py pipeline",
    "python-redis-lock": "python-redis-lock",
    "pottery": "pottery Redlock (1 master)",
    "handwritten": "hand-written f-string join",
    "redis-py-asyncio-lock": "redis.asyncio Lock",
    "redis-py-asyncio-pipeline": "redis.asyncio pipeline",
    "bare-socket": "bare socket, the same two commands",
    "bare-protocol": "bare asyncio protocol, the same two commands",
    "joblock-c-one-server": "joblock Locks (compiled), one server",
    "redis-py-cluster-pipeline": "redis-py RedisCluster pipeline",
}
GROUP_LABELS = {
    ("single", "redis-py-pipeline"): "redis-py SET NX PX + EVALSHA",
    ("acquire", "redis-benchmark"): "redis-benchmark SET NX PX GET",
    ("acquire", WITHOUT_GET): "redis-benchmark SET NX PX, without GET",
    ("acquire_held", "redis-benchmark"): "redis-benchmark SET NX PX GET",
    ("acquire_held", WITHOUT_GET): "redis-benchmark SET NX PX, without GET",
    ("release", "redis-benchmark"): "redis-benchmark compare-and-delete",
    ("release", MISSING): "redis-benchmark compare-and-delete, keys absent",
    ("extend", "redis-benchmark"): "redis-benchmark compare-and-pexpire",
    ("extend", "redis-py-pipeline"): "redis-py pipeline, EVALSHA",
    ("aio_single", "joblock-c"): "joblock AsyncLocks (compiled)",
    ("aio_single", "joblock-py"): "joblock AsyncLocks (pure)",
    ("aio_single", "redis-py-asyncio-pipeline"): "redis.asyncio SET NX PX + EVALSHA",
    ("aio_acquire", "joblock-c"): "joblock AsyncLocks (compiled)",
    ("aio_acquire", "joblock-py"): "joblock AsyncLocks (pure)",
    **{(g, c): f"joblock AsyncLocks ({kind})" for g in GROUPS if g.startswith("aio_tasks")
       for c, kind in (("joblock-c", "compiled"), ("joblock-py", "pure"))},
    ("cluster_acquire", "joblock-c"): "joblock ClusterLocks (compiled)",
    ("cluster_acquire", "joblock-py"): "joblock ClusterLocks (pure)",
    **{(g, c): f"joblock Redlock ({kind})" for g in ("redlock_single", "redlock_acquire")
       for c, kind in (("joblock-c", "compiled"), ("joblock-py", "pure"))},
    ("redlock_single", "pottery"): "pottery Redlock (3 masters)",
    ("redlock_acquire", "pottery"): "pottery Redlock (3 masters), a loop",
    **contention.GROUP_LABELS,
}  # fmt: skip


def one_call_contenders(group: str) -> list[str]:
    """The contenders of ``group`` when a round is one call (of 1000): pytest-benchmark's.

    joblock-c-calls is then the same as joblock-c, so it is left out.
    """
    return [c for c in GROUPS[group].contenders if c != "joblock-c-calls"]


def label(group: str, contender: str) -> str:
    return GROUP_LABELS.get((group, contender), LABELS.get(contender, contender))


# -- the cases ------------------------------------------------------------------------------


def _handwritten_key(namespace: str, args: tuple[Any, ...]) -> str:
    # What a redis-py user writes for resque-lock-timeout's key: arguments joined by "-".
    return f"{namespace}:{JOB}:" + "-".join(map(str, args))


class _Peer:
    """A peer's single-lock API, as a user of it would call it, and its batch forms."""

    def __init__(self, arena: Arena, contender: str) -> None:
        self.arena = arena
        self.contender = contender
        ttl = arena.ttl
        r = arena.redis()
        self.new: Callable[[str], Any]
        # Resets a held lock's ttl to the one it was taken with (the others' own default).
        self.renew: Callable[[Any], object] = lambda lock: lock.extend()
        if contender == "redis-py-lock":
            self.new = lambda key: r.lock(key, timeout=ttl)
            self.renew = lambda lock: lock.extend(ttl, replace_ttl=True)
        elif contender == "python-redis-lock":
            redis_lock = peer("redis_lock", "python-redis-lock")
            # It logs a warning for every lock it finds taken: dedupe's duplicates, here.
            logging.getLogger("redis_lock").setLevel(logging.ERROR)
            expire = max(1, round(ttl))
            self.new = lambda key: redis_lock.Lock(r, key, expire=expire)
        elif contender == "pottery":
            redlock = peer("pottery", "pottery").Redlock
            masters = {r}
            self.new = lambda key: redlock(key=key, masters=masters, auto_release_time=ttl)
        else:
            raise ValueError(contender)

    def acquire(self, keys: Sequence[str]) -> list[Any]:
        out = []
        new = self.new
        for key in keys:
            lock = new(key)
            out.append(lock if lock.acquire(blocking=False) else None)
        return out

    def release(self, held: Sequence[Any]) -> list[Any]:
        return _each(held, lambda lock: lock.release())

    def extend(self, held: Sequence[Any]) -> list[Any]:
        return _each(held, self.renew)

    def single(self, keys: Sequence[str]) -> list[Any]:
        out = []
        new = self.new
        for key in keys:
            lock = new(key)
            if lock.acquire(blocking=False):
                lock.release()
                out.append(True)
            else:
                out.append(False)
        return out


def _each(held: Sequence[Any], act: Callable[[Any], object]) -> list[Any]:
    """``act`` on each held lock of a peer's: True, or False for a lock not taken. Every
    peer's release and extend raise when the lock was not theirs any more."""
    out: list[Any] = []
    for lock in held:
        if lock is None:
            out.append(False)
            continue
        act(lock)
        out.append(True)
    return out


class _Pipeline:
    """redis-py with its hiredis parser: SET NX PX and EVALSHA release, pipelined."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.r = arena.redis()
        self.ms = arena.ms

    def acquire(self, keys: Sequence[str]) -> list[Any]:
        pipe = self.r.pipeline(transaction=False)
        values = self.arena.tokens(len(keys))
        for key, value in zip(keys, values):
            pipe.set(key, value, nx=True, px=self.ms)
        return [(k, v) if ok else None for k, v, ok in zip(keys, values, pipe.execute())]

    def release(self, held: Sequence[Any]) -> list[Any]:
        pipe = self.r.pipeline(transaction=False)
        for item in held:
            if item is not None:
                pipe.evalsha(RELEASE_SHA, 1, item[0], item[1])
        return pipe.execute()  # type: ignore[no-any-return]

    def extend(self, held: Sequence[Any]) -> list[Any]:
        pipe = self.r.pipeline(transaction=False)
        for item in held:
            if item is not None:
                pipe.evalsha(EXTEND_SHA, 1, item[0], item[1], self.ms)
        return pipe.execute()  # type: ignore[no-any-return]

    def single(self, keys: Sequence[str]) -> list[Any]:
        r, ms, out = self.r, self.ms, []
        for key, value in zip(keys, self.arena.tokens(len(keys))):
            if r.set(key, value, nx=True, px=ms):
                out.append(r.evalsha(RELEASE_SHA, 1, key, value) == 1)
            else:
                out.append(False)
        return out


def _batched(fn: Callable[[Sequence[Any]], list[Any]]) -> Callable[[list[Sequence[Any]]], list[Any]]:
    """Calls ``fn`` once per chunk (of ``WINDOW`` items) and joins the results."""

    def run(chunks: list[Sequence[Any]]) -> list[Any]:
        out: list[Any] = []
        for chunk in chunks:
            out.extend(fn(chunk))
        return out

    return run


class _Joblock:
    """joblock's API, on one twin of the core."""

    def __init__(self, arena: Arena, contender: str) -> None:
        # The compiled contenders share one client, but for the one whose client differs.
        own = contender == "joblock-c-scripts" or not contender.startswith("joblock-c")
        self.locks: Locks = arena.locks(contender if own else "joblock-c")
        self.ttl = arena.ttl
        self.limit = 2 if contender == "joblock-c-limit" else 1
        self.batch: Any = _Unmeasured(self.locks) if contender == "joblock-c-unmeasured" else self.locks

    def acquire(self, keys: Sequence[str]) -> list[Any]:
        return self.batch.acquire_many(keys, self.ttl, limit=self.limit)  # type: ignore[no-any-return]

    def release(self, held: Sequence[Any]) -> list[Any]:
        return self.batch.release_many(held)  # type: ignore[no-any-return]

    def extend(self, held: Sequence[Any]) -> list[Any]:
        return self.batch.extend_many(held, self.ttl)  # type: ignore[no-any-return]

    def dedupe(self, arg_tuples: Sequence[tuple[Any, ...]]) -> list[Any]:
        return self.locks.dedupe(JOB, arg_tuples, self.ttl)

    def single(self, keys: Sequence[str]) -> list[Any]:
        out: list[Any] = []
        acquire, ttl, limit = self.locks.acquire, self.ttl, self.limit
        for key in keys:
            lease = acquire(key, ttl, limit=limit)
            out.append(lease is not None and lease.release())
        return out


class _Unmeasured:
    """A Locks' batch methods without the wrapper of ``joblock.metrics.measured``: the
    batch path as it was before metrics, the metrics group's reference."""

    def __init__(self, locks: Locks) -> None:
        # The plain methods, whether or not instrument() put reporting ones in their place.
        self.acquire_many = functools.partial(_plain(Locks.acquire_many), locks)
        self.release_many = functools.partial(_plain(Locks.release_many), locks)


def _plain(method: Callable[..., Any]) -> Callable[..., Any]:
    plain: Callable[..., Any] = getattr(method, "__wrapped__", method)
    return plain


def _instrumented(run: Callable[[Any], list[Any]]) -> Callable[[Any], list[Any]]:
    """``run`` recording joblock's metrics into an OpenTelemetry SDK meter (read by an
    in-memory reader) while it runs, and only then: the group's other contenders,
    interleaved with it, stay uninstrumented."""
    sdk = peer("opentelemetry.sdk.metrics", "'joblock[bench]'")
    readers = peer("opentelemetry.sdk.metrics.export", "'joblock[bench]'")
    saved = metrics.recorder
    metrics.instrument(sdk.MeterProvider(metric_readers=[readers.InMemoryMetricReader()]))
    recorder, metrics.recorder = metrics.recorder, saved

    def timed(state: Any) -> list[Any]:
        before, metrics.recorder = metrics.recorder, recorder
        try:
            return run(state)
        finally:
            metrics.recorder = before

    return timed


class _AsyncJoblock:
    """joblock's AsyncLocks, on one twin of the core."""

    def __init__(self, arena: Arena, contender: str) -> None:
        self.locks: AsyncLocks = arena.locks(contender, AsyncLocks)
        self.ttl = arena.ttl

    async def acquire(self, keys: Sequence[str]) -> list[Any]:
        return await self.locks.acquire_many(keys, self.ttl)

    async def single(self, keys: Sequence[str]) -> list[Any]:
        out: list[Any] = []
        acquire, ttl = self.locks.acquire, self.ttl
        for key in keys:
            lease = await acquire(key, ttl)
            out.append(lease is not None and await lease.release())
        return out


class _AsyncLock:
    """redis.asyncio's Lock, as a user of it would call it."""

    def __init__(self, arena: Arena) -> None:
        r, ttl = arena.aio_redis(), arena.ttl
        self.new: Callable[[str], Any] = lambda key: r.lock(key, timeout=ttl)

    async def acquire(self, keys: Sequence[str]) -> list[Any]:
        out = []
        for key in keys:
            lock = self.new(key)
            out.append(lock if await lock.acquire(blocking=False) else None)
        return out

    async def single(self, keys: Sequence[str]) -> list[Any]:
        out = []
        for key in keys:
            lock = self.new(key)
            if await lock.acquire(blocking=False):
                await lock.release()
                out.append(True)
            else:
                out.append(False)
        return out


class _AsyncPipeline:
    """redis.asyncio with its hiredis parser: SET NX PX and EVALSHA release, pipelined."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.r = arena.aio_redis()
        self.ms = arena.ms

    async def acquire(self, keys: Sequence[str]) -> list[Any]:
        pipe = self.r.pipeline(transaction=False)
        values = self.arena.tokens(len(keys))
        for key, value in zip(keys, values):
            pipe.set(key, value, nx=True, px=self.ms)
        return [(k, v) if ok else None for k, v, ok in zip(keys, values, await pipe.execute())]

    async def single(self, keys: Sequence[str]) -> list[Any]:
        r, ms, out = self.r, self.ms, []
        for key, value in zip(keys, self.arena.tokens(len(keys))):
            if await r.set(key, value, nx=True, px=ms):
                out.append(await r.evalsha(RELEASE_SHA, 1, key, value) == 1)
            else:
                out.append(False)
        return out


def _on_loop(
    arena: Arena, fn: Callable[[Sequence[Any]], Awaitable[list[Any]]]
) -> Callable[[list[Sequence[Any]]], list[Any]]:
    """``_batched`` for a coroutine function: one chunk after another, on the arena's loop."""

    async def run(chunks: list[Sequence[Any]]) -> list[Any]:
        out: list[Any] = []
        for chunk in chunks:
            out.extend(await fn(chunk))
        return out

    return lambda chunks: arena.run(run(chunks))


def _aio_case(arena: Arena, group: str, contender: str) -> Case:
    ops: _AsyncJoblock | _AsyncLock | _AsyncPipeline
    if contender in ("joblock-c", "joblock-py"):
        ops = _AsyncJoblock(arena, contender)
    elif contender == "redis-py-asyncio-pipeline":
        ops = _AsyncPipeline(arena)
    else:
        ops = _AsyncLock(arena)
    if group == "aio_single":
        single = ops.single
        return Case(group, contender, arena.keys, lambda keys: arena.run(single(keys)))
    # As in the threaded groups: joblock takes the whole batch, the peers calls of 1000.
    size = None if contender.startswith("joblock") else WINDOW
    return Case(group, contender, _keys(arena, size), _on_loop(arena, ops.acquire))


def make_case(arena: Arena, group: str, contender: str) -> Case:
    """The case of ``contender`` in ``group``; Unavailable when it cannot run here."""
    if contender not in GROUPS[group].contenders:
        raise Unavailable(f"not part of {group!r}")
    crowd = crowds.make_case(arena, group, contender)
    if crowd is not None:
        return crowd
    if group in AIO_GROUPS:
        return _aio_case(arena, group, contender)
    ns = arena.namespace

    if group == "keys":
        if contender == "handwritten":
            return Case(
                group, contender, _tuples(arena), _batched(lambda c: [_handwritten_key(ns, t) for t in c])
            )
        core = compiled_core() if contender == "joblock-c" else _core_py
        prefix = ns.encode()
        return Case(group, contender, _tuples(arena), _batched(lambda c: core.build_keys(prefix, JOB, c, 0)))

    ops: _Joblock | _Pipeline | _Peer
    if contender in (
        "joblock-c",
        "joblock-py",
        "joblock-c-calls",
        "joblock-c-limit",
        "joblock-c-scripts",
        *METERED,
    ):
        ops = _Joblock(arena, contender)
        acquire, release, single, dedupe = ops.acquire, ops.release, ops.single, ops.dedupe
    else:
        ops = _Pipeline(arena) if contender == "redis-py-pipeline" else _Peer(arena, contender)
        acquire, release, single = ops.acquire, ops.release, ops.single

        def dedupe(arg_tuples: Sequence[tuple[Any, ...]]) -> list[Any]:
            return acquire([_handwritten_key(ns, t) for t in arg_tuples])

    # joblock takes a whole batch in one call and sends it in windows of 1000 itself;
    # the others get it in calls of 1000 (as does "joblock-c-calls").
    size = (
        None
        if contender in ("joblock-c", "joblock-py", "joblock-c-limit", "joblock-c-scripts", *METERED)
        else WINDOW
    )
    keys, tuples = _keys(arena, size), _tuples(arena, size)
    if group == "single":
        return Case(group, contender, arena.keys, single)
    if group == "acquire":
        return Case(group, contender, keys, _batched(acquire))
    if group == "acquire_held":

        def held(n: int) -> list[Sequence[Any]]:
            chunked = keys(n)
            if succeeded(_batched(acquire)(chunked)) != n:
                raise RuntimeError("the locks to find held could not be taken")
            return chunked

        return Case(group, contender, held, _batched(acquire))
    if group in ("release", "extend"):
        # Held locks, taken untimed; then each released, or its ttl reset, once.
        acquired = _batched(acquire)
        act = release if group == "release" else ops.extend
        return Case(group, contender, lambda n: chunks(acquired(keys(n)), size), _batched(act))
    if group in ("acquire_release", "metrics"):
        work = _batched(lambda c: release(acquire(c)))
        return Case(
            group, contender, keys, _instrumented(work) if contender.endswith("-instrumented") else work
        )
    if group == "dedupe":
        return Case(group, contender, tuples, _batched(dedupe))
    raise ValueError(group)


def _keys(arena: Arena, size: int | None = WINDOW) -> Callable[[int], list[Sequence[Any]]]:
    return lambda n: chunks(arena.keys(n), size)


def _tuples(arena: Arena, size: int | None = WINDOW) -> Callable[[int], list[Sequence[Any]]]:
    return lambda n: chunks(arena.arg_tuples(n), size)


# -- the reference: redis-benchmark -----------------------------------------------------------


def redis_benchmark_argv(settings: Settings, n: int, keyspace: int, command: Sequence[str]) -> list[str]:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        raise Unavailable("not on PATH")
    if settings.tls:
        raise Unavailable("not run over TLS")
    argv = [exe, "-c", "1", "-P", str(WINDOW), "-n", str(n), "-r", str(keyspace), "--csv"]
    if settings.path is not None:
        argv += ["-s", settings.path]
    else:
        argv += ["-h", settings.host, "-p", str(settings.port)]
    if settings.password is not None:  # redis-benchmark takes it on the command line only
        argv += ["-a", settings.password] + (["--user", settings.username] if settings.username else [])
    if settings.db:
        argv += ["--dbnum", str(settings.db)]
    return argv + list(command)


def _rb_run(argv: list[str]) -> float:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    lines = [
        line for line in proc.stdout.splitlines() if line.startswith('"') and not line.startswith('"test"')
    ]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"redis-benchmark failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
    return float(lines[-1].split('","')[1])


# Fills keys joblock:bench:000000000000.. with one value, as redis-benchmark's release will
# pick them (its __rand_int__ is zero-padded to 12 digits).
_POPULATE = b"""\
local v, ms, from, to = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
for i = from, to - 1 do redis.call('SET', string.format('joblock:bench:%012d', i), v, 'PX', ms) end
return to - from
"""


class RedisBenchmark:
    """The reference of the batch groups: redis-benchmark, one client, pipeline of 1000."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.value = "v" * arena.value_len
        redis_benchmark_argv(arena.settings, 1, 1, [])  # raises Unavailable early

    def run(self, what: str, n: int) -> tuple[float, dict[str, Any]]:
        """ops/s of ``n`` commands: "acquire" or "acquire-held" (either "-without-get"),
        "release", "release-missing", or "extend"."""
        a = self.arena
        key = "joblock:bench:__rand_int__"
        # Picks among n keys filled beforehand, or (acquire, release-missing) among keys never there.
        filled = what.startswith("acquire-held") or what in ("release", "extend")
        space = n if filled else RB_KEYSPACE
        if what.startswith("acquire"):
            command = ["SET", key, self.value, "NX", "PX", str(a.ms), "GET"]
            if what.endswith("without-get"):
                command.pop()
            elif not a.nx_get:
                raise Unavailable("Redis < 7 refuses SET NX GET: see the reference without GET")
        else:
            command = self.compare(what.partition("-")[0], key)
        if filled:
            # Its picks are random, so to compare-and-delete like joblock's releases they
            # must find locks: n keys are filled first (as many as joblock's case holds);
            # 1 - 1/e of the picks then delete, the others find the key gone. An extend
            # and an acquire of held locks find one at every pick.
            for start in range(0, space, 100_000):
                a.call("EVAL", _POPULATE, 0, self.value, a.ms, start, min(space, start + 100_000))
        before = int(a.call("DBSIZE"))
        try:
            rate = _rb_run(redis_benchmark_argv(a.settings, n, space, command))
            extra: dict[str, Any] = {"command": " ".join(command).replace(self.value, "<value>")}
            if what.startswith("release"):
                extra["deleting_fraction"] = round((before - int(a.call("DBSIZE"))) / n, 3)
            return rate, extra
        finally:
            a.purge(RB_PATTERN)

    def compare(self, op: str, key: str) -> list[str]:
        """What the release (``op`` "release") or extend ("extend") of a lock nobody waits
        for costs at the server: its native compare-and-delete or compare-and-set of the
        ttl where it has one (as joblock's connections find it), else the plain script,
        which is joblock's there."""
        a, value = self.arena, self.value
        native = a.dialect
        if op == "release" and native is not None and native.release is not None:
            if b"DELIFEQ" in native.release[0]:
                return ["DELIFEQ", key, value]
            return ["DELEX", key, "IFEQ", value]
        if op == "extend" and native is not None and native.extend:
            return ["SET", key, value, "IFEQ", value, "PX", str(a.ms)]
        if op == "release":
            script, sha, args = RELEASE_PLAIN, RELEASE_PLAIN_SHA, []
        else:
            script, sha, args = EXTEND_PLAIN, EXTEND_PLAIN_SHA, [str(a.ms)]
        a.call("SCRIPT", "LOAD", script)
        return ["EVALSHA", sha.decode(), "1", key, value, *args]
