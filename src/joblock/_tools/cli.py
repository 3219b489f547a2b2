"""The ``joblock`` command: demo, bench, inspect, release.

Each subcommand works against ``$REDIS_URL`` (or ``--url``); ``demo`` and ``bench``
start a throwaway real Redis when neither is given.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import JoblockError
from .admin import inspect, release
from .bench import add_arguments
from .bench import run as bench
from .demo import run as demo
from .servers import redis_url

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="joblock", description="Redis locks for background jobs.")
    parser.add_argument(
        "--url", help="Redis URL (default: $REDIS_URL, else a throwaway server for demo/bench)"
    )
    parser.add_argument("--prefix", default="joblock", help="key prefix (default: joblock)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the Rails article's two problems and a dispatcher, with several workers")
    bench = sub.add_parser("bench", help="compare joblock with redis-benchmark and the Python peers")
    add_arguments(bench)
    inspect = sub.add_parser("inspect", help="list held locks: holder, remaining ttl, fence (SCAN only)")
    inspect.add_argument("pattern", nargs="?", default="*", help="glob after the prefix (default: *)")
    release = sub.add_parser("release", help="force-release a lock, whoever holds it")
    release.add_argument("key", help="the full lock key")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except JoblockError as e:
        print(f"joblock {args.command}: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        with redis_url(args.url, throwaway=True) as url:
            return demo(url, args.prefix)
    if args.command == "bench":
        return bench(args)
    with redis_url(args.url, throwaway=False) as url:
        if args.command == "inspect":
            return inspect(url, args.prefix, args.pattern)
        return release(url, args.key)


if __name__ == "__main__":
    sys.exit(main())
