"""``joblock web``: the operators' page, served for real.

The app (``joblock._tools.web``) runs in uvicorn on a free loopback port of this process,
once per core twin, against the suite's redis-server and its Redis Cluster; the tests
read its JSON and HTML over HTTP as a browser would, and send it releases, honest and
forged. A few tests run the ``joblock web`` command itself and drive Debian's chromium
through chromedriver (Selenium): the rows a person sees, the filter, the pages, a live
refresh, the release button, and a release attempted from another site's page.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import uvicorn

import joblock
import test_cli
from conftest import locks_class
from joblock._tools import web
from joblock._tools.servers import RedisServer
from joblock.cluster import ClusterLocks
from joblock.compat import RedisLock
from test_cli import HOLDER, ROOT, command_env, joblock_command, one_line_failure
from test_waits import Waiter, until, until_queued

bare = test_cli.bare  # a virtualenv with joblock and nothing else: no starlette, no uvicorn

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PASSWORD = "web-Secret-7"
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def secured_server() -> Iterator[RedisServer]:
    """A server that wants a password, which no page or banner may show."""
    with RedisServer("--requirepass", PASSWORD) as server:
        yield server


def secured_url(server: RedisServer) -> str:
    return server.url.replace("redis://", f"redis://:{PASSWORD}@")


# -- the app, in this process ------------------------------------------------------------------


def _lower(headers: Any) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


class Served:
    """``joblock._tools.web`` on uvicorn in a thread, on a free loopback port."""

    def __init__(self, board: web.Board) -> None:
        self.board = board
        self.sock = web.listen("127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(web.create_app(board), log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        until(lambda: self.server.started, "uvicorn started")

    def request(
        self, path: str, body: Any = None, headers: dict[str, str] | None = None, method: str | None = None
    ) -> tuple[int, dict[str, str], str]:
        """Status, headers (names in lower case) and text of one request (``body``: JSON, POSTed)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=headers or {}, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, _lower(response.headers), response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, _lower(e.headers), e.read().decode()

    def page(self, match: str = "", cursor: str = "") -> dict[str, Any]:
        query = urllib.parse.urlencode({"match": match, "cursor": cursor})
        status, _, text = self.request(f"/api/locks?{query}")
        assert status == 200, text
        return json.loads(text)

    def release(self, ref: str, holder_id: str, **headers: str) -> tuple[int, str]:
        """A POST as the page makes it; ``headers`` replace the page's (None: left out)."""
        sent = {
            "Content-Type": "application/json",
            web.CSRF_HEADER: self.board.csrf,
            "Origin": self.base,
            "Sec-Fetch-Site": "same-origin",
            **headers,
        }
        sent = {k: v for k, v in sent.items() if v is not None}
        status, _, text = self.request("/api/release", {"key": ref, "id": holder_id}, sent)
        return status, text

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.board.forget()


@pytest.fixture
def serve(core: ModuleType, redis_server: RedisServer) -> Iterator[Callable[..., Served]]:
    """Serves the page on the test's twin: ``serve(prefix, url=..., **options)``."""
    started: list[Served] = []

    def start(prefix: str, url: str | None = None, **options: Any) -> Served:
        # Pages here end when full or when the scan is done, not when the quarter of a
        # second of a page's SCANs is spent: the session's server holds every module's keys.
        options.setdefault("budget", 60.0)
        settings = joblock.settings.parse_url(url or redis_server.url)
        served = Served(web.Board(settings, web.Options(prefix=prefix, **options), core))
        started.append(served)
        return served

    yield start
    for served in started:
        served.close()


@pytest.fixture(scope="module")
def quiet_server() -> Iterator[RedisServer]:
    """A server of this module's own, for the tests whose pages stop scanning at a time
    budget (the browser's, the command's quarter of a second; a budget of 0): the keys
    other modules leave on the session's server must not take it up."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def quiet_raw(quiet_server: RedisServer) -> Iterator[Any]:
    import redis

    client = redis.Redis.from_url(quiet_server.url)
    yield client
    client.close()


def holders(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each holder on a page, with its job and lock's fields (one dict a holder)."""
    return [
        {"job": job["job"], **{k: v for k, v in lock.items() if k != "holders"}, **holder}
        for job in data["jobs"]
        for lock in job["locks"]
        for holder in lock["holders"]
    ]


def walk(served: Served, match: str = "") -> list[dict[str, Any]]:
    """Every page of a scan, first to last."""
    pages = [served.page(match)]
    while pages[-1]["next"]:
        pages.append(served.page(match, pages[-1]["next"]))
    return pages


def test_a_page_shows_each_lock_grouped_by_job(serve, make_locks, raw):
    locks = make_locks()
    fenced = locks.acquire(locks.key("ProductSalesJob", 42), 30, fence=True)
    plain = locks.acquire(locks.key("CleanupDataJob"), 60)
    places = [locks.acquire(locks.key("ExportJob", 7), 30, limit=3) for _ in range(2)]
    readers = [locks.acquire(locks.key("Catalog"), 30, shared=True) for _ in range(2)]
    forever = raw.lock(f"{locks.prefix}:Forever:1", lock_class=RedisLock)  # no ttl
    assert forever.acquire() is True
    odd = locks.acquire(f"{locks.prefix}:Odd}}1", 30)  # a '}' but no hash tag: it can have no fence
    raw.set(f"{locks.prefix}:NotALock:1", "hello")
    raw.zadd(f"{locks.prefix}:Scores:1", {"a": 1})
    waiters = [
        Waiter(make_locks(), plain.key, wait=10),
        Waiter(make_locks(), plain.key, wait=10, shared=True),
    ]
    for i, waiter in enumerate(waiters):
        waiter.start()
        until_queued(raw, plain.key, i + 1)
    try:
        data = serve(locks.prefix).page()
    finally:
        assert plain.release() is True
        second = waiters[0].result()
        assert second.release() is True
        assert waiters[1].result().release() is True
    assert [job["job"] for job in data["jobs"]] == [
        "Catalog",
        "CleanupDataJob",
        "ExportJob",
        "Forever",
        "Odd}1",
        "ProductSalesJob",
    ]
    by_key = {lock["key"]: lock for job in data["jobs"] for lock in job["locks"]}
    product = by_key[fenced.key]
    assert (product["kind"], product["limit"], product["waiters"]) == ("lock", 1, [])
    [holder] = product["holders"]
    assert holder["holder"] == HOLDER and holder["fence"] == fenced.fence and 25 < holder["ttl"] <= 30
    cleanup = by_key[plain.key]
    assert [(w["holder"], w["kind"]) for w in cleanup["waiters"]] == [(HOLDER, "writer"), (HOLDER, "reader")]
    assert all(0 < w["left"] <= 10 for w in cleanup["waiters"])
    assert 50 < cleanup["holders"][0]["ttl"] <= 60 and cleanup["holders"][0]["fence"] is None
    export = by_key[places[0].key]
    assert (export["kind"], export["limit"], len(export["holders"])) == ("counting", 3, 2)
    catalog = by_key[readers[0].key]
    assert (catalog["kind"], catalog["limit"], len(catalog["holders"])) == ("readers", 0, 2)
    assert by_key[f"{locks.prefix}:Forever:1"]["holders"][0]["ttl"] is None
    assert by_key[odd.key]["holders"][0]["fence"] is None
    assert data["holders"] == 8 and data["keys"] == 8 and data["next"] is None
    assert bytes.fromhex(product["ref"]) == fenced.key.encode()
    assert locks.release_many([fenced, odd, *places, *readers]) == [True] * 6
    forever.release()


def test_the_filter_is_a_glob_after_the_prefix_or_the_start_of_a_key(serve, make_locks):
    locks = make_locks()
    leases = [
        locks.acquire(locks.key(job, n), 30) for job in ("Sales", "SalesReport", "Cleanup") for n in (1, 2)
    ]
    served = serve(locks.prefix)
    keys = lambda data: sorted(h["key"] for h in holders(data))  # noqa: E731
    assert keys(served.page("Sales")) == [locks.key(j, n) for j in ("Sales", "SalesReport") for n in (1, 2)]
    assert keys(served.page("Sales:*")) == [locks.key("Sales", 1), locks.key("Sales", 2)]
    assert keys(served.page("*:2")) == sorted(locks.key(j, 2) for j in ("Sales", "SalesReport", "Cleanup"))
    assert served.page("Nothing")["jobs"] == []
    assert served.page("Sales:*")["match"] == "Sales:*"
    status, _, text = served.request("/api/locks?match=" + "x" * 501)
    assert status == 400 and "match" in json.loads(text)["error"]
    assert locks.release_many(leases) == [True] * 6


def test_pages_hold_at_most_page_size_keys_and_cover_every_lock(serve, make_locks):
    locks = make_locks()
    leases = locks.acquire_many([locks.key("Report", i) for i in range(25)], 30)
    served = serve(locks.prefix, page_size=4)
    pages = walk(served)
    assert all(page["keys"] <= 4 for page in pages)
    assert len(pages) >= 7
    seen = [h["key"] for page in pages for h in holders(page)]
    assert sorted(set(seen)) == sorted(lease.key for lease in leases)
    assert locks.release_many(leases) == [True] * 25


def test_a_filter_that_matches_little_ends_pages_at_its_budget(serve, make_locks, quiet_server, quiet_raw):
    """With no time to spare, each page is one SCAN call: pages come back with fewer keys
    (or none), and following them still finds every lock once. (On the module's own
    server: on the session's, a page for every ten keys that the modules the worker ran
    had left made a walk that outlasted the leases' 30 s on a busy machine.)"""
    locks = make_locks(quiet_server.url)
    leases = locks.acquire_many([locks.key("Sparse", i) for i in range(20)], 30)
    others = {f"{locks.prefix}:Other:{i}": "x" for i in range(200)}
    quiet_raw.mset(others)
    served = serve(locks.prefix, url=quiet_server.url, page_size=10, budget=0.0)
    pages = walk(served, "Sparse:*")
    assert len(pages) > 2 and any(page["keys"] < 10 for page in pages[:-1])
    seen = {h["key"] for page in pages for h in holders(page)}  # SCAN may give a key twice
    assert sorted(seen) == sorted(lease.key for lease in leases)
    assert locks.release_many(leases) == [True] * 20
    quiet_raw.delete(*others)


def test_a_cursor_the_server_did_not_give_is_refused(serve, make_locks):
    locks = make_locks()
    leases = locks.acquire_many([locks.key("Report", i) for i in range(5)], 30)
    served = serve(locks.prefix, page_size=2)
    cursor = served.page()["next"]
    data, signature = cursor.split(".")
    forged = json.dumps([0, "0", [b"elsewhere:secret".hex()]]).encode()
    for bad in (f"{data}.{'0' * 32}", f"{base64.urlsafe_b64encode(forged).decode()}.{signature}", "x", "é.é"):
        status, _, text = served.request("/api/locks?" + urllib.parse.urlencode({"cursor": bad}))
        assert status == 400 and "cursor" in json.loads(text)["error"]
    assert locks.release_many(leases) == [True] * 5


def test_every_primary_of_a_cluster_is_paged_through(core, cluster, serve):
    prefix = f"web{next(_prefixes)}"
    locks = type("ClusterLocks", (ClusterLocks,), {"_core": core})(cluster.url, prefix=prefix)
    try:
        keys = [locks.key("Sharded", i) for i in range(30)]
        leases = locks.acquire_many(keys, 30, fence=True)
        served = serve(locks.prefix, url=cluster.nodes[4].url, page_size=7, allow_release=True)
        servers = served.board.servers()
        assert len(servers.nodes) == 3
        assert len({servers.node_of(key.encode()).settings.port for key in keys}) == 3  # on every primary
        pages = walk(served)
        assert all(page["keys"] <= 7 for page in pages)
        found = {h["key"]: h for page in pages for h in holders(page)}
        assert sorted(found) == sorted(keys)
        assert {k: h["fence"] for k, h in found.items()} == {lease.key: lease.fence for lease in leases}
        # A release goes to the primary of the key's slot.
        status, text = served.release(found[keys[0]]["ref"], found[keys[0]]["id"])
        assert status == 200, text
        assert locks.release_many(leases) == [False] + [True] * 29
    finally:
        locks.close()


# -- releasing: only when allowed, only from the page, only what the page showed -----------------


def test_without_allow_release_there_is_no_release_at_all(serve, make_locks):
    locks = make_locks()
    lease = locks.acquire(locks.key("Nightly"), 30)
    served = serve(locks.prefix)
    [holder] = holders(served.page())
    status, text = served.release(holder["ref"], holder["id"], **{web.CSRF_HEADER: ""})
    assert status == 404, text
    _, _, html = served.request("/")
    assert '<meta name="joblock-csrf" content="">' in html
    assert served.page()["release"] is False
    assert lease.release() is True


def test_a_release_from_the_page_releases_that_holder_and_hands_the_lock_on(serve, make_locks, raw):
    locks = make_locks()
    key = locks.key("Nightly")
    lease = locks.acquire(key, 30)
    waiter = Waiter(make_locks(), key, wait=10)
    waiter.start()
    until_queued(raw, key, 1)
    served = serve(locks.prefix, allow_release=True)
    [holder] = holders(served.page())
    status, text = served.release(holder["ref"], holder["id"])
    assert status == 200, text
    assert json.loads(text) == {"released": True, "message": f"released {key} (held by {HOLDER})"}
    handed = waiter.result()  # as lease.release() would, the lock goes to its first waiter
    assert raw.get(key) == handed.token
    assert lease.release() is False
    # The same holder again: it no longer holds the lock, and the new holder is left alone.
    status, text = served.release(holder["ref"], holder["id"])
    assert status == 409 and "no longer held" in json.loads(text)["message"]
    assert raw.get(key) == handed.token
    assert handed.release() is True


def test_a_release_of_a_counting_lock_frees_one_place(serve, make_locks, raw):
    locks = make_locks()
    key = locks.key("Export", 1)
    places = [locks.acquire(key, 30, limit=3, fence=True) for _ in range(2)]
    served = serve(locks.prefix, allow_release=True)
    by_fence = {h["fence"]: h for h in holders(served.page())}
    assert set(by_fence) == {places[0].fence, places[1].fence}
    status, text = served.release(by_fence[places[0].fence]["ref"], by_fence[places[0].fence]["id"])
    assert status == 200, text
    assert [m for m in raw.zrange(key, 0, -1) if m != b"limit"] == [places[1].token]  # token#fence
    assert [place.release() for place in places] == [False, True]


@pytest.mark.parametrize(
    "forged",
    [
        {web.CSRF_HEADER: None},  # a form or fetch of another site: it cannot read the page's secret
        {web.CSRF_HEADER: "0" * 43},
        {"Origin": "http://evil.example"},  # even with the secret
        {"Origin": None},
        {"Sec-Fetch-Site": "cross-site"},
        {"Content-Type": "text/plain"},
        {web.CSRF_HEADER: "é" * 43},
    ],
    ids=["no-secret", "wrong-secret", "foreign-origin", "no-origin", "cross-site", "not-json", "not-ascii"],
)
def test_a_forged_release_is_refused_and_the_lock_stays(serve, make_locks, raw, forged):
    locks = make_locks()
    lease = locks.acquire(locks.key("Nightly"), 30)
    served = serve(locks.prefix, allow_release=True)
    [holder] = holders(served.page())
    status, text = served.release(holder["ref"], holder["id"], **forged)
    assert status in (403, 415), text
    assert "refused" in json.loads(text)["error"]
    assert raw.get(lease.key) == lease.token
    status, text = served.release(holder["ref"], "0" * 32)  # a holder id the page never showed
    assert status == 409, text
    assert raw.get(lease.key) == lease.token
    status, _, _ = served.request("/api/release", method="GET")
    assert status == 405
    assert lease.release() is True


def test_a_host_that_is_not_this_server_reads_nothing(serve, make_locks):
    """DNS rebinding: another site's name pointed at 127.0.0.1 gets no page and no locks."""
    locks = make_locks()
    served = serve(locks.prefix, allow_release=True)
    for path in ("/", "/api/locks"):
        status, _, text = served.request(path, headers={"Host": "evil.example:8379"})
        assert status == 421 and locks.prefix not in text
    for host in ("localhost", "127.0.0.1:8379", "[::1]:8379"):
        assert served.request("/", headers={"Host": host})[0] == 200
    assert web.allowed_hosts("0.0.0.0") is None
    assert web.allowed_hosts("10.1.2.3") == {"10.1.2.3"}


def test_no_token_and_no_password_ever_reach_the_browser(core, secured_server):
    url = secured_url(secured_server)
    locks = locks_class(core)(url, prefix=f"secretive{next(_prefixes)}")
    leases = [
        locks.acquire(locks.key("Plain", 1), 30, fence=True),
        locks.acquire(locks.key("Counted", 1), 30, limit=2, fence=True),
        locks.acquire(locks.key("Read", 1), 30, shared=True),
    ]
    settings = joblock.settings.parse_url(url)
    served = Served(web.Board(settings, web.Options(locks.prefix, allow_release=True), core))
    try:
        texts = [served.request(path)[2] for path in ("/", "/api/locks", "/static/web.js", "/static/web.css")]
        texts.append(served.release(holders(json.loads(texts[1]))[0]["ref"], "0" * 32)[1])
    finally:
        served.close()
        locks.release_many(leases)
        locks.close()
    assert len(holders(json.loads(texts[1]))) == 3
    assert f"redis://:***@127.0.0.1:{secured_server.port}/0" in texts[0]
    for text in texts:
        assert PASSWORD not in text
        for lease in leases:
            assert lease.token[:32].decode() not in text  # its random part, in any form
            assert lease.token[:32].hex() not in text


def test_a_page_says_when_redis_is_gone_and_reads_again_once_it_is_back(core):
    with RedisServer("--requirepass", PASSWORD) as server:
        url = secured_url(server)
        settings = joblock.settings.parse_url(url)
        served = Served(web.Board(settings, web.Options("back"), core))
        try:
            assert served.page()["jobs"] == []
            server.stop()
            status, _, text = served.request("/api/locks")
            assert status == 502 and json.loads(text)["error"].startswith("Redis: ")
            assert PASSWORD not in text
            server.start()
            locks = locks_class(core)(url, prefix="back")
            lease = locks.acquire(locks.key("Again", 1), 30)
            assert [h["key"] for h in holders(served.page())] == [lease.key]
            assert lease.release() is True
            locks.close()
        finally:
            served.close()


def test_responses_forbid_framing_inline_scripts_and_caching(serve, make_locks):
    served = serve(make_locks().prefix)
    for path in ("/", "/api/locks", "/static/web.js"):
        _, headers, _ = served.request(path)
        assert headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert "script-src 'self'" in headers["content-security-policy"]
        assert headers["cache-control"] == "no-store"
    assert served.request("/static/secrets.txt")[0] == 404


# -- the command -----------------------------------------------------------------------------------


class WebCommand:
    """``joblock web`` in a subprocess, on a free port; where it serves is read from its banner."""

    def __init__(self, url: str, *args: str, pure: bool = False) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "joblock", "web", "--port", "0", *args],
            env=command_env(url, pure),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr = ""
        self.banner = self.process.stdout.readline()
        match = re.search(r" on (http://\S+?)/ ", self.banner)
        assert match, (self.banner, self.close())
        self.base = match.group(1)

    def close(self) -> str:
        """Stops it; what it wrote on stderr."""
        if self.process.returncode is None:
            self.process.terminate()
            self.stderr = self.process.communicate(timeout=30)[1]
        return self.stderr


@pytest.fixture
def web_command() -> Iterator[Callable[..., WebCommand]]:
    started: list[WebCommand] = []

    def start(url: str, *args: str, pure: bool = False) -> WebCommand:
        started.append(WebCommand(url, *args, pure=pure))
        return started[-1]

    yield start
    for command in started:
        command.close()


def listening_addresses(port: int) -> list[str]:
    """The local addresses of the sockets listening on ``port`` (Linux's /proc/net/tcp)."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in list(f)[1:]:
                local, _, state = line.split()[1:4]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port and len(address) == width:
                    found.append(address)
    return found


@pytest.mark.parametrize("pure", [False, True], ids=["active-core", "pure-core"])
def test_the_command_listens_on_loopback_only_by_default(web_command, secured_server, pure):
    command = web_command(secured_url(secured_server), pure=pure)
    port = int(command.base.rsplit(":", 1)[1])
    assert command.base.startswith("http://127.0.0.1:")
    assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, and nothing else
    assert "redis://:***@127.0.0.1" in command.banner and PASSWORD not in command.banner
    assert "releasing from the page: off" in command.banner
    with urllib.request.urlopen(command.base + "/api/locks", timeout=30) as response:
        assert json.loads(response.read())["server"] == f"redis://:***@127.0.0.1:{secured_server.port}/0"
    assert PASSWORD not in command.close()


def test_without_the_web_extra_the_command_says_what_to_install(bare, redis_server):
    line = one_line_failure(joblock_command("web", url=redis_server.url, **bare), 7)
    assert line.startswith("joblock web: needs ")
    assert "pip install 'joblock[web]'" in line


def test_the_commands_failures_are_one_line(redis_server, down_url):
    assert "--page-size" in one_line_failure(
        joblock_command("web", "--page-size", "0", url=redis_server.url), 2
    )
    assert "--port" in one_line_failure(joblock_command("web", "--port", "70000", url=redis_server.url), 2)
    with contextlib.closing(web.listen("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        line = one_line_failure(joblock_command("web", "--port", port, url=redis_server.url), 2)
    assert "cannot listen" in line
    assert "is Redis running there?" in one_line_failure(joblock_command("web", url=down_url), 3)
    result = joblock_command("web", "--help")
    assert result.returncode == 0
    for words in ("--allow-release", "--page-size", "127.0.0.1", "SCAN", "joblock[web]"):
        assert words in result.stdout


# -- in a real browser -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless chromium from Debian, driven by its chromedriver (.ci/run installs both)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        assert os.path.exists(path), f"{path} is missing: apt-get install chromium chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


# The rows and the status line, read in one script: a refresh cannot redraw the page halfway.
_READ = """
const rows = [...document.querySelectorAll("tr.holder")];
const cells = (row) => [...row.cells].map((cell) => cell.innerText);
return [document.getElementById("status").textContent, rows.map((row) => [row.dataset.key, cells(row)])];
"""


def read(driver: Any) -> tuple[str, dict[str, list[list[str]]]]:
    """The status line, and the table rows the page shows by key: each row's cells as text."""
    status, rows = driver.execute_script(_READ)
    found: dict[str, list[list[str]]] = {}
    for key, cells in rows:
        found.setdefault(key, []).append(cells)
    return status, found


def shown(driver: Any) -> dict[str, list[list[str]]]:
    return read(driver)[1]


def wait_for(driver: Any, condition: Callable[[Any], Any], what: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, 20, poll_frequency=0.1).until(condition, what)


def _at(status: str, start: str, matching: str) -> bool:
    return status.startswith(start) and matching in status


def every_page(driver: Any, matching: str) -> list[list[str]]:
    """The keys of each page, following "Next page" to the end of the scan."""
    pages: list[list[str]] = []
    while True:
        start = f"page {len(pages) + 1}: "
        wait_for(driver, lambda d, start=start: _at(read(d)[0], start, f"matching {matching};"), start)
        pages.append(list(shown(driver)))
        following = driver.find_element("id", "next")
        if not following.is_enabled():
            return pages
        following.click()


def test_the_page_shows_the_locks_and_a_new_one_without_reloading(
    browser, web_command, quiet_server, quiet_raw
):
    locks = joblock.Locks(quiet_server.url, prefix="browsed")
    fenced = locks.acquire(locks.key("ProductSalesJob", 42), 30, fence=True)
    plain = locks.acquire(locks.key("CleanupDataJob"), 60)
    places = [locks.acquire(locks.key("ExportJob", 7), 30, limit=3) for _ in range(2)]
    readers = [locks.acquire(locks.key("Catalog"), 30, shared=True) for _ in range(2)]
    waiter = Waiter(joblock.Locks(quiet_server.url, prefix="browsed"), plain.key, wait=20)
    waiter.start()
    until_queued(quiet_raw, plain.key, 1)
    later = None
    try:
        command = web_command(quiet_server.url, "--prefix", "browsed")
        browser.get(command.base + "/")
        wait_for(browser, lambda _: len(shown(browser)) == 4, "the four locks shown")
        rows = shown(browser)
        headings = [h.text.split()[0] for h in browser.find_elements("css selector", "section.job h2")]
        assert headings == ["Catalog", "CleanupDataJob", "ExportJob", "ProductSalesJob"]
        [[key, kind, holder, ttl, fence, waiting]] = rows[fenced.key]
        assert (key, kind, holder, fence, waiting) == (fenced.key, "lock", HOLDER, "1", "-")
        assert re.fullmatch(r"(2\d|30)\.\d s", ttl)
        [[_, _, _, _, _, waiting]] = rows[plain.key]
        assert re.fullmatch(rf"{re.escape(HOLDER)} \(writer, waits \d+\.\d s more\)", waiting)
        export = rows[places[0].key]
        assert export[0][1] == "[limit 3] 2 of 3 places" and len(export) == 2
        assert rows[readers[0].key][0][1] == "[reader] 2 readers"
        assert browser.find_elements("css selector", "button.release") == []
        source = browser.page_source
        for lease in (fenced, plain, *places, *readers):
            assert lease.token[:32].decode() not in source

        later = locks.acquire(locks.key("LateJob", 1), 30)  # no reload: the page's refresh finds it
        wait_for(browser, lambda _: later.key in shown(browser), "the new lock shown")
    finally:
        assert plain.release() is True
        assert waiter.result().release() is True
        locks.release_many([fenced, *places, *readers, later])
        locks.close()


def test_the_filter_and_the_pages_in_the_browser(browser, web_command, quiet_server):
    locks = joblock.Locks(quiet_server.url, prefix="paged")
    leases = locks.acquire_many([locks.key(job, i) for job in ("Sales", "Cleanup") for i in range(4)], 60)
    try:
        command = web_command(quiet_server.url, "--prefix", "paged", "--page-size", "3")
        browser.get(command.base + "/")
        pages = every_page(browser, "paged:*")
        assert len(pages) >= 3 and all(len(keys) <= 3 for keys in pages)
        seen = [key for keys in pages for key in keys]
        assert sorted(set(seen)) == sorted(lease.key for lease in leases)

        box = browser.find_element("id", "filter")
        box.clear()
        box.send_keys("Sales:*")
        browser.find_element("css selector", "#filter-form button[type=submit]").click()
        filtered = every_page(browser, "paged:Sales:*")
        assert sorted(key for keys in filtered for key in keys) == sorted(
            locks.key("Sales", i) for i in range(4)
        )
    finally:
        locks.release_many(leases)
        locks.close()


class _Elsewhere(http.server.BaseHTTPRequestHandler):
    """Another site's page (another origin: another port)."""

    def do_GET(self) -> None:
        body = b"<!doctype html><title>elsewhere</title><p>another site</p>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


FORGE = """
const [url, body, secret, done] = arguments;
const attempts = [
  // a "simple" request, which a browser sends across sites without asking first
  fetch(url, {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body}),
  // the page's own request, made from elsewhere, even knowing the secret: the browser asks
  // first (a preflight), and the server does not allow it
  fetch(url, {method: "POST", headers: {"Content-Type": "application/json", "X-Joblock-CSRF": secret}, body}),
];
Promise.allSettled(attempts).then((results) => done(results.map((r) => r.status)));
"""


def test_releasing_in_the_browser_and_a_forgery_from_another_site(
    browser, web_command, quiet_server, quiet_raw
):
    from selenium.webdriver.support import expected_conditions

    locks = joblock.Locks(quiet_server.url, prefix="released")
    kept = locks.acquire(locks.key("Kept", 1), 60)
    freed = locks.acquire(locks.key("Freed", 1), 60)
    elsewhere = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Elsewhere)
    threading.Thread(target=elsewhere.serve_forever, daemon=True).start()
    try:
        command = web_command(quiet_server.url, "--prefix", "released", "--allow-release")
        browser.get(command.base + "/")
        wait_for(browser, lambda _: len(shown(browser)) == 2, "both locks shown")
        secret = browser.find_element("css selector", 'meta[name="joblock-csrf"]').get_attribute("content")
        page = json.loads(urllib.request.urlopen(command.base + "/api/locks", timeout=30).read())
        target = next(h for h in holders(page) if h["key"] == kept.key)

        # Another site's page tries with everything it could know (even the secret).
        browser.get(f"http://localhost:{elsewhere.server_address[1]}/")
        body = json.dumps({"key": target["ref"], "id": target["id"]})
        browser.set_script_timeout(30)
        outcomes = browser.execute_async_script(FORGE, command.base + "/api/release", body, secret)
        assert outcomes == ["fulfilled", "rejected"]  # an opaque answer to the first; the second never sent
        assert quiet_raw.get(kept.key) == kept.token

        browser.get(command.base + "/")
        wait_for(browser, lambda _: len(shown(browser)) == 2, "both locks shown")
        rows = browser.find_elements("css selector", "tr.holder")
        row = next(r for r in rows if r.get_attribute("data-key") == freed.key)
        row.find_element("css selector", "button.release").click()
        wait_for(browser, expected_conditions.alert_is_present(), "the confirmation")
        browser.switch_to.alert.accept()
        wait_for(browser, lambda _: quiet_raw.exists(freed.key) == 0, "the lock released in Redis")
        wait_for(browser, lambda _: freed.key not in shown(browser), "the row gone")
        assert browser.find_element("id", "message").text == f"released {freed.key} (held by {HOLDER})"
        assert freed.release() is False
        assert quiet_raw.get(kept.key) == kept.token
        assert kept.release() is True
        assert "Traceback" not in command.close()
    finally:
        elsewhere.shutdown()
        locks.close()
