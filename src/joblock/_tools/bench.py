"""``joblock bench``: joblock side by side with redis-benchmark and the Python peers.

Groups of one operation each (``GROUPS``; ``GROUP_SETS`` names several at once, such
as ``--only asyncio``). In a group every contender does the same work on fresh keys
(``joblock:bench:`` + 12 digits, unique to the run) with lock values as long as
joblock's, over one connection to one server; ``purge()`` removes what each repetition
left. joblock gets a whole batch per call and sends it in windows of 1000 itself; the
peers get it in calls of 1000 (one redis-py pipeline each, or a loop over their
single-lock API), and so does "joblock (compiled), calls of 1000".

A repetition times one contender doing ``n`` operations, ``n`` sized to take about
``Options.seconds``. The repetitions of a group are interleaved (round 1 of every
contender, then round 2, ...) so that a noisy machine slows them alike; the table
quotes medians and their ratio to the group's reference. That is ``redis-benchmark
-c 1 -P 1000`` for batch acquire (SET NX PX), release (the server's cheapest
compare-and-delete: DELIFEQ or DELEX IFEQ where it has them, else EVALSHA of a plain
compare-and-delete script; on keys filled beforehand so that most picks delete) and
extend (likewise: SET IFEQ PX where the server has it, else EVALSHA of a plain
compare-and-pexpire script; every pick finds its key), redis-py (or its asyncio client)
for the other lock groups, and the pure twin for key building.

``--quick`` is a smoke check: one short repetition per contender, after a warm-up of
a tenth of a call, so that every contender runs and reports a number (or why it
cannot run) in seconds; its numbers are rough.

This module measures and reports; the contenders live in ``cases`` and ``crowds``
only, and ``benchmarks/`` (pytest-benchmark) runs the same cases. The contention group
(processes taking turns at one key) is of another shape: ``contention`` measures it and
renders its section of the table, in rows and targets kept here as the others' are.
The peers (redis-py, python-redis-lock, pottery) are optional: a missing one is
reported as "not installed" with the package that brings it, and redis-benchmark as
"not on PATH".
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from .._core import implementation
from . import contention
from .admin import describe_server
from .arena import peer
from .cases import (
    CONTENDERS,
    GROUP_SETS,
    GROUPS,
    LABELS,
    LOCKERS,
    MISSING,
    REFERENCE,
    WINDOW,
    WITHOUT_GET,
    Arena,
    Case,
    Group,
    RedisBenchmark,
    Unavailable,
    label,
    make_case,
    one_call_contenders,
    succeeded,
)

# Re-exported: benchmarks/ takes the cases from here, as the command does.
__all__ = [
    "CONTENDERS", "GROUPS", "Arena", "Case", "Unavailable", "add_arguments", "label", "make_case",
    "one_call_contenders", "run", "succeeded",
]  # fmt: skip

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
    # The engine's: many callers multiplexed on one connection, one caller near a bare
    # socket, a cluster near one server, and no regression of the batch path (the
    # compiled engine's issue raised the first four).
    ("aio_tasks128", "joblock-c", "redis-py-asyncio-lock", 14.0),
    ("threads32", "joblock-c", "redis-py-lock", 4.5),
    ("single", "joblock-c", "bare-socket", 0.95),
    ("aio_single", "joblock-c", "bare-protocol", 0.95),
    ("cluster_acquire", "joblock-c", "joblock-c-one-server", 0.8),
    ("cluster_acquire", "joblock-c", "redis-py-cluster-pipeline", 5.0),
    ("cluster_acquire", "joblock-py", "redis-py-cluster-pipeline", 3.0),
    ("acquire", "joblock-c", REFERENCE, 1.0),
    # Held locks: a dispatcher's duplicates, where SET NX GET's reply carries the holder's value.
    ("acquire_held", "joblock-c", REFERENCE, 0.85),
    # Counting locks (one script each way) near plain ones (SET NX PX, then a script), for
    # one caller, where the round trip dominates; batched, Redis's own work in the scripts does.
    ("single", "joblock-c-limit", "joblock-c", 0.8),
    # Uninstrumented, the metrics layer costs a batch one check: within 3% of the path without it.
    ("metrics", "joblock-c", "joblock-c-unmeasured", 0.97),
    # Locks nobody waits for pay nothing for waits: a release as cheap as the server's plainest
    # compare-and-delete (0.95x on Redis 7's script; 0.9x on a native DELIFEQ, where the
    # native release and extend make pairs 1.8x those of scripts: Valkey's rows), and an
    # extend within 0.9x of its compare-and-pexpire (a native SET IFEQ PX, or the script).
    ("release", "joblock-c", REFERENCE, 0.95),
    ("extend", "joblock-c", REFERENCE, 0.9),
    ("acquire_release", "joblock-c", "joblock-c-scripts", 1.8),
)


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
    expected = GROUPS[case.group].expected(n)
    if done != expected:
        raise RuntimeError(f"{done} of {n} operations succeeded, expected {expected}")
    return n / elapsed


@dataclass
class Options:
    ops: int = 100_000  # most operations in one repetition
    repeat: int = 5
    seconds: float = 0.3  # a repetition of a slow contender is cut to about this
    groups: tuple[str, ...] = tuple(GROUPS)
    contenders: tuple[str, ...] = (REFERENCE, *CONTENDERS)
    memory: bool = True
    warmup: float = 1.0  # a batch group's warm-up, in calls (at least 100 operations)
    leases: int = 10_000  # held leases in the bytes-per-lease measurement
    contention: contention.Setup = field(default_factory=contention.Setup)


# A smoke check: every contender runs briefly.
QUICK = Options(ops=5000, repeat=1, seconds=0.03, warmup=0.1, leases=1000, contention=contention.QUICK)

# The peers run on redis-py; their own package is looked for first, so that a missing
# one is named rather than the redis-py it needs too (pip installs that along).
PEER_MODULES = {"python-redis-lock": ("redis_lock", "python-redis-lock"), "pottery": ("pottery", "pottery")}


def _check_peer(contender: str) -> None:
    if contender in PEER_MODULES:
        peer(*PEER_MODULES[contender])


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
            _check_peer(contender)
            case = make_case(arena, group.id, contender)
            # Warm-up: connects, loads scripts, and sizes the repetitions.
            probe = min(group.batch, max(100, int(group.batch * opts.warmup))) if group.batch > 1 else 20
            result.n = _size(group, time_case(case, arena, probe), opts)
        except Unavailable as e:
            result.status = str(e)
            continue
        except Exception as e:
            result.status = f"error: {type(e).__name__}: {e}"
            continue
        cases.append((result, case))
    if group.alike:
        sized = next((r.n for r, _ in cases if r.contender == group.reference), None)
        for result, _ in cases:
            result.n = sized or result.n

    # The batch groups' reference; in acquire also SET NX PX without GET, in release
    # the compare-and-delete on keys that are not there.
    rows = {
        "acquire": [("acquire", REFERENCE), ("acquire-without-get", WITHOUT_GET)],
        "acquire_held": [("acquire-held", REFERENCE), ("acquire-held-without-get", WITHOUT_GET)],
        "release": [("release", REFERENCE), ("release-missing", MISSING)],
        "extend": [("extend", REFERENCE)],
    }
    references = [(Result(group.id, c, label(group.id, c)), what) for what, c in rows.get(group.id, [])]
    results[:0] = [r for r, _ in references]
    rb: RedisBenchmark | None = None
    for ref, _ in references:
        # As many operations as joblock's compiled core does, in whole pipelines: given
        # fewer requests than -P, redis-benchmark now and then gives up with "All clients
        # disconnected" (a quick run's small n). Ten pipelines at least: it times in whole
        # milliseconds, and a run under one reports an infinite rate.
        n = next((r.n for r, _ in cases if r.contender == "joblock-c"), opts.ops)
        ref.n = max(10 * WINDOW, n // WINDOW * WINDOW)
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
            except Unavailable as e:  # a command this server does not take
                ref.status = str(e)
                continue
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


def measure_contention(arena: Arena, opts: Options) -> list[Result]:
    """The contention group: ``contention`` measures it, in rows like the other groups'."""
    group = contention.GROUP
    rows = [Result(group.id, c, label(group.id, c)) for c in group.contenders]
    contention.measure(arena, rows, opts.contention, opts.repeat, opts.contenders, _progress)
    return rows


def lease_bytes(arena: Arena, contenders: Sequence[str], n: int) -> dict[str, Any]:
    """Bytes per held lease (tracemalloc): what ``n`` held locks cost the client."""
    out: dict[str, Any] = {}
    for contender in contenders:
        if contender not in GROUPS["acquire"].contenders:
            continue
        try:
            _check_peer(contender)
            case = make_case(arena, "acquire", contender)
        except Unavailable as e:
            out[contender] = str(e)
            continue
        count = n if contender.startswith("joblock") or contender == "redis-py-pipeline" else n // 5
        state = case.prepare(count)
        case.run(case.prepare(min(WINDOW, count)))  # warm: buffers grown, scripts loaded
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
    rb = shutil.which("redis-benchmark")
    rb_out = subprocess.run([rb, "--version"], capture_output=True, text=True, check=False) if rb else None
    info = arena.info()
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": _load(),
        "joblock": __version__,
        "joblock_implementation": implementation,
        "redis_version": info.get("redis_version"),
        "redis_executable": info.get("executable"),
        "redis_server": describe_server(info),
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
    if contention.GROUP.id in groups:
        targets += contention.targets(groups[contention.GROUP.id])
    return {"groups": groups, "targets": targets}


def table(data: dict[str, Any]) -> str:
    env = data["environment"]
    opt = data["options"]
    repeats = (
        f"medians of {opt['repeat']} interleaved repetitions"
        if opt["repeat"] > 1
        else "one short repetition each: rough numbers"
    )
    lines = [
        f"joblock bench: joblock {env['joblock']} (core: {env['joblock_implementation']}), "
        f"Python {env['python']}, {env['cpu_count']} CPUs (load {env['load_average']}), "
        f"{env['redis_server']} at {env['redis_url']}",
        f"keys of {env['key_bytes']} bytes, values of {env['value_bytes']} bytes; "
        f"{repeats}; ratio = ops/s / the reference's (*)",
    ]
    for gid, g in data["groups"].items():
        if gid == contention.GROUP.id:
            lines += contention.table(g, opt["contention"])
            continue
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
            # A target that is not a ratio of ops/s (contention's) says itself what it is.
            what = t.get("what") or (
                f"{GROUPS[t['group']].title}: {LABELS[t['contender']]} / {label(t['group'], t['versus'])}"
            )
            got = t.get("shown") or ("n/a" if t["ratio"] is None else f"{t['ratio']:.2f}x")
            bound = t.get("bound") or f">= {t['at_least']}"
            verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
            lines.append(f"  {what:<82} {got:>7} {bound:<8} {verdict}")
    statuses = [row["status"] for g in data["groups"].values() for row in g["results"].values()]
    if any(status.startswith("not installed") for status in statuses):
        lines += ["", "pip install 'joblock[bench]' installs every peer that is not installed here"]
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = [REFERENCE, *CONTENDERS]
    add = parser.add_argument
    add("--json", action="store_true", help="print the results as JSON (stdout) instead of a table")
    add(
        "--quick",
        action="store_true",
        help="a smoke check: one short repetition per contender, rough numbers (under 30 s; "
        "measured 13-17 s on 2 shared cores against the throwaway server, before the contention "
        "group added about 5 s)",
    )
    add("--ops", type=int, help="most operations per repetition (default 100000; quick 5000)")
    add("--repeat", type=int, help="repetitions per contender; medians are quoted (default 5; quick 1)")
    add(
        "--only",
        nargs="+",
        choices=[*GROUPS, *GROUP_SETS],
        metavar="GROUP",
        help=f"only these groups: {', '.join(GROUPS)}; or {', '.join(GROUP_SETS)} for several",
    )
    add("--contenders", nargs="+", choices=names, metavar="NAME", help=f"only these: {', '.join(names)}")
    add("--no-memory", action="store_true", help="skip the bytes-per-lease measurement")
    contention.add_arguments(parser)


def options(args: argparse.Namespace) -> Options:
    quick = bool(getattr(args, "quick", False))
    opts = dataclasses.replace(QUICK) if quick else Options()
    if getattr(args, "ops", None):
        opts.ops = max(WINDOW, args.ops)
    if getattr(args, "repeat", None):
        opts.repeat = max(1, args.repeat)
    if getattr(args, "only", None):
        chosen = {g for name in args.only for g in GROUP_SETS.get(name, (name,))}
        opts.groups = tuple(g for g in GROUPS if g in chosen)
    if getattr(args, "contenders", None):
        opts.contenders = tuple(args.contenders)
    opts.memory = not getattr(args, "no_memory", False)
    opts.contention = contention.options(args, opts.contention)
    return opts


def bench(url: str, opts: Options) -> dict[str, Any]:
    """Runs the groups against the server at ``url``; everything the table shows."""
    with Arena(url) as arena:
        env = environment(arena)
        results: list[Result] = []
        t0 = time.monotonic()
        for i, gid in enumerate(opts.groups, 1):
            _progress(f"[{i}/{len(opts.groups)}] {GROUPS[gid].title} ...")
            if gid == contention.GROUP.id:
                results += measure_contention(arena, opts)
            else:
                results += measure_group(arena, GROUPS[gid], opts)
        data: dict[str, Any] = {
            "environment": env,
            "options": {
                "ops": opts.ops, "repeat": opts.repeat, "seconds": opts.seconds, "window": WINDOW,
                "contention": dataclasses.asdict(opts.contention),
            },
        }  # fmt: skip
        data.update(report(results, opts))
        if opts.memory:
            _progress("bytes per held lease ...")
            lockers = [c for c in LOCKERS if c in opts.contenders]
            data["lease_bytes"] = lease_bytes(arena, lockers, opts.leases)
        data["elapsed_s"] = round(time.monotonic() - t0, 1)
    return data


def failures(data: dict[str, Any]) -> list[str]:
    """The contenders that failed with an error (not those that cannot run here)."""
    return [
        f"{g['title']}: {row['label']}"
        for g in data["groups"].values()
        for row in g["results"].values()
        if row["status"].startswith("error")
    ]


def run(url: str, args: argparse.Namespace) -> int:
    """Measures against the server at ``url`` and prints the table (or JSON); 1 when a contender failed."""
    data = bench(url, options(args))
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        print(table(data))
    failed = failures(data)
    if failed:
        print(f"joblock bench: failed with an error (see the table): {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0
