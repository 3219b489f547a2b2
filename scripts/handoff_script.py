#!/usr/bin/env python3
"""The server's time for the release script's hand-off to a waiter (docs/performance.md).

    python scripts/handoff_script.py                       # this checkout's script, a throwaway Redis
    python scripts/handoff_script.py --against /path/to/other/checkout/src/joblock/_scripts.py
    JOBLOCK_SERVER=valkey python scripts/handoff_script.py --rounds 21

Each round pipelines ``--calls`` releases of a lock with one waiter queued (its client
subscribed on its channel): the release script hands the lock over, publishes, and the
lock is deleted again. The figure is Redis's own, ``INFO commandstats``'s microseconds
per ``EVALSHA``: the script's work at the server, not a round trip. ``--against`` runs
another version of the scripts in the rounds between (interleaved), for a before and
after on the same server. ``--fenced`` queues a fenced waiter instead of a plain one.
Prints the medians over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import time
import types
from types import ModuleType
from typing import Any

if importlib.util.find_spec("joblock") is None:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from joblock import _scripts
from joblock._tools.servers import RedisServer
from joblock.settings import parse_url

CLIENT = b"abcdef0123456789"  # the waiter's client id, as a client's own is
HOLDER = b"0123456789abcdef0123456789abcdef"
KEY = b"joblock:handoff"


def scripts_at(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("other_scripts", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_of(redis: Any, script: bytes, calls: int, fenced: bool, listener: Any) -> float:
    """Microseconds per hand-off at the server, over ``calls`` of them."""
    sha = redis.script_load(script)
    redis.config_resetstat()
    counter = b"{%s}:counter" % KEY if fenced else b"0"
    pipe = redis.pipeline(transaction=False)
    for i in range(calls):
        pipe.set(KEY, HOLDER + _scripts.MARK, px=10_000)
        deadline = int(time.time() * 1000) + 60_000
        pipe.rpush(b"{%s}:waiters" % KEY, b"%s:%d %d 10000 %s 1 w%031d" % (CLIENT, i, deadline, counter, i))
        pipe.evalsha(sha, 1, KEY, HOLDER)
        pipe.delete(KEY)
        if i % 100 == 99 or i == calls - 1:
            replies = pipe.execute()
            if replies[2::4] != [1] * len(replies[2::4]):
                sys.exit(f"handoff_script: a release did not answer 1: {replies[2::4][:5]}")
            while listener.get_message():  # the hand-offs' messages, read as they come
                pass
    return float(redis.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the server (default: a throwaway one)")
    parser.add_argument("--against", metavar="SCRIPTS_PY", help="another _scripts.py, run interleaved")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--fenced", action="store_true")
    args = parser.parse_args()
    import redis as redis_py  # the benchmark extra's

    given = contextlib.nullcontext(types.SimpleNamespace(url=args.url))
    with RedisServer() if args.url is None else given as server:
        settings = parse_url(server.url)
        redis = redis_py.Redis(host=settings.host, port=settings.port, db=settings.db)
        listener = redis_py.Redis(host=settings.host, port=settings.port).pubsub()
        listener.subscribe(b"joblock:wake:" + CLIENT)
        subjects = {"this checkout": _scripts.RELEASE}
        if args.against:
            subjects["--against"] = scripts_at(args.against).RELEASE
        times: dict[str, list[float]] = {name: [] for name in subjects}
        for _ in range(args.rounds):
            for name, script in subjects.items():
                times[name].append(round_of(redis, script, args.calls, args.fenced, listener))
        kind = "fenced" if args.fenced else "plain"
        for name, got in times.items():
            median = statistics.median(got)
            print(f"{name}: {median:.2f} us per {kind} hand-off at the server (median of {len(got)})")


if __name__ == "__main__":
    main()
