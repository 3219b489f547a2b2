#!/usr/bin/env python3
"""User-space instructions per single acquire + release pair, counted by callgrind: joblock's
``Locks`` (one thread) and ``AsyncLocks`` (one task) on both builds of the core, and the bare
socket and bare asyncio protocol of ``joblock bench`` (``crowds``), which send the same two
commands. A count, not a time: the same on a busy machine as on a quiet one.

    bash scripts/instructions.sh                  # the table of docs/performance.md
    python scripts/instructions.py --pairs 1000 3000 --warmup 200 --only bare-socket
    JOBLOCK_SERVER=valkey bash scripts/instructions.sh --only sync --only bare-socket

The server is the one the test suite and ``joblock bench`` start (``servers``): redis-server,
or with ``JOBLOCK_SERVER=valkey`` valkey-server, where joblock and the bare references release
by the native ``DELIFEQ`` (``SET NX PX GET`` acquires on both).

Every subject runs in an interpreter of its own under ``valgrind --tool=callgrind``, twice:
``--warmup`` pairs, then N1 pairs; and the same warm-up, then N2 pairs. Per pair is
(Ir(N2) - Ir(N1)) / (N2 - N1): start-up, imports, connecting, the warm-up and exit are the
same in both runs and cancel out. Both runs make as many keys (those they do not use too),
so only the pairs differ. What is counted is the client's own work in user space: the
kernel's is not callgrind's to see, and each run's redis-server runs outside valgrind.

The count must come out the same from one invocation to the next, on a busy machine as on a
quiet one. So every run gets a fresh server holding the release script (as a bench's server
does once its first contender has run), a fixed environment with seeded string hashing, and
one snapshot of joblock and of this script, compiled beforehand, at a fixed path (edits to
the tree while the runs go on change neither run); joblock's two timed checks, which
back-to-back pairs never reach at native speed, are kept out of their reach, and the lock
values' "@host:pid" has one length in every run (see ``child``). What still differs between
runs (ports, tokens, process ids) is worth at most some ten thousand instructions per run:
about one instruction per pair. The pairs run as ``joblock bench`` runs its ``single`` and
``aio_single`` groups (``cases.make_case``), so the loop around them (a list of results) is
counted too, alike for every subject.

Exact for one tree, interpreter and C library, not beyond: the interpreter's method cache and
the allocators do more or less work after where objects landed in memory, so a change
anywhere (even in code the pairs never run) can move the counts by a few percent.
"""

from __future__ import annotations

import argparse
import compileall
import fcntl
import importlib.metadata
import importlib.util
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if importlib.util.find_spec("joblock") is None:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import joblock
from joblock import _client
from joblock._engine import sync
from joblock._scripts import RELEASE
from joblock._tools import cases
from joblock._tools.admin import Node, describe_server
from joblock._tools.arena import Arena
from joblock._tools.servers import RedisServer
from joblock.settings import parse_url


@dataclass(frozen=True)
class Subject:
    id: str
    label: str
    group: str  # of joblock bench's: "single" (a thread) or "aio_single" (a task)
    contender: str  # "joblock": joblock-c or joblock-py, after the build
    builds: tuple[str, ...]


SUBJECTS = (
    Subject("sync", "joblock `Locks`, one thread", "single", "joblock", ("compiled", "pure")),
    Subject("bare-socket", "bare socket, the same two commands", "single", "bare-socket", ("-",)),
    Subject("asyncio", "joblock `AsyncLocks`, one task", "aio_single", "joblock", ("compiled", "pure")),
    Subject("bare-protocol", "bare asyncio protocol, the same two commands", "aio_single", "bare-protocol",
            ("-",)),
)  # fmt: skip
BY_ID = {s.id: s for s in SUBJECTS}


def child(subject: Subject, url: str, warmup: int, pairs: int, made: int) -> None:
    """The program callgrind counts: ``warmup`` pairs, then ``pairs`` pairs (of ``made`` keys made)."""
    contender = subject.contender
    if contender == "joblock":
        contender = "joblock-c" if joblock.implementation == "c" else "joblock-py"
    # Time-driven work, which at native speed comes once in thousands of pairs, but under
    # callgrind as often as the machine is slow: a connection idle for IDLE_CHECK (5 ms)
    # is checked with a select() before it is reused, and the asyncio driver's watchdog
    # wakes every socket_timeout (5 s). Out of reach, the pairs take their native path.
    sync.IDLE_CHECK = math.inf
    url += "?socket_timeout=86400"
    # Every lock value ends in "@host:pid": a run with a pid of 3 digits and one with 5
    # would send values of different lengths, and allocate differently for them. Padded,
    # the pid has the same length in every run (pid_max is at most 4194304).
    host, _, pid = _client.holder_suffix().rpartition(b":")
    _client._holder[:] = [b"%s:%07d" % (host, int(pid))]
    with Arena(url) as arena:
        case = cases.make_case(arena, subject.group, contender)
        warm, measured = case.prepare(warmup), case.prepare(pairs)
        case.prepare(made - pairs)  # the keys the other run uses: making keys costs both runs alike
        if case.run(warm).count(True) != warmup or case.run(measured).count(True) != pairs:
            sys.exit(f"{subject.id}: some pairs failed to acquire or release")


# -- the parent: the snapshot, servers, valgrind, arithmetic -----------------------------------


# Where every run imports joblock from: always this path, as its very characters reach the
# counts (module file names, import caches); a directory of its own per invocation moved
# them by up to 200 instructions per pair from one invocation to the next.
SNAPSHOT = os.path.join(tempfile.gettempdir(), "joblock-instructions")


@contextmanager
def snapshot() -> Iterator[str]:
    """A copy of the joblock package, compiled to bytecode, and of this script, for every
    run to import and run: the tree may change while the runs go on, and a module compiled
    in one run of a subject and not in the other would not cancel out. One invocation at a
    time uses it."""
    os.makedirs(SNAPSHOT, exist_ok=True)
    lock = os.open(SNAPSHOT, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        sys.exit(f"another run of scripts/instructions.py is using {SNAPSHOT}: wait for it to end")
    package = os.path.join(SNAPSHOT, "package")
    try:
        shutil.rmtree(package, ignore_errors=True)  # what a killed run left
        skip = shutil.ignore_patterns("__pycache__", "*.c")
        shutil.copytree(Path(joblock.__file__).parent, Path(package, "joblock"), ignore=skip)
        if not compileall.compile_dir(package, quiet=1):
            sys.exit(f"the copy of joblock in {package} does not compile: was a file half written?")
        shutil.copy(__file__, package)
        yield package
    finally:
        shutil.rmtree(package, ignore_errors=True)
        os.close(lock)


def environment(build: str, package: str) -> dict[str, str]:
    """The runs' environment, the same for everyone: its contents reach the counts too."""
    env = {k: os.environ[k] for k in ("PATH", "LD_LIBRARY_PATH") if k in os.environ}  # to find python
    env.update(LC_ALL="C.UTF-8", PYTHONPATH=package)
    env.update(PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1")
    if build == "pure":
        env["JOBLOCK_NO_EXTENSIONS"] = "1"
    return env


def check_build(build: str, package: str) -> None:
    """Each run imports the snapshot, and the build it is named for: a compiled row that
    ran the pure twin would be silently wrong."""
    probe = [sys.executable, "-c", "import joblock; print(joblock.implementation, joblock.__file__)"]
    found = subprocess.run(probe, env=environment(build, package), capture_output=True, text=True, check=True)
    implementation, path = found.stdout.split()
    if not path.startswith(package):
        sys.exit(f"the runs would import joblock from {path}, not from the snapshot in {package}")
    if build == "compiled" and implementation != "c":
        sys.exit("the compiled core is not built here (joblock.implementation is not 'c'): pip install -e .")
    if build == "pure" and implementation != "python":
        sys.exit(f"JOBLOCK_NO_EXTENSIONS=1 gave joblock.implementation {implementation!r}, not 'python'")


@contextmanager
def _server() -> Iterator[tuple[RedisServer, Node]]:
    """A fresh redis-server holding joblock's release script, as a bench's server does once
    its first contender has run: the bare references send EVALSHA and nothing else."""
    with RedisServer() as server:
        node = Node(parse_url(server.url))
        try:
            node.call("SCRIPT", "LOAD", RELEASE)
            yield server, node
        finally:
            node.close()


def count(subject: Subject, build: str, pairs: int, package: str, warmup: int, made: int, keep: str) -> int:
    """Ir of one run of ``subject`` under callgrind, against a redis-server of its own."""
    with _server() as (server, _):
        out = os.path.join(keep, f"callgrind.{subject.id}.{build}.{pairs}.out")
        command = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
            sys.executable, os.path.join(package, os.path.basename(__file__)),
            "--child", subject.id, "--url", server.url,
            "--warmup", str(warmup), "--count", str(pairs), "--made", str(made),
        ]  # fmt: skip
        env = environment(build, package)
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{subject.id} ({build}) failed under callgrind:\n{done.stderr[-3000:]}")
        with open(out) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
    sys.exit(f"{subject.id} ({build}): no total in callgrind's output")


def versions() -> str:
    def installed(name: str) -> str:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            return f"no {name}"

    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, check=True).stdout
    with _server() as (_, node):
        text = node.call("INFO", "server").decode()
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    info.pop("executable", None)  # a path of the run's own
    server = describe_server(info)  # Valkey says its own version, not redis_version's 7.2.4
    python = f"{platform.python_implementation()} {platform.python_version()}"
    hiredis = f"{installed('hiredis')} (the pure twin's parser when installed)"
    return f"{valgrind.strip()}, {python}, {server}, {hiredis}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add(
        "--pairs",
        type=int,
        nargs=2,
        default=(2000, 12000),
        metavar=("N1", "N2"),
        help="pairs of the two runs of every subject (default: 2000 12000)",
    )
    add("--warmup", type=int, default=500, help="pairs before the counted ones (default: 500)")
    add("--only", choices=list(BY_ID), action="append", help="these subjects (repeatable)")
    add("--jobs", type=int, default=2, help="runs under valgrind at once (default: 2)")
    add("--keep", metavar="DIR", help="keep callgrind's profiles there (for callgrind_annotate)")
    # What the parent tells a run under callgrind.
    add("--child", choices=list(BY_ID), help=argparse.SUPPRESS)
    add("--url", help=argparse.SUPPRESS)
    add("--count", type=int, help=argparse.SUPPRESS)
    add("--made", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(BY_ID[args.child], args.url, args.warmup, args.count, args.made)
        return
    n1, n2 = args.pairs
    if not 0 < n1 < n2 or args.warmup < 0:
        parser.error("--pairs N1 N2 needs 0 < N1 < N2, and --warmup 0 or more")
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind): it counts the instructions")
    subjects = [s for s in SUBJECTS if not args.only or s.id in args.only]
    rows = [(s, b) for s in subjects for b in s.builds]
    with tempfile.TemporaryDirectory(prefix="joblock-instructions-") as scratch, snapshot() as package:
        keep = args.keep or scratch
        for build in {b for _, b in rows}:
            check_build(build, package)
        os.makedirs(keep, exist_ok=True)

        def measure(run: tuple[Subject, str, int]) -> int:
            subject, build, pairs = run
            return count(subject, build, pairs, package, args.warmup, n2, keep)

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            irs = list(pool.map(measure, [(s, b, n) for s, b in rows for n in (n1, n2)]))
    print("| subject | build | instructions per acquire + release pair |")
    print("|---|---|---:|")
    for i, (subject, build) in enumerate(rows):
        low, high = irs[2 * i], irs[2 * i + 1]
        print(f"| {subject.label} | {build} | {(high - low) / (n2 - n1):,.0f} |")
    method = f"(Ir({n2}) - Ir({n1})) / {n2 - n1} after {args.warmup} warm-up pairs"
    print(f"\ncallgrind Ir, {method}; {versions()}")


if __name__ == "__main__":
    main()
