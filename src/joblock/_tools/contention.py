"""``joblock bench --only contention``: processes taking turns at one key.

The other groups time one caller's operations per second; here what is measured is
how a lock hands one key from holder to holder. ``Setup.processes`` worker processes
(spawned once per run, so that they share nothing with the bench's own clients) run
one contender at a time: each loops for ``Setup.seconds``, all from one start time,
taking the key with a long wait, holding it ``hold`` seconds, releasing it, then
working ``outside`` seconds. Every section is stamped with ``time.monotonic()``, which
is one clock for all processes on Linux, so the parent merges them to see:

- critical sections per second, against the cap of one section per ``hold``;
- the wait of each acquire (called to granted), its median and 99th percentile;
- the commands Redis ran per section (``INFO commandstats`` around the run, which
  counts the commands a script calls as well as the EVALSHA that ran it);
- the turns of the luckiest and the unluckiest process (fairness);
- the hand-off: for a grant to a process that was already waiting when the holder
  released, the time from that release's return to the grant;
- overlaps of two holders' sections, which must never happen.

A second measurement, the idle waiters, counts the commands that reach Redis while
``Setup.idle_tasks`` asyncio tasks on one ``AsyncLocks`` wait for keys held elsewhere:
what waiting costs the server when nothing moves.

``bench`` creates the rows (``Row``) and reports them with the other groups'; this
module fills them and renders its own table section and targets.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import logging
import math
import multiprocessing
import os
import signal
import socket
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from .._core import core as _active_core
from ..aio import AsyncLocks
from ..locks import Locks
from ..settings import parse_url
from .arena import Arena, Group, Unavailable, compiled_core, peer

__all__ = [
    "CAP", "GROUP", "GROUP_LABELS", "IDLE", "OWN", "QUICK", "RACERS", "Row", "Setup", "add_arguments",
    "idle_waiters", "measure", "options", "summary", "table", "targets",
]  # fmt: skip

CAP = "cap"  # the reference: one section per hold time
IDLE = "idle-waiters"  # the second measurement: joblock's AsyncLocks
# The processes' contenders. The peers keep the ids they have in the other groups; these
# are this group's own (``--contenders`` takes them too).
OWN = ("joblock-c-fair", "redis-py-lock-fast", "bare-token")
RACERS = (
    "joblock-c", "joblock-c-fair", "python-redis-lock", "redis-py-lock", "redis-py-lock-fast", "pottery",
    "bare-token",
)  # fmt: skip
GROUP = Group(
    "contention", "contention: processes taking turns at one key", "critical sections", 1, CAP,
    (CAP, *RACERS, IDLE),
)  # fmt: skip
GROUP_LABELS = {
    (GROUP.id, contender): text
    for contender, text in {
        CAP: "cap: one section per hold",
        "joblock-c": "joblock",
        "joblock-c-fair": "joblock fair=True",
        "python-redis-lock": "python-redis-lock",
        "redis-py-lock": "redis-py Lock (sleep=0.1)",
        "redis-py-lock-fast": "redis-py Lock (sleep=0.001)",
        "pottery": "pottery Redlock",
        "bare-token": "bare socket: BLPOP, RPUSH",
        IDLE: "joblock AsyncLocks (compiled)",
    }.items()
}

TTL = 10  # seconds: far longer than any section, so that no lock expires under its holder
WAIT = 30.0  # an acquire's wait: long enough that no process gives up
START = 0.1  # seconds from "go" to the start: every process has its start time by then
# The idle window closes this long before the first waiter gives up: what a task does when
# its wait runs out is not waiting. It opens once Redis has run nothing for QUIET seconds
# after the first attempts, or SETTLE seconds into the wait (an acquire that polls).
IDLE_MARGIN = 0.05
QUIET = 0.05
SETTLE = 0.5
# The wait for a worker's answer on top of the trial's own length: processes are spawned
# (a fresh interpreter imports joblock and the peer) on the first trial.
SLACK = 60.0


@dataclass
class Setup:
    processes: int = 8
    seconds: float = 5.0  # each contender's run
    hold: float = 0.005  # in the critical section
    outside: float = 0.010  # between a release and the next acquire
    idle_tasks: int = 1000
    idle_seconds: float = 5.0  # the waiters' wait, and about the window counted


# A smoke check: a few seconds for the whole group.
QUICK = Setup(processes=4, seconds=0.5, idle_tasks=100, idle_seconds=1.0)


class Row(Protocol):
    """One row of the group, as ``bench`` keeps it (its ``Result``)."""

    contender: str
    label: str
    status: str
    n: int
    samples: list[float]
    extra: dict[str, Any]


# -- the command's options ------------------------------------------------------------------


def _positive(kind: Callable[[str], Any], zero: bool = False) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        value = kind(text)
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be {'at least 0' if zero else 'above 0'}: {text}")
        return value

    check.__name__ = kind.__name__  # argparse names the type in its message
    return check


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d, q = Setup(), QUICK
    group = parser.add_argument_group("contention (--only contention)")
    # Not --contenders: that option already picks contenders by name.
    for flag, metavar, kind, text in (
        ("--processes", "K", _positive(int),
         f"processes contending for the one key (default {d.processes}; quick {q.processes})"),
        ("--duration", "SECONDS", _positive(float),
         f"how long each contender's processes loop (default {d.seconds:g}; quick {q.seconds:g})"),
        ("--hold", "SECONDS", _positive(float),
         f"time in the critical section (default {d.hold:g}); the cap is 1/hold sections/s"),
        ("--outside", "SECONDS", _positive(float, zero=True),
         f"time between a release and the next acquire (default {d.outside:g})"),
    ):  # fmt: skip
        group.add_argument(flag, type=kind, metavar=metavar, help=text)


def options(args: argparse.Namespace, base: Setup) -> Setup:
    given = {
        field: getattr(args, name)
        for field, name in (("processes", "processes"), ("seconds", "duration"), ("hold", "hold"),
                            ("outside", "outside"))
        if getattr(args, name, None) is not None
    }  # fmt: skip
    return dataclasses.replace(base, **given)


# -- a worker process ---------------------------------------------------------------------------

Release = Callable[[], object]
# One section: (acquire called, granted, release called, release returned), time.monotonic().
Section = tuple[float, float, float, float]


def _granted(got: Any) -> Any:
    if not got:
        raise TimeoutError(f"no grant within the wait ({WAIT:g} s)")
    return got


def _redis(url: str) -> Any:
    return peer("redis", "redis").Redis.from_url(url)


def _client(contender: str, url: str) -> tuple[Callable[[str], Release], Callable[[], None]]:
    """``contender``'s client in this process: ``acquire(key)``, which waits for the lock
    and returns its release, and ``close``. Each is called as a user of it would."""
    if contender.startswith("joblock"):
        compiled_core()  # the rows are the compiled core's (Locks takes it where it is built)
        locks = Locks(url)
        # fair=True as a keyword left unchecked: the Locks of a version without it raises
        # TypeError, which the row reports.
        extra: dict[str, Any] = {"fair": True} if contender == "joblock-c-fair" else {}

        def joblock(key: str) -> Release:
            lease = _granted(locks.acquire(key, TTL, wait=WAIT, **extra))

            def release() -> None:
                if not lease.release():
                    raise RuntimeError("the lock was gone at release")

            return release

        return joblock, locks.close

    if contender == "bare-token":
        return _bare_token(url)
    # A peer's own package is looked for before redis-py, so that a missing one is named
    # (pip brings redis-py along with it).
    acquire: Callable[[str], Release]
    if contender == "python-redis-lock":
        redis_lock = peer("redis_lock", "python-redis-lock")
        redis = _redis(url)

        def python_redis_lock(key: str) -> Release:
            lock = redis_lock.Lock(redis, key, expire=TTL)
            # It refuses a wait longer than the expiry (TimeoutTooLarge): TTL, not WAIT.
            _granted(lock.acquire(blocking=True, timeout=TTL))
            return lock.release  # type: ignore[no-any-return]

        acquire = python_redis_lock
    elif contender == "pottery":
        redlock = peer("pottery", "pottery").Redlock
        redis = _redis(url)
        masters = {redis}

        def pottery(key: str) -> Release:
            lock = redlock(key=key, masters=masters, auto_release_time=TTL)
            _granted(lock.acquire(blocking=True, timeout=WAIT))
            return lock.release  # type: ignore[no-any-return]

        acquire = pottery
    else:  # redis-py's Lock, which polls every `sleep` seconds while it waits
        sleep = 0.001 if contender == "redis-py-lock-fast" else 0.1
        redis = _redis(url)

        def redis_py(key: str) -> Release:
            lock = redis.lock(key, timeout=TTL, sleep=sleep)
            _granted(lock.acquire(blocking=True, blocking_timeout=WAIT))
            return lock.release  # type: ignore[no-any-return]

        acquire = redis_py
    return acquire, redis.close


def _bare_token(url: str) -> tuple[Callable[[str], Release], Callable[[], None]]:
    """What a hand-off through Redis costs with no lock client at all, the floor of this
    machine and server: a bare socket per process, and a token in a list beside the key.
    ``BLPOP`` takes it (Redis hands a pushed element to the client blocked longest), the
    release's ``RPUSH`` puts it back; the first process at a key puts the token there. No
    expiry, no queue of its own, two commands per section."""
    settings = parse_url(url)
    if settings.tls or settings.password is not None or settings.path is not None:
        raise Unavailable("only for a plain TCP server without a password")
    sock = socket.create_connection((settings.host, settings.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call(command: bytes, reply: bytes) -> bytes:
        """Sends ``command`` and reads its reply, which is ``reply`` when it goes as expected."""
        sock.sendall(command)
        data = sock.recv(65536)
        while len(data) < len(reply) and data not in (b"*-1\r\n", b"$-1\r\n") and not data.startswith(b"-"):
            data += sock.recv(65536)
        return data

    encode = _active_core.encode_command
    if settings.db:
        call(encode((b"SELECT", settings.db)), b"+OK\r\n")
    # Per key: its BLPOP, that BLPOP's reply once it takes the token, and the release (made
    # once, so that nothing is built between a grant and the section's timestamps).
    made: dict[str, tuple[bytes, bytes, Release]] = {}

    def acquire(key: str) -> Release:
        ready = made.get(key)
        if ready is None:
            token = f"{key}:token".encode()
            push = encode((b"RPUSH", token, b"1"))
            if call(encode((b"SET", f"{key}:made", b"1", b"NX")), b"+OK\r\n") == b"+OK\r\n":
                call(push, b":1\r\n")
            taken = b"*2\r\n$%d\r\n%s\r\n$1\r\n1\r\n" % (len(token), token)
            ready = made[key] = (encode((b"BLPOP", token, int(WAIT))), taken, lambda: call(push, b":1\r\n"))
        blpop, taken, release = ready
        _granted(call(blpop, taken) == taken)
        return release

    return acquire, sock.close


def _sections(acquire: Callable[[str], Release], key: str, start: float, setup: Setup) -> list[Section]:
    now = time.monotonic
    time.sleep(max(0.0, start - now()))
    end = start + setup.seconds
    out: list[Section] = []
    while (asked := now()) < end:
        release = acquire(key)
        granted = now()
        time.sleep(setup.hold)
        releasing = now()
        release()
        out.append((asked, granted, releasing, now()))
        time.sleep(setup.outside)
    return out


def _failure(e: BaseException) -> tuple[str, str]:
    """("unavailable", reason) for a contender that cannot run here, else ("error", what)."""
    if isinstance(e, Unavailable):
        return "unavailable", str(e)
    # A keyword this version of the library does not take (joblock's fair=True before it had it).
    if isinstance(e, TypeError) and "unexpected keyword argument" in str(e):
        return "unavailable", f"no such argument in this version (TypeError: {e})"
    return "error", f"{type(e).__name__}: {e}"


def _trial(conn: Connection, contender: str, url: str, key: str, setup: Setup) -> tuple[str, Any]:
    """One contender's run in this process: ready once its client is warm, then the sections."""
    try:
        acquire, close = _client(contender, url)
    except Exception as e:
        return _failure(e)
    try:
        # Connects, loads scripts, imports what the first call imports: none of it counted.
        acquire(f"{key}:warm:{os.getpid()}")()
        conn.send(("ready", None))
        start = conn.recv()
        if start is None:  # another process could not start
            return "cancelled", None
        return "done", _sections(acquire, key, start, setup)
    except Exception as e:
        return _failure(e)
    finally:
        close()  # before answering: the parent counts commands once every process answered


def _serve(conn: Connection) -> None:
    """A worker process: one trial per message, until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends us
    for name in ("redis_lock", "pottery"):  # their notes on waits, on every section
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        while True:
            conn.send(_trial(conn, *conn.recv()))
    except (EOFError, OSError):  # the parent closed the pipe: done, or interrupted
        return


# -- the parent: the processes, and what their sections say -------------------------------------


class _Failed(Exception):
    """A contender's error in a worker process, as ``Type: message``."""


class _Crowd:
    """The worker processes, started once ("spawn": nothing inherited from the bench's own
    clients and event loop) and given one contender's trial after another."""

    def __init__(self, size: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.processes: list[Any] = []
        for _ in range(size):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs,), name="joblock-bench", daemon=True)
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)

    def _answers(self, conns: Sequence[Connection], timeout: float) -> list[tuple[str, Any]]:
        deadline = time.monotonic() + timeout
        out = []
        for conn in conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"a contender process did not answer within {timeout:g} s")
            out.append(conn.recv())
        return out

    def trial(
        self, arena: Arena, contender: str, setup: Setup
    ) -> tuple[list[list[Section]], dict[str, int], float]:
        """Every process's sections, the commands Redis ran meanwhile, and the start time."""
        key = arena.keys(1)[0]
        for conn in self.conns:
            conn.send((contender, arena.url, key, setup))
        ready = self._answers(self.conns, SLACK)
        failed = [answer for answer in ready if answer[0] != "ready"]
        if failed:
            waiting = [conn for conn, (state, _) in zip(self.conns, ready) if state == "ready"]
            for conn in waiting:
                conn.send(None)
            self._answers(waiting, SLACK)
            _raise(failed[0])
        commands = _Commands(arena)
        before = commands.read()
        start = time.monotonic() + START
        for conn in self.conns:
            conn.send(start)
        done = self._answers(self.conns, START + setup.seconds + WAIT + SLACK)
        ran = commands.since(before)
        for answer in done:
            if answer[0] != "done":
                _raise(answer)
        return [sections for _, sections in done], ran, start

    def close(self) -> None:
        for conn in self.conns:
            conn.close()  # a worker reading its next job sees the end of the pipe and returns
        deadline = time.monotonic() + 2
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():  # still in a trial (an interrupted run)
                process.terminate()
                process.join()


def _raise(answer: tuple[str, Any]) -> None:
    state, what = answer
    raise Unavailable(what) if state == "unavailable" else _Failed(what)


class _Commands:
    """The commands the server has run, by name (INFO commandstats), less this counter's own INFOs.

    Redis counts the commands a script calls as well as the EVALSHA that ran it: the
    totals are the server's work, not only what clients sent.
    """

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.own = 0

    def read(self) -> dict[str, int]:
        stats = self.arena.info("commandstats")
        calls = {
            name.removeprefix("cmdstat_"): int(dict(part.split("=", 1) for part in value.split(","))["calls"])
            for name, value in stats.items()
            if name.startswith("cmdstat_")
        }
        # An INFO is counted once it has run: every earlier read is in these, not this one.
        calls["info"] = calls.get("info", 0) - self.own
        self.own += 1
        return calls

    def since(self, before: dict[str, int]) -> dict[str, int]:
        """The commands run since ``before`` (a reading), those of none left out."""
        now = self.read()
        return {name: n - before.get(name, 0) for name, n in now.items() if n != before.get(name, 0)}


def _rank(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values``, by nearest rank."""
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def summary(
    processes: list[list[Section]], commands: dict[str, int], start: float, seconds: float
) -> dict[str, Any]:
    """What one trial's sections (and the commands Redis ran meanwhile) say, times in ms.
    Sections granted after the run's end (to processes that were waiting then) are run
    through, but not counted as the run's."""
    end = start + seconds
    counted = [[s for s in sections if s[1] < end] for sections in processes]
    turns = [len(sections) for sections in counted]
    waits = sorted(s[1] - s[0] for sections in counted for s in sections)
    every = sorted((s for sections in processes for s in sections), key=lambda s: s[1])
    # Hand-offs: grants to a process that was already waiting when the holder before it
    # began its release; from that release's return to the grant.
    handoffs = [b[1] - a[3] for a, b in itertools.pairwise(every) if b[0] < a[2]]
    overlaps, held_until = 0, -math.inf
    for s in every:  # a grant inside an earlier holder's section (granted to released)
        overlaps += s[1] < held_until
        held_until = max(held_until, s[2])
    ms = 1000.0
    return {
        "sections_per_s": sum(turns) / seconds,
        "sections": sum(turns),
        "wait_p50_ms": statistics.median(waits) * ms if waits else None,
        "wait_p99_ms": _rank(waits, 0.99) * ms if waits else None,
        "commands_per_section": sum(commands.values()) / len(every) if every else None,
        "turns_fewest": min(turns),
        "turns_most": max(turns),
        "turns_ratio": min(turns) / max(turns) if max(turns) else None,
        "handoff_p50_ms": statistics.median(handoffs) * ms if handoffs else None,
        "overlaps": overlaps,
        "by_name": dict(sorted(commands.items(), key=lambda item: -item[1])),  # the JSON's detail
    }


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (the details stay in the rounds); overlaps are
    added up (any one is a failure)."""
    out: dict[str, Any] = {}
    for name, first in rounds[0].items():
        if isinstance(first, dict):
            continue
        values = [r[name] for r in rounds if r[name] is not None]
        out[name] = sum(values) if name == "overlaps" else statistics.median(values) if values else None
    return out


# -- the idle waiters -------------------------------------------------------------------------------


def idle_waiters(arena: Arena, setup: Setup) -> dict[str, Any]:
    """Commands that reach Redis while ``setup.idle_tasks`` tasks wait, each for a key of its
    own that another client holds (for the arena's ttl, longer than their wait)."""
    compiled_core()
    holder: Locks = arena.locks("joblock-c")
    waiters: AsyncLocks = arena.locks("joblock-c", AsyncLocks)
    keys = arena.keys(setup.idle_tasks)
    held = holder.acquire_many(keys, arena.ttl)
    try:
        if None in held:
            raise RuntimeError("the keys to wait for could not all be taken")
        ran, window = arena.run(_waiting(arena, waiters, keys, setup.idle_seconds))
    finally:
        holder.release_many(held)
        arena.purge()
    return {"commands": sum(ran.values()), "window_s": window, "tasks": len(keys), "by_name": ran}


async def _waiting(
    arena: Arena, locks: AsyncLocks, keys: Sequence[str], wait: float
) -> tuple[dict[str, int], float]:
    commands = _Commands(arena)
    base = sum(commands.read().values())
    started = time.monotonic()
    tasks = [asyncio.ensure_future(locks.acquire(key, arena.ttl, wait=wait)) for key in keys]
    try:
        # The window opens once the first attempts are over: at least a command per task,
        # then none for QUIET seconds. An acquire that polls never falls quiet; the window
        # then opens SETTLE into the wait.
        settle = started + min(SETTLE, wait / 4)
        last, quiet_since = base, started
        while True:
            await asyncio.sleep(0.005)
            now, seen = time.monotonic(), sum(commands.read().values())
            if seen != last:
                last, quiet_since = seen, now
            if seen - base >= len(keys) and (now - quiet_since >= QUIET or now >= settle):
                break
            if now - started > wait / 2:
                raise RuntimeError(f"{len(keys)} tasks did not send {len(keys)} commands in {wait / 2:g} s")
        before, opened = commands.read(), time.monotonic()
        await asyncio.sleep(started + wait - IDLE_MARGIN - opened)
        ran, closed = commands.since(before), time.monotonic()
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    # Every wait runs out: the keys stay held for longer.
    odd = next((got for got in await asyncio.gather(*tasks, return_exceptions=True) if got is not None), None)
    if odd is not None:
        raise RuntimeError(f"a waiter ended with {odd!r}, not with its wait run out")
    return ran, closed - opened


# -- the group ----------------------------------------------------------------------------------------


def measure(
    arena: Arena,
    rows: Sequence[Row],
    setup: Setup,
    repeat: int,
    chosen: Collection[str],
    progress: Callable[[str], None],
) -> None:
    """Fills ``rows`` (one per contender of ``GROUP``): ``repeat`` interleaved rounds of every
    contender chosen, medians quoted. The idle waiters run when joblock-c is chosen."""
    by_id = {row.contender: row for row in rows}
    cap = by_id[CAP]
    cap.samples, cap.n = [1 / setup.hold], round(setup.seconds / setup.hold)
    for row in rows:
        if row.contender != CAP and ("joblock-c" if row.contender == IDLE else row.contender) not in chosen:
            row.status = "skipped"
    rounds: dict[str, list[dict[str, Any]]] = {row.contender: [] for row in rows}
    crowd: _Crowd | None = None
    try:
        for round_ in range(1, repeat + 1):
            line = []
            for row in rows:
                if row.contender == CAP or row.status != "ok":
                    continue
                try:
                    if row.contender == IDLE:
                        got = idle_waiters(arena, setup)
                        line.append(f"{row.label} {got['commands']:,} commands")
                    else:
                        crowd = crowd or _Crowd(setup.processes)
                        try:
                            got = summary(*crowd.trial(arena, row.contender, setup), setup.seconds)
                        finally:
                            arena.purge()
                        row.samples.append(got["sections_per_s"])
                        line.append(f"{row.label} {got['sections_per_s']:,.0f}/s")
                except Unavailable as e:
                    row.status = str(e)
                    continue
                except Exception as e:
                    row.status = f"error: {e if isinstance(e, _Failed) else f'{type(e).__name__}: {e}'}"
                    if isinstance(e, (TimeoutError, EOFError, OSError)) and crowd is not None:
                        crowd.close()  # a process that did not answer: start afresh
                        crowd = None
                    continue
                rounds[row.contender].append(got)
            progress(f"  {GROUP.title}, round {round_}/{repeat}: " + ", ".join(line))
    finally:
        if crowd is not None:
            crowd.close()
    for row in rows:
        if not rounds[row.contender]:
            continue
        row.extra = {**_medians(rounds[row.contender]), "rounds": rounds[row.contender]}
        row.n = round(row.extra["tasks" if row.contender == IDLE else "sections"])
        # Two holders at once is a broken lock: a failure of the run for joblock's rows,
        # a finding (in the overlaps column) for the peers.
        if row.contender.startswith("joblock") and row.extra.get("overlaps"):
            row.status = f"error: {row.extra['overlaps']} overlaps of two holders' sections"


# -- reporting ----------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# The processes' columns: (heading, width). A row's cells are strings, "-" where nothing applies.
COLUMNS = (
    ("sections/s", 10), ("ratio", 7), ("sections", 8), ("wait p50", 9), ("wait p99", 9), ("cmds/sect", 9),
    ("turns min-max", 14), ("ratio", 6), ("hand-off", 9), ("overlaps", 8),
)  # fmt: skip
IDLE_COLUMNS = (("commands", 10), ("ratio", 7), ("tasks", 8), ("window", 9))


def _status(row: dict[str, Any]) -> str:
    """A failure after some rounds gave figures: said after them."""
    return "" if row["status"] == "ok" else f"   {row['status']}"


def _line(mark: str, label: str, cells: Sequence[str], columns: Sequence[tuple[str, int]]) -> str:
    return f" {mark}{label:<30} " + " ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns))


def _cells(contender: str, row: dict[str, Any]) -> list[str]:
    cells = [
        f"{row['ops_per_s']:,.0f}",
        "-" if row["ratio"] is None else f"{row['ratio']:.2f}x",
        str(row["n"]),
    ]
    if contender == CAP:
        return cells
    commands = row["commands_per_section"]
    return [
        *cells, _ms(row["wait_p50_ms"]), _ms(row["wait_p99_ms"]),
        "-" if commands is None else f"{commands:.1f}", f"{row['turns_fewest']:.0f}-{row['turns_most']:.0f}",
        _ms(row["turns_ratio"]), _ms(row["handoff_p50_ms"]), str(row["overlaps"]),
    ]  # fmt: skip


def table(group: dict[str, Any], setup: dict[str, Any]) -> list[str]:
    """The group's section of ``bench``'s table: the processes' rows, then the idle waiters'."""
    s = setup
    lines = [
        "",
        f"{group['title']}: {s['processes']} processes, {s['hold'] * 1000:g} ms in the section, "
        f"{s['outside'] * 1000:g} ms outside, {s['seconds']:g} s each [sections/s = critical sections per "
        "second; wait = acquire called to granted, hand-off = a release's return to the next grant, in ms]",
        _line(" ", "contender", [name for name, _ in COLUMNS], COLUMNS),
    ]
    results = group["results"]
    for contender, row in results.items():
        mark = "*" if contender == group["reference"] else " "
        if contender == IDLE:
            continue
        if row["ops_per_s"] is None:
            lines.append(f" {mark}{row['label']:<30} {row['status']}")
            continue
        lines.append(_line(mark, row["label"], _cells(contender, row), COLUMNS) + _status(row))
    idle = results.get(IDLE)
    if idle is not None:
        lines += [
            "",
            f"idle waiters: {s['idle_tasks']} asyncio tasks on one AsyncLocks, each waiting "
            f"{s['idle_seconds']:g} s for a key of its own that another client holds [commands Redis ran "
            "while they waited]",
            _line(" ", "contender", [name for name, _ in IDLE_COLUMNS], IDLE_COLUMNS),
        ]
        if idle.get("commands") is None:
            lines.append(f"  {idle['label']:<30} {idle['status']}")
        else:
            cells = [f"{idle['commands']:,.0f}", "-", str(idle["n"]), f"{idle['window_s']:.2f} s"]
            lines.append(_line(" ", idle["label"], cells, IDLE_COLUMNS) + _status(idle))
    return lines


# (what, contender, figure, versus: a contender whose figure divides, or None; at least / at most, bound)
TARGETS = (
    ("joblock sections/s / the cap", "joblock-c", "ops_per_s", CAP, ">=", 0.92),
    ("joblock sections/s / python-redis-lock's", "joblock-c", "ops_per_s", "python-redis-lock", ">=", 1.0),
    ("joblock commands per section / python-redis-lock's", "joblock-c", "commands_per_section",
     "python-redis-lock", "<=", 1.0),
    ("joblock wait p99 / python-redis-lock's", "joblock-c", "wait_p99_ms", "python-redis-lock", "<=", 1.0),
    ("joblock fair=True turns of a process, fewest / most", "joblock-c-fair", "turns_ratio", None, ">=", 0.8),
    ("joblock median hand-off, ms", "joblock-c", "handoff_p50_ms", None, "<=", 1.0),
    ("idle waiters: commands while they wait", IDLE, "commands", None, "<", 200),
)  # fmt: skip


def targets(group: dict[str, Any]) -> list[dict[str, Any]]:
    """The group's targets, in ``bench``'s form plus what the table shows of each."""
    results = group["results"]

    def figure(contender: str | None, name: str) -> float | None:
        row = results.get(contender)
        return None if row is None or row["status"] != "ok" else row.get(name)

    out = []
    for what, contender, name, versus, sign, bound in TARGETS:
        value = figure(contender, name)
        if versus is not None:
            under = figure(versus, name)
            value = None if value is None or not under else value / under
        if value is None:
            met = None
        else:
            met = {">=": value >= bound, "<=": value <= bound, "<": value < bound}[sign]
        if versus is not None:
            shown = "n/a" if value is None else f"{value:.2f}x"
        elif name == "commands":
            shown = "n/a" if value is None else f"{value:,.0f}"
        else:
            shown = "n/a" if value is None else f"{value:.2f}"
        out.append({
            "group": GROUP.id, "contender": contender, "versus": versus, "figure": name,
            "ratio": value if versus is not None else None, "value": value,
            "at_least": bound if sign == ">=" else None, "bound": f"{sign} {bound:g}", "met": met,
            "what": f"{GROUP.id}: {what}", "shown": shown,
        })  # fmt: skip
    return out
