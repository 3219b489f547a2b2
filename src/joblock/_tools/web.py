"""``joblock web``: a page for operators that shows the locks held under a prefix, live.

It reads what ``joblock inspect`` reads, through the same ``admin.read_page``: a page
is at most ``page_size`` keys found by SCAN (COUNT bounded, never KEYS) on the server
or every primary of its Redis Cluster, their locks grouped by job, each holder with
its ttl left and fencing number, each lock with its waiters. The browser asks for a
page as JSON every couple of seconds; "next page" hands back the cursor the last page
ended at.

What never leaves the server: a lock's full token (a holder is named to the browser by
``Board.fingerprint``, a keyed hash of key and token, which the release compares
against the lock's current value) and the URL's password (the page shows
``Settings.url()``, which hides it).

Releasing a holder from the page exists only with ``allow_release``. It is a POST of
JSON that must carry, in a header, the secret this process put in the page, from a
page of this very server (Origin, Sec-Fetch-Site), and goes through joblock's own
release script, as the holder's ``lease.release()`` would (compare-and-delete, the
lock handed to its first waiter). The Host header must name this server, so that
another site's name pointed at 127.0.0.1 (DNS rebinding) reads nothing.

Starlette, on uvicorn: Starlette is a small, typed ASGI toolkit (FastAPI is built on
it), maintained in the encode organisation with frequent releases, and needs only
anyio; its thread pool lets the page use ``admin``'s blocking ``Node``s as they are.
uvicorn is the server its documentation runs it with.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import html
import importlib.resources
import ipaddress
import json
import secrets
import socket
import threading
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import errors
from .._core import core
from ..settings import Settings
from .admin import Cursor, Held, Servers, describe, read_page, scan_match

REFRESH = 2.0  # seconds between the page's fetches
BUDGET = 0.25  # seconds of SCAN calls a page may take when the filter matches few keys
MAX_PAGE_SIZE = 10_000
CSRF_HEADER = "X-Joblock-CSRF"

# Every response: nothing inline runs (the page's script and style are files of this
# server), no other site may frame the page (a click on "release" it did not mean),
# nothing is cached, and no address is sent on as a Referer.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_FILES = {"web.js": "text/javascript; charset=utf-8", "web.css": "text/css; charset=utf-8"}


@dataclasses.dataclass(frozen=True)
class Options:
    prefix: str = "joblock"
    page_size: int = 100
    allow_release: bool = False
    refresh: float = REFRESH
    budget: float = BUDGET


class Board:
    """What the routes share: the servers (found again after a failure), the secrets
    of this process, and the pages and releases in the form the browser gets them."""

    def __init__(self, settings: Settings, options: Options, twin: ModuleType = core) -> None:
        if not 1 <= options.page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be from 1 to {MAX_PAGE_SIZE}, not {options.page_size}")
        self.settings = settings
        self.options = options
        self.twin = twin
        self.csrf = secrets.token_urlsafe(32)
        self._secret = secrets.token_bytes(32)  # keys the fingerprints and signs the cursors
        self._lock = threading.Lock()
        self._servers: Servers | None = Servers(settings, twin)  # fails here when Redis is not there

    def servers(self) -> Servers:
        with self._lock:
            if self._servers is None:
                self._servers = Servers(self.settings, self.twin)
            return self._servers

    def forget(self) -> None:
        """After a failure: the next request looks for the servers again (a Redis Cluster
        may have a new primary by then)."""
        with self._lock:
            servers, self._servers = self._servers, None
        if servers is not None:
            servers.close()

    def _mac(self, purpose: bytes, *parts: bytes) -> str:
        """HMAC-SHA256 with this process's secret, one purpose apart from the other."""
        return hmac.new(self._secret, b"\0".join([purpose, *parts]), hashlib.sha256).hexdigest()[:32]

    def fingerprint(self, key: bytes, token: str) -> str:
        """A holder's name for the browser: a keyed hash of key and token, which says
        nothing of the token to whoever has not this process's secret."""
        return self._mac(b"holder", key, token.encode())

    def _sign(self, payload: str) -> str:
        return self._mac(b"cursor", payload.encode())

    def cursor_text(self, cursor: Cursor) -> str:
        payload = json.dumps([cursor.server, cursor.scan.decode(), [k.hex() for k in cursor.pending]])
        data = base64.urlsafe_b64encode(payload.encode()).decode()
        return f"{data}.{self._sign(data)}"

    def parse_cursor(self, text: str) -> Cursor:
        """A cursor this process gave (signed: a page reads no key a SCAN of its did not find)."""
        data, _, signature = text.partition(".")
        if not _same(signature, self._sign(data)):
            raise ValueError("cursor: not one this server gave (it restarted?): start from the first page")
        server, scan, pending = json.loads(base64.urlsafe_b64decode(data))
        return Cursor(server, scan.encode(), tuple(bytes.fromhex(k) for k in pending))

    def page(self, pattern: str, cursor: str) -> dict[str, Any]:
        """One page as the browser gets it: locks grouped by job, then by key."""
        start = self.parse_cursor(cursor) if cursor else Cursor()
        pattern = _glob(pattern)
        page = read_page(
            self.servers(),
            scan_match(self.options.prefix, pattern),
            self.options.page_size,
            start,
            self.options.budget,
        )
        locks: dict[bytes, dict[str, Any]] = {}
        for held in page.rows:
            lock = locks.get(held.key)
            if lock is None:
                waiters = page.waiters.get(held.key, [])
                lock = locks[held.key] = {
                    "key": held.key.decode(errors="replace"),
                    "ref": held.key.hex(),
                    "kind": "readers" if held.limit == 0 else "counting" if held.limit > 1 else "lock",
                    "limit": held.limit,
                    "holders": [],
                    "waiters": [
                        {"holder": w.holder, "kind": w.kind, "left": round(w.left, 1)} for w in waiters
                    ],
                }
            lock["holders"].append(self._holder(held))
        jobs: dict[str, list[dict[str, Any]]] = {}
        for lock in sorted(locks.values(), key=lambda lock: str(lock["key"])):
            jobs.setdefault(job_name(lock["key"], self.options.prefix), []).append(lock)
        return {
            "server": self.settings.url(),
            "prefix": self.options.prefix,
            "match": pattern,
            "page_size": self.options.page_size,
            "keys": page.keys,
            "holders": len(page.rows),
            "jobs": [{"job": job, "locks": jobs[job]} for job in sorted(jobs)],
            "next": None if page.next is None else self.cursor_text(page.next),
            "release": self.options.allow_release,
        }

    def _holder(self, held: Held) -> dict[str, Any]:
        return {
            "id": self.fingerprint(held.key, held.token),
            "holder": held.holder,
            "ttl": None if held.left is None else round(held.left, 1),
            "fence": held.fence,
        }

    def release(self, key: bytes, fingerprint: str) -> tuple[int, str]:
        """Releases the holder of ``key`` named by ``fingerprint`` if it still holds it:
        an HTTP status and what happened."""
        node = self.servers().node_of(key)
        shown = key.decode(errors="replace")
        for held in describe(node, [key]):
            if _same(fingerprint, self.fingerprint(key, held.token)):
                if node.release(key, held.token.encode()) == 1:
                    return 200, f"released {shown} (held by {held.holder})"
                break
        return (
            409,
            f"{shown} is no longer held as the page showed it (released, expired or taken over): refresh",
        )


def _same(given: str, expected: str) -> bool:
    """Compared in constant time (as bytes: whatever a request sent, even not ASCII)."""
    return hmac.compare_digest(given.encode(errors="surrogateescape"), expected.encode())


def _glob(pattern: str) -> str:
    """The filter as a glob after the prefix: text without glob characters matches the
    keys that start with it (a job's name, or the start of a key)."""
    pattern = pattern.strip()
    if len(pattern) > 500:
        raise ValueError("match: at most 500 characters")
    if not pattern:
        return "*"
    return pattern if any(c in pattern for c in "*?[") else pattern + "*"


def job_name(key: str, prefix: str) -> str:
    """The job of ``prefix:Job:identifier`` (or ``prefix:Job``): "Job"."""
    rest = key[len(prefix) + 1 :] if prefix and key.startswith(prefix + ":") else key
    return rest.split(":", 1)[0]


def _static(name: str) -> str:
    return importlib.resources.files(__package__ or "joblock._tools").joinpath(name).read_text("utf-8")


def _host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8379" -> "::1"."""
    if header.startswith("["):
        return header[1 : header.find("]")]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_hosts(bound: str) -> frozenset[str] | None:
    """The names the Host header may give: the bound address, and on loopback the
    names of loopback; None (any) when bound to every address, where a proxy or a DNS
    name the operator chose may stand in front."""
    if bound in ("", "0.0.0.0", "::"):
        return None
    names = {bound.strip("[]")}
    try:
        loopback = ipaddress.ip_address(bound.strip("[]")).is_loopback
    except ValueError:
        loopback = bound == "localhost"
    if loopback:
        names |= {"localhost", "127.0.0.1", "::1"}
    return frozenset(names)


class _Guard(BaseHTTPMiddleware):
    """Refuses a Host this server is not, and puts ``HEADERS`` on every response."""

    def __init__(self, app: Any, hosts: frozenset[str] | None) -> None:
        super().__init__(app)
        self.hosts = hosts

    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if self.hosts is not None and _host_name(request.headers.get("host", "")) not in self.hosts:
            response: Response = Response("unknown Host", 421, media_type="text/plain")
        else:
            response = await call_next(request)
        response.headers.update(HEADERS)
        return response


def _same_origin(request: Request) -> bool:
    """The request comes from a page of this server: Origin names it, and a browser
    that sends Sec-Fetch-Site says so too."""
    host = request.headers.get("host", "")
    origin = request.headers.get("origin")
    site = request.headers.get("sec-fetch-site")
    return origin in (f"http://{host}", f"https://{host}") and site in (None, "same-origin")


def create_app(board: Board, bound: str = "127.0.0.1") -> Starlette:
    """The page's routes over ``board``; ``bound`` is the address the server listens on."""

    async def index(request: Request) -> Response:
        page = _static("web.html")
        values = {
            "prefix": board.options.prefix,
            "server": board.settings.url(),
            "page_size": str(board.options.page_size),
            "refresh": str(board.options.refresh),
            "csrf": board.csrf if board.options.allow_release else "",
        }
        for name, value in values.items():
            page = page.replace("{{" + name + "}}", html.escape(value))
        return Response(page, media_type="text/html; charset=utf-8")

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _FILES:
            return Response("not found", 404, media_type="text/plain")
        return Response(_static(name), media_type=_FILES[name])

    async def locks(request: Request) -> Response:
        query = request.query_params
        try:
            data = await run_in_threadpool(board.page, query.get("match", ""), query.get("cursor", ""))
        except ValueError as e:  # a bad filter or cursor
            return JSONResponse({"error": str(e)}, 400)
        except errors.JoblockError as e:
            board.forget()
            return JSONResponse({"error": f"Redis: {e}"}, 502)
        return JSONResponse(data)

    async def release(request: Request) -> Response:
        token = request.headers.get(CSRF_HEADER, "")
        if not (_same(token, board.csrf) and _same_origin(request)):
            return JSONResponse({"error": "refused: not a request of this server's page"}, 403)
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return JSONResponse({"error": "refused: the body must be JSON"}, 415)
        try:
            body = await request.json()
            key, fingerprint = bytes.fromhex(body["key"]), str(body["id"])
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": 'the body must be {"key": KEY IN HEX, "id": HOLDER ID}'}, 400)
        try:
            status, message = await run_in_threadpool(board.release, key, fingerprint)
        except errors.JoblockError as e:
            board.forget()
            return JSONResponse({"error": f"Redis: {e}"}, 502)
        return JSONResponse({"released": status == 200, "message": message}, status)

    routes = [
        Route("/", index),
        Route("/static/{name}", asset),
        Route("/api/locks", locks),
    ]
    if board.options.allow_release:  # without it, there is no way to release at all
        routes.append(Route("/api/release", release, methods=["POST"]))
    return Starlette(routes=routes, middleware=[Middleware(_Guard, hosts=allowed_hosts(bound))])


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, open before the banner names its port (``port`` 0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host.strip("[]"), port), family=family)


def serve(settings: Settings, options: Options, sock: socket.socket) -> int:
    """Serves the page on ``sock`` until interrupted (Ctrl-C ends it as KeyboardInterrupt)."""
    board = Board(settings, options)  # reaches Redis first: a failure ends the command at once
    host, port = sock.getsockname()[:2]
    app = create_app(board, host)
    shown = f"[{host}]" if ":" in host else host
    releasing = "on" if options.allow_release else "off; --allow-release turns it on"
    print(
        f"joblock web: the locks under {options.prefix!r} at {settings.url()}, "
        f"on http://{shown}:{port}/ (releasing from the page: {releasing})",
        flush=True,
    )
    config = uvicorn.Config(app, log_level="warning", access_log=False, server_header=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
