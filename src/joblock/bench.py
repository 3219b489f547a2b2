"""``joblock bench``: joblock side by side with redis-benchmark and the Python peers.

Six groups of one operation each (``GROUPS``). In a group every contender does the
same work on fresh keys (``joblock:bench:`` + 12 digits, unique to the run) with lock
values as long as joblock's, over one connection to one server; ``purge()`` removes
what each repetition left. joblock gets a whole batch per call and sends it in windows
of 1000 itself; the peers get it in calls of 1000 (one redis-py pipeline each, or a
loop over their single-lock API), and so does "joblock (compiled), calls of 1000".

A repetition times one contender doing ``n`` operations, ``n`` sized to take about
``Options.seconds``. The repetitions of a group are interleaved (round 1 of every
contender, then round 2, ...) so that a noisy machine slows them alike; the table
quotes medians and their ratio to the group's reference. That is ``redis-benchmark
-c 1 -P 1000`` for batch acquire (SET NX PX) and release (EVALSHA of joblock's release
script, on keys filled beforehand so that most picks compare and delete), redis-py
for the other lock groups, and the pure twin for key building.

The contenders live here only: ``benchmarks/`` (pytest-benchmark) runs these cases.
The peers (redis-py, python-redis-lock, pottery) are optional: a missing one is
reported as "not installed", as is redis-benchmark when it is not on PATH.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import json
import logging
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from . import _core_py, errors
from ._core import core as _active_core
from ._core import implementation
from ._scripts import RELEASE, RELEASE_SHA
from .connection import Connection
from .locks import Locks
from .settings import Settings, parse_url

__all__ = [
    "CONTENDERS", "GROUPS", "Arena", "Case", "Unavailable", "add_arguments", "label", "make_case",
    "one_call_contenders", "run", "succeeded",
]  # fmt: skip

WINDOW = 1000  # keys per batch call, and redis-benchmark's -P
JOB = "ProductSalesJob"
TTL = 60.0
REFERENCE = "redis-benchmark"
MISSING = "redis-benchmark-missing"  # release's EVALSHA on keys that are not there
# redis-benchmark's keys: "joblock:bench:" + 12 digits below this, i.e. "000" then 9
# digits. joblock's own keys put a run id of 100-999 in those first three digits.
RB_KEYSPACE = 10**9
RB_PATTERN = "joblock:bench:000*"


@dataclass(frozen=True)
class Group:
    id: str
    title: str
    unit: str  # what one operation is
    batch: int  # operations per call (and per pytest-benchmark round)
    reference: str  # a contender id, or REFERENCE
    contenders: tuple[str, ...]


PEERS = ("redis-py-lock", "redis-py-pipeline", "python-redis-lock", "pottery")
LOCKERS = ("joblock-c", "joblock-py", *PEERS)
# joblock-c-calls: the compiled core called once per 1000 keys, as the peers are.
CONTENDERS = (*LOCKERS, "joblock-c-calls", "handwritten")
BATCHED = ("joblock-c", "joblock-c-calls", *LOCKERS[1:])

GROUPS: dict[str, Group] = {
    g.id: g
    for g in (
        Group("single", "single acquire + release", "acquire+release pairs", 1, "redis-py-lock", LOCKERS),
        Group("acquire", "batch acquire (windows of 1000)", "locks acquired", WINDOW, REFERENCE, BATCHED),
        Group("release", "batch release (windows of 1000)", "locks released", WINDOW, REFERENCE, BATCHED),
        Group(
            "acquire_release", "batch acquire + release (windows of 1000)", "locks acquired and released",
            WINDOW, "redis-py-pipeline", LOCKERS,
        ),
        Group("dedupe", "dedupe with key building (windows of 1000)", "argument tuples", WINDOW,
              "redis-py-pipeline", LOCKERS),
        Group("keys", "key building alone (dedupe's keys, calls of 1000)", "keys built", WINDOW, "joblock-py",
              ("joblock-c", "joblock-py", "handwritten")),
    )
}  # fmt: skip

# Labels per contender; a group may name what a peer does there more precisely.
LABELS = {
    "redis-benchmark": "redis-benchmark -c 1 -P 1000",
    "joblock-c": "joblock (compiled)",
    "joblock-py": "joblock (pure)",
    "joblock-c-calls": "joblock (compiled), calls of 1000",
    "redis-py-lock": "redis-py Lock",
    "redis-py-pipeline": "redis-py pipeline",
    "python-redis-lock": "python-redis-lock",
    "pottery": "pottery Redlock (1 master)",
    "handwritten": "hand-written f-string join",
}
GROUP_LABELS = {
    ("single", "redis-py-pipeline"): "redis-py SET NX PX + EVALSHA",
    ("acquire", "redis-benchmark"): "redis-benchmark SET NX PX",
    ("release", "redis-benchmark"): "redis-benchmark EVALSHA release",
    ("release", MISSING): "redis-benchmark EVALSHA, keys absent",
}

# The targets: (group, contender, versus, ratio at least). The -calls rows say how the
# compiled core fares called once per 1000 keys, i.e. with one window in flight, as redis-benchmark.
TARGETS = (
    ("acquire", "joblock-c", REFERENCE, 0.85),
    ("acquire", "joblock-c-calls", REFERENCE, 0.85),
    ("acquire", "joblock-c", "redis-py-pipeline", 5.0),
    ("release", "joblock-c", REFERENCE, 0.85),
    ("release", "joblock-c-calls", REFERENCE, 0.85),
    ("acquire", "joblock-py", "redis-py-pipeline", 2.0),
    ("single", "joblock-c", "redis-py-lock", 4.0),
    ("keys", "joblock-c", "joblock-py", 10.0),
)


def one_call_contenders(group: str) -> list[str]:
    """The contenders of ``group`` when a round is one call (of 1000): pytest-benchmark's.

    joblock-c-calls is then the same as joblock-c, so it is left out.
    """
    return [c for c in GROUPS[group].contenders if c != "joblock-c-calls"]


def label(group: str, contender: str) -> str:
    return GROUP_LABELS.get((group, contender), LABELS.get(contender, contender))


class Unavailable(Exception):
    """A contender that cannot run here: a peer not installed, the core not built."""


def _peer(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise Unavailable(f"not installed (pip install {package})") from None


def _compiled_core() -> ModuleType:
    if os.environ.get("JOBLOCK_NO_EXTENSIONS", "") not in ("", "0"):
        raise Unavailable("disabled (JOBLOCK_NO_EXTENSIONS)")
    try:
        return importlib.import_module("joblock._core_c")
    except ImportError:
        raise Unavailable("not built") from None


# -- the arena: one server, fresh keys, cleanup ---------------------------------------------


class Arena:
    """Where the contenders run: one Redis URL, a key namespace unique to this run.

    Keys are ``joblock:bench:<12 digits>``: a run id of 100-999, then a counter, so
    every repetition takes keys no one has used. ``purge()`` deletes what a
    repetition left (the peers' own key forms included).
    """

    def __init__(self, url: str, ttl: float = TTL) -> None:
        self.url = url
        self.settings: Settings = parse_url(url)
        self.ttl = ttl
        self.ms = round(ttl * 1000)
        self.run_id = random.randrange(100, 1000)
        self.namespace = f"joblock:bench:{self.run_id}"
        self._counter = 0
        self._admin: Connection | None = None
        self._locks: dict[str, Locks] = {}
        self._redis: Any = None
        probe = Locks(url)
        self.holder = probe._holder_suffix()
        probe.close()
        # joblock's lock values: 32 hex chars of token, then "@host:pid".
        self.value_len = 32 + len(self.holder)

    # keys
    def keys(self, n: int) -> list[str]:
        """``n`` keys never handed out before: ``joblock:bench:`` + 12 digits."""
        start = self._counter
        self._counter += n
        return [f"{self.namespace}{i:09d}" for i in range(start, start + n)]

    def arg_tuples(self, n: int) -> list[tuple[Any, ...]]:
        """Dedupe's input: ``(product_id, "daily")``, one in ten a repeat of the one before."""
        start = self._counter
        self._counter += n
        return [(start + i * 9 // 10, "daily") for i in range(n)]

    def tokens(self, n: int) -> list[str]:
        """Lock values for the peers written by hand: as long as joblock's, as random."""
        hexes = os.urandom(16 * n).hex()
        holder = self.holder.decode()
        return [hexes[i : i + 32] + holder for i in range(0, 32 * n, 32)]

    # clients
    def admin(self) -> Connection:
        if self._admin is None:
            self._admin = Connection(self.settings, _active_core)
        return self._admin

    def locks(self, contender: str) -> Locks:
        """Locks on the compiled or the pure twin, prefixed with this run's namespace."""
        if contender not in self._locks:
            core = _compiled_core() if contender == "joblock-c" else _core_py
            cls: type[Locks] = type("Locks", (Locks,), {"_core": core})
            self._locks[contender] = cls(self.url, prefix=self.namespace)
        return self._locks[contender]

    def redis(self) -> Any:
        """A redis-py client (hiredis parses its replies when installed)."""
        if self._redis is None:
            redis = _peer("redis", "redis")
            self._redis = redis.Redis.from_url(self.url)
            self._redis.script_load(RELEASE)
        return self._redis

    # server
    def call(self, *args: bytes | str | int) -> Any:
        return self.admin().call(*args)

    def info(self, section: str = "server") -> dict[str, str]:
        text = self.call("INFO", section).decode()
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def purge(self, pattern: str | None = None) -> int:
        """Deletes the keys matching ``pattern`` (default: all this run made)."""
        pattern = pattern or f"*{self.namespace}*"
        cursor, deleted = b"0", 0
        while True:
            cursor, found = self.call("SCAN", cursor, "MATCH", pattern, "COUNT", 10000)
            if found:
                deleted += self.call("UNLINK", *found)
            if cursor == b"0":
                return deleted

    def close(self) -> None:
        self.purge()
        self.purge(RB_PATTERN)
        for locks in self._locks.values():
            locks.close()
        if self._redis is not None:
            self._redis.close()
        if self._admin is not None:
            self._admin.close()

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# -- the cases ------------------------------------------------------------------------------


@dataclass
class Case:
    """One contender in one group.

    ``prepare(n)`` (untimed) makes the input of ``n`` operations: fresh keys, or the
    leases to release; ``run(input)`` (timed) does them and returns one entry per
    operation (a lease or lock, True, or a falsy value where it failed).
    """

    group: str
    contender: str
    prepare: Callable[[int], Any]
    run: Callable[[Any], list[Any]]

    @property
    def label(self) -> str:
        return label(self.group, self.contender)


def _chunks(items: Sequence[Any], size: int | None = WINDOW) -> list[Sequence[Any]]:
    """``items`` in calls of ``size``; all in one call when ``size`` is None."""
    if size is None:
        return [items]
    return [items[i : i + size] for i in range(0, len(items), size)]


def succeeded(results: list[Any]) -> int:
    """How many operations of a run succeeded (None, False and 0 did not)."""
    return sum(1 for r in results if r is not None and r is not False and not (type(r) is int and r <= 0))


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
        if contender == "redis-py-lock":
            self.new = lambda key: r.lock(key, timeout=ttl)
        elif contender == "python-redis-lock":
            redis_lock = _peer("redis_lock", "python-redis-lock")
            # It logs a warning for every lock it finds taken: dedupe's duplicates, here.
            logging.getLogger("redis_lock").setLevel(logging.ERROR)
            expire = max(1, round(ttl))
            self.new = lambda key: redis_lock.Lock(r, key, expire=expire)
        elif contender == "pottery":
            redlock = _peer("pottery", "pottery").Redlock
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
        out: list[Any] = []
        for lock in held:
            if lock is None:
                out.append(False)
                continue
            lock.release()  # every one of these raises when the lock was not ours
            out.append(True)
        return out

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
        self.locks = arena.locks("joblock-c" if contender.startswith("joblock-c") else contender)
        self.ttl = arena.ttl

    def acquire(self, keys: Sequence[str]) -> list[Any]:
        return self.locks.acquire_many(keys, self.ttl)

    def release(self, held: Sequence[Any]) -> list[Any]:
        return self.locks.release_many(held)

    def dedupe(self, arg_tuples: Sequence[tuple[Any, ...]]) -> list[Any]:
        return self.locks.dedupe(JOB, arg_tuples, self.ttl)

    def single(self, keys: Sequence[str]) -> list[Any]:
        out: list[Any] = []
        acquire, ttl = self.locks.acquire, self.ttl
        for key in keys:
            lease = acquire(key, ttl)
            out.append(lease is not None and lease.release())
        return out


def make_case(arena: Arena, group: str, contender: str) -> Case:
    """The case of ``contender`` in ``group``; Unavailable when it cannot run here."""
    if contender not in GROUPS[group].contenders:
        raise Unavailable(f"not part of {group!r}")
    ns = arena.namespace

    if group == "keys":
        if contender == "handwritten":
            return Case(
                group, contender, _tuples(arena), _batched(lambda c: [_handwritten_key(ns, t) for t in c])
            )
        core = _compiled_core() if contender == "joblock-c" else _core_py
        prefix = ns.encode()
        return Case(group, contender, _tuples(arena), _batched(lambda c: core.build_keys(prefix, JOB, c, 0)))

    ops: _Joblock | _Pipeline | _Peer
    if contender in ("joblock-c", "joblock-py", "joblock-c-calls"):
        ops = _Joblock(arena, contender)
        acquire, release, single, dedupe = ops.acquire, ops.release, ops.single, ops.dedupe
    else:
        ops = _Pipeline(arena) if contender == "redis-py-pipeline" else _Peer(arena, contender)
        acquire, release, single = ops.acquire, ops.release, ops.single

        def dedupe(arg_tuples: Sequence[tuple[Any, ...]]) -> list[Any]:
            return acquire([_handwritten_key(ns, t) for t in arg_tuples])

    # joblock takes a whole batch in one call and sends it in windows of 1000 itself;
    # the others get it in calls of 1000 (as does "joblock-c-calls").
    size = None if contender in ("joblock-c", "joblock-py") else WINDOW
    keys, tuples = _keys(arena, size), _tuples(arena, size)
    if group == "single":
        return Case(group, contender, arena.keys, single)
    if group == "acquire":
        return Case(group, contender, keys, _batched(acquire))
    if group == "release":
        acquired = _batched(acquire)
        return Case(group, contender, lambda n: _chunks(acquired(keys(n)), size), _batched(release))
    if group == "acquire_release":
        return Case(group, contender, keys, _batched(lambda c: release(acquire(c))))
    if group == "dedupe":
        return Case(group, contender, tuples, _batched(dedupe))
    raise ValueError(group)


def _keys(arena: Arena, size: int | None = WINDOW) -> Callable[[int], list[Sequence[Any]]]:
    return lambda n: _chunks(arena.keys(n), size)


def _tuples(arena: Arena, size: int | None = WINDOW) -> Callable[[int], list[Sequence[Any]]]:
    return lambda n: _chunks(arena.arg_tuples(n), size)


# -- measuring ------------------------------------------------------------------------------


@dataclass
class Result:
    group: str
    contender: str
    label: str
    status: str = "ok"  # "ok", "not installed ...", "error: ..."
    n: int = 0
    samples: list[float] = field(default_factory=list)  # ops/s of each repetition
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def time_case(case: Case, arena: Arena, n: int) -> float:
    """One repetition: ``n`` operations on fresh keys; ops/s. Cleans up after itself."""
    state = case.prepare(n)
    gc.collect()
    t0 = time.perf_counter()
    results = case.run(state)
    elapsed = time.perf_counter() - t0
    done = succeeded(results)
    del results, state
    if case.group != "keys":
        arena.purge()
    expected = n - n // 10 if case.group == "dedupe" else n
    if done != expected:
        raise RuntimeError(f"{done} of {n} operations succeeded, expected {expected}")
    return n / elapsed


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
        """ops/s of ``n`` commands: "acquire", "release", or "release-missing"."""
        a = self.arena
        key = "joblock:bench:__rand_int__"
        if what == "acquire":
            command, space = ["SET", key, self.value, "NX", "PX", str(a.ms)], RB_KEYSPACE
        else:
            command = ["EVALSHA", RELEASE_SHA.decode(), "1", key, self.value]
            a.call("SCRIPT", "LOAD", RELEASE)
            space = n if what == "release" else RB_KEYSPACE
        if what == "release":
            # Its picks are random, so to compare-and-delete like joblock's releases they
            # must find locks: n keys are filled first (as many as joblock's case holds);
            # 1 - 1/e of the picks then delete, the others find the key gone.
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


@dataclass
class Options:
    ops: int = 100_000  # most operations in one repetition
    repeat: int = 5
    seconds: float = 0.3  # a repetition of a slow contender is cut to about this
    groups: tuple[str, ...] = tuple(GROUPS)
    contenders: tuple[str, ...] = (REFERENCE, *CONTENDERS)
    memory: bool = True


def _size(group: Group, rate: float, opts: Options) -> int:
    cap = opts.ops * (10 if group.id == "keys" else 1)
    n = min(cap, int(rate * opts.seconds))
    if group.batch == 1:
        return max(10, n)
    # Whole calls of 1000; a contender too slow for one call per repetition does part of one.
    step = group.batch if n >= group.batch else 100
    return max(100, n // step * step)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure_group(arena: Arena, group: Group, opts: Options) -> list[Result]:
    """Every contender of ``group``, ``opts.repeat`` interleaved rounds each."""
    results: list[Result] = []
    cases: list[tuple[Result, Case]] = []
    for contender in group.contenders:
        result = Result(group.id, contender, label(group.id, contender))
        results.append(result)
        if contender not in opts.contenders:
            result.status = "skipped"
            continue
        try:
            case = make_case(arena, group.id, contender)
            # Warm-up: connects, loads scripts, and sizes the repetitions.
            probe = group.batch if group.batch > 1 else 20
            result.n = _size(group, time_case(case, arena, probe), opts)
        except Unavailable as e:
            result.status = str(e)
            continue
        except Exception as e:
            result.status = f"error: {type(e).__name__}: {e}"
            continue
        cases.append((result, case))

    # The batch groups' reference, and in release also EVALSHA on keys that are not there.
    rows = {
        "acquire": [("acquire", REFERENCE)],
        "release": [("release", REFERENCE), ("release-missing", MISSING)],
    }
    references = [(Result(group.id, c, label(group.id, c)), what) for what, c in rows.get(group.id, [])]
    results[:0] = [r for r, _ in references]
    rb: RedisBenchmark | None = None
    for ref, _ in references:
        # As many operations as joblock's compiled core does.
        ref.n = next((r.n for r, _ in cases if r.contender == "joblock-c"), opts.ops)
        try:
            if REFERENCE not in opts.contenders:  # selects both rows
                raise Unavailable("skipped")
            rb = RedisBenchmark(arena)
        except Unavailable as e:
            ref.status = str(e)

    for round_ in range(1, opts.repeat + 1):
        line = []
        for ref, what in references:
            if rb is None or ref.status != "ok":
                continue
            try:
                rate, ref.extra = rb.run(what, ref.n)
            except Exception as e:
                ref.status = f"error: {e}"
                continue
            ref.samples.append(rate)
            line.append(f"{ref.label} {_fmt(rate)}")
        for result, case in cases:
            if result.status != "ok":
                continue
            try:
                rate = time_case(case, arena, result.n)
            except Exception as e:
                result.status = f"error: {type(e).__name__}: {e}"
                arena.purge()
                continue
            result.samples.append(rate)
            line.append(f"{result.label} {_fmt(rate)}")
        _progress(f"  {group.title}, round {round_}/{opts.repeat}: " + ", ".join(line))
    return results


def lease_bytes(arena: Arena, contenders: Sequence[str], n: int = 10_000) -> dict[str, Any]:
    """Bytes per held lease (tracemalloc): what ``n`` held locks cost the client."""
    out: dict[str, Any] = {}
    for contender in contenders:
        if contender not in GROUPS["acquire"].contenders:
            continue
        try:
            case = make_case(arena, "acquire", contender)
        except Unavailable as e:
            out[contender] = str(e)
            continue
        count = n if contender.startswith("joblock") or contender == "redis-py-pipeline" else n // 5
        state = case.prepare(count)
        case.run(case.prepare(WINDOW))  # warm: buffers grown, scripts loaded
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            held = case.run(state)
            gc.collect()
            used = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        out[contender] = round(used / max(1, succeeded(held)))
        del held, state
        arena.purge()
    return out


# -- reporting ------------------------------------------------------------------------------


def _fmt(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:,.0f}"


def _ratio(results: dict[tuple[str, str], Result], group: str, a: str, b: str) -> float | None:
    ra, rb = results.get((group, a)), results.get((group, b))
    if ra is None or rb is None or ra.median is None or rb.median is None:
        return None
    return ra.median / rb.median


def _load() -> str | None:
    # Other processes on the machine are the first suspect when numbers scatter.
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(arena: Arena) -> dict[str, Any]:
    from . import __version__

    rb = shutil.which("redis-benchmark")
    rb_out = subprocess.run([rb, "--version"], capture_output=True, text=True, check=False) if rb else None
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": _load(),
        "joblock": __version__,
        "joblock_implementation": implementation,
        "redis_version": arena.info().get("redis_version"),
        "redis_url": arena.settings.url(),
        "redis_benchmark": rb_out.stdout.strip() if rb_out else None,
        "peers": {d: _version(d) for d in ("redis", "hiredis", "python-redis-lock", "pottery")},
        "value_bytes": arena.value_len,
        "key_bytes": len("joblock:bench:") + 12,
    }


def report(results: list[Result], opts: Options) -> dict[str, Any]:
    by_key = {(r.group, r.contender): r for r in results}
    groups: dict[str, Any] = {}
    for gid in opts.groups:
        g = GROUPS[gid]
        rows = {}
        for r in results:
            if r.group != gid:
                continue
            rows[r.contender] = {
                "label": r.label,
                "status": r.status,
                "ops_per_s": r.median,
                "ratio": _ratio(by_key, gid, r.contender, g.reference),
                "n": r.n,
                "samples": [round(s, 1) for s in r.samples],
                **r.extra,
            }
        groups[gid] = {"title": g.title, "unit": g.unit, "reference": g.reference, "results": rows}
    targets = []
    for gid, a, b, least in TARGETS:
        if gid not in opts.groups:
            continue
        ratio = _ratio(by_key, gid, a, b)
        targets.append({
            "group": gid, "contender": a, "versus": b, "at_least": least, "ratio": ratio,
            "met": None if ratio is None else ratio >= least,
        })  # fmt: skip
    return {"groups": groups, "targets": targets}


def table(data: dict[str, Any]) -> str:
    env = data["environment"]
    opt = data["options"]
    lines = [
        f"joblock bench: joblock {env['joblock']} (core: {env['joblock_implementation']}), "
        f"Python {env['python']}, {env['cpu_count']} CPUs (load {env['load_average']}), "
        f"Redis {env['redis_version']} at {env['redis_url']}",
        f"keys of {env['key_bytes']} bytes, values of {env['value_bytes']} bytes; "
        f"medians of {opt['repeat']} interleaved repetitions; ratio = ops/s / the reference's (*)",
    ]
    for g in data["groups"].values():
        lines += ["", f"{g['title']} [ops/s = {g['unit']} per second]"]
        lines.append(f"  {'contender':<34} {'ops/s':>12} {'ratio':>8}   {'n':>7}")
        for contender, row in g["results"].items():
            mark = "*" if contender == g["reference"] else " "
            if row["ops_per_s"] is None:
                lines.append(f" {mark}{row['label']:<34} {row['status']}")
                continue
            ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
            note = (
                f"   ({row['deleting_fraction']:.0%} of its releases delete)"
                if "deleting_fraction" in row
                else ""
            )
            lines.append(
                f" {mark}{row['label']:<34} {_fmt(row['ops_per_s']):>12} {ratio:>8}   {row['n']:>7}{note}"
            )
    if data.get("lease_bytes"):
        lines += ["", "bytes per held lease (tracemalloc: lease or lock object, key, token, list slot)"]
        for contender, value in data["lease_bytes"].items():
            shown = f"{value:>12,}" if isinstance(value, int) else f"{value:>12}"
            lines.append(f"  {LABELS[contender]:<34} {shown}")
    if data["targets"]:
        lines += ["", "targets (ratios of medians from this run)"]
        for t in data["targets"]:
            what = f"{GROUPS[t['group']].title}: {LABELS[t['contender']]} / {label(t['group'], t['versus'])}"
            got = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}x"
            verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
            lines.append(f"  {what:<82} {got:>7} >= {t['at_least']:<5} {verdict}")
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = [REFERENCE, *CONTENDERS]
    add = parser.add_argument
    add("--json", action="store_true", help="print the results as JSON (stdout) instead of a table")
    add("--quick", action="store_true", help="fewer, shorter repetitions (about 30 s)")
    add("--ops", type=int, help="most operations per repetition (default 100000; quick 20000)")
    add("--repeat", type=int, help="repetitions per contender; medians are quoted (default 5)")
    add(
        "--only",
        nargs="+",
        choices=list(GROUPS),
        metavar="GROUP",
        help=f"only these groups: {', '.join(GROUPS)}",
    )
    add("--contenders", nargs="+", choices=names, metavar="NAME", help=f"only these: {', '.join(names)}")
    add("--no-memory", action="store_true", help="skip the bytes-per-lease measurement")


def options(args: argparse.Namespace) -> Options:
    quick = bool(getattr(args, "quick", False))
    opts = Options(ops=20_000, repeat=3, seconds=0.08) if quick else Options()
    if getattr(args, "ops", None):
        opts.ops = max(WINDOW, args.ops)
    if getattr(args, "repeat", None):
        opts.repeat = max(1, args.repeat)
    if getattr(args, "only", None):
        opts.groups = tuple(g for g in GROUPS if g in args.only)
    if getattr(args, "contenders", None):
        opts.contenders = tuple(args.contenders)
    opts.memory = not getattr(args, "no_memory", False)
    return opts


def bench(url: str, opts: Options) -> dict[str, Any]:
    """Runs the groups against the server at ``url``; everything the table shows."""
    with Arena(url) as arena:
        env = environment(arena)
        results: list[Result] = []
        t0 = time.monotonic()
        for i, gid in enumerate(opts.groups, 1):
            _progress(f"[{i}/{len(opts.groups)}] {GROUPS[gid].title} ...")
            results += measure_group(arena, GROUPS[gid], opts)
        data: dict[str, Any] = {
            "environment": env,
            "options": {"ops": opts.ops, "repeat": opts.repeat, "seconds": opts.seconds, "window": WINDOW},
        }
        data.update(report(results, opts))
        if opts.memory:
            _progress("bytes per held lease ...")
            data["lease_bytes"] = lease_bytes(arena, [c for c in LOCKERS if c in opts.contenders])
        data["elapsed_s"] = round(time.monotonic() - t0, 1)
    return data


def run(args: argparse.Namespace) -> int:
    from .cli import redis_url

    opts = options(args)
    try:
        with redis_url(getattr(args, "url", None), throwaway=True) as url:
            data = bench(url, opts)
    except (errors.JoblockError, FileNotFoundError, RuntimeError) as e:
        print(f"joblock bench: {e}", file=sys.stderr)
        return 1
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        print(table(data))
    return 0
