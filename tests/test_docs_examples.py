"""Every ```python block of README.md and docs/**/*.md runs, against real Redis servers.

The rules, which are all a page's author needs to know:

1. A page is one script. Its python blocks run in order, in one namespace, in a fresh
   interpreter of their own (a subprocess per page), after every server was emptied.
   A later block may use what an earlier one defined. A failure shows the page's own
   file and line.
2. Addresses. ``127.0.0.1:6379`` in a block is the suite's redis-server (databases
   kept); ``redis://a:6379``, ``redis://b:6379`` and ``redis://c:6379`` are three
   more servers (Redlock); ``10.0.0.5:7000`` and ``10.0.0.6:7000`` are two nodes of
   a local Redis Cluster. Any other address appears only where a client is built
   and not used (building a client does not connect).
3. A block whose first line is ``# name.py`` is that module: it runs as module
   ``name``, so later blocks ``import name`` (as a worker would).
4. A block of ``>>>`` lines is a doctest (``...`` matches anything), run in the
   page's namespace. Top-level ``await`` runs on the page's event loop.
5. A block after the HTML comment ``<!-- docs-test: no-run -->`` (on the line before
   the fence) needs a process the test does not start, such as a Celery or RQ
   worker: it is compiled and its imports are made, not run.
6. Names the prose leaves to the reader ("your queue", "your keys", "your job's
   work") are given: see ``_given`` below. A page that defines one itself uses its own.
"""

from __future__ import annotations

import ast
import asyncio
import doctest
import json
import os
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from joblock._tools.servers import LocalCluster, RedisServer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NO_RUN = "<!-- docs-test: no-run -->"
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MODULE = re.compile(r"# (\w+)\.py[ \t]*\n")
_REDLOCK = ("redis://a:6379", "redis://b:6379", "redis://c:6379")
_CLUSTER = ("10.0.0.5:7000", "10.0.0.6:7000")


@dataclass
class Block:
    line: int  # of the block's first line of code, in the page
    code: str
    run: bool


def blocks(text: str) -> list[Block]:
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, match.start(1)) + 1
        code = match.group(1)
        runnable = before != NO_RUN
        found.append(Block(line, code, run=runnable))
    return found


def pages() -> list[Path]:
    """README.md and the documentation pages that have python blocks."""
    candidates = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    return [page for page in candidates if page.is_file() and blocks(page.read_text())]


# -- the test (parent process) ----------------------------------------------------------


@pytest.fixture(scope="module")
def redlock_servers() -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    try:
        for _ in _REDLOCK:
            started.append(RedisServer().start())
        yield started
    finally:
        for server in started:
            server.close()


@pytest.fixture(scope="module")
def small_cluster() -> Iterator[LocalCluster]:
    # No replicas: the examples need a cluster's routing, not its failover.
    with LocalCluster(primaries=3, replicas=0) as started:
        yield started


def _flush(ports: list[int]) -> None:
    import redis

    for port in ports:
        with redis.Redis(port=port) as client:
            client.flushall()


def _run(page: Path, addresses: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Runs the page in an interpreter of its own, as the runner below."""
    return subprocess.run(
        [sys.executable, __file__, str(page)],
        env={**os.environ, "JOBLOCK_DOCS_ADDRESSES": json.dumps(addresses)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_pages_are_found() -> None:
    found = pages()
    # Where the suite runs from a copy of tests/ (cibuildwheel's test-sources), the
    # pages must be copied along.
    assert README in found, f"{README} is missing"
    assert {ROOT / "docs" / "tour.md", ROOT / "docs" / "frameworks" / "celery.md"} <= set(found)


@pytest.mark.parametrize(
    "page", pages(), ids=lambda p: str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
)
def test_examples_run(page: Path, redis_server: RedisServer, request: pytest.FixtureRequest) -> None:
    text = page.read_text()
    addresses = {"127.0.0.1:6379": f"127.0.0.1:{redis_server.port}"}
    ports = [redis_server.port]
    if any(a in text for a in _REDLOCK):
        servers = request.getfixturevalue("redlock_servers")
        addresses.update({a: f"redis://127.0.0.1:{s.port}" for a, s in zip(_REDLOCK, servers)})
        ports += [s.port for s in servers]
    if any(a in text for a in _CLUSTER):
        cluster = request.getfixturevalue("small_cluster")
        addresses.update({a: f"127.0.0.1:{n.port}" for a, n in zip(_CLUSTER, cluster.nodes)})
        ports += [n.port for n in cluster.nodes]
    _flush(ports)
    done = _run(page, addresses)
    assert done.returncode == 0, f"{page}: an example failed\n{done.stdout}\n{done.stderr}"


def test_a_broken_example_fails(tmp_path: Path, redis_server: RedisServer) -> None:
    """A wrong doctest output and an exception fail the page, at the page's line."""
    page = tmp_path / "broken.md"
    page.write_text(
        "# A page\n\n```python\nimport joblock\n\nlocks = joblock.Locks('redis://127.0.0.1:6379/0')\n```\n\n"
        "```python\n>>> locks.key('J', 1)\n'joblock:J:2'\n```\n\n"
        "```python\nlocks.acquire(locks.key('J'), ttl=-1)\n```\n"
    )
    done = _run(page, {"127.0.0.1:6379": f"127.0.0.1:{redis_server.port}"})
    assert done.returncode == 1
    assert "'joblock:J:1'" in done.stdout  # what the doctest got instead
    assert f'File "{page}", line 15' in done.stderr  # the ValueError, at its line in the page
    assert "ValueError: ttl" in done.stderr


def test_a_no_run_block_is_compiled_and_its_imports_made(tmp_path: Path) -> None:
    page = tmp_path / "worker.md"
    page.write_text(
        f"{NO_RUN}\n```python\nimport joblock\nraise RuntimeError('ran')\n```\n\n"
        f"{NO_RUN}\n```python\nimport joblock.no_such_module\n```\n"
    )
    done = _run(page, {})
    assert done.returncode == 1
    assert "ran" not in done.stderr
    assert "ModuleNotFoundError: No module named 'joblock.no_such_module'" in done.stderr


# -- the runner (the page's own interpreter) --------------------------------------------


class GivenQueue:
    """The reader's job queue, for examples that hand it what they locked."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def enqueue(self, job: Any, *args: Any, **kwargs: Any) -> None:
        self.sent.append((job, args, kwargs))


def _given(addresses: dict[str, str]) -> dict[str, Any]:
    """The names of rule 6: stand-ins for the reader's own code and data."""
    import logging

    import redis

    def work(*args: Any, **kwargs: Any) -> None:
        """Whatever the job does."""

    async def async_work(*args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(0)

    async_names = ("cleanup",)
    work_names = ("cleanup_data", "fetch_product_sales", "build_report", "write_report")
    return {
        **dict.fromkeys(work_names, work),
        **dict.fromkeys(async_names, async_work),
        "incoming": [7, 8, 7, 9, 8],  # product ids as they arrive, with duplicates
        "submissions": [(7,), (8,), (7,)],
        "keys": [f"joblock:ProductSalesJob:{i}" for i in range(10)],
        "key": "joblock:ReportJob:daily",
        "queue": GivenQueue(),
        "log": logging.getLogger("docs"),
        "redis_client": redis.Redis.from_url(_rewrite("redis://127.0.0.1:6379/0", addresses)),
    }


def _rewrite(code: str, addresses: dict[str, str]) -> str:
    for shown, real in addresses.items():
        code = code.replace(shown, real)
    return code


def _padded(block: Block, code: str) -> str:
    """The code preceded by blank lines, so that line numbers are the page's."""
    return "\n" * (block.line - 1) + code


def _run_block(
    block: Block,
    page: str,
    namespace: dict[str, Any],
    loop: asyncio.AbstractEventLoop,
    addresses: dict[str, str],
) -> bool:
    code = _rewrite(block.code, addresses)
    if code.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(code, namespace, page, page, block.line - 1)
        test.globs = namespace  # DocTest copies them; the page's later blocks see what it defines
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        if block.run:
            return runner.run(test, clear_globs=False).failed == 0
        code = "\n".join(example.source for example in test.examples)
    module = _MODULE.match(code)
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    compiled = compile(_padded(block, code), page, "exec", flags=flags, dont_inherit=True)
    if not block.run:
        _import_only(ast.parse(code), namespace)
        return True
    if module is not None:
        target = types.ModuleType(module.group(1))
        target.__file__ = page
        sys.modules[target.__name__] = target
        namespace = target.__dict__
    result = eval(compiled, namespace)  # exec, or a coroutine when the block awaits at top level
    if asyncio.iscoroutine(result):
        loop.run_until_complete(result)
    return True


def _import_only(tree: ast.Module, namespace: dict[str, Any]) -> None:
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports, type_ignores=[]), "<imports>", "exec"), namespace)


def run_page(page: str) -> int:
    addresses = json.loads(os.environ["JOBLOCK_DOCS_ADDRESSES"])
    namespace: dict[str, Any] = {"__name__": "__main__", **_given(addresses)}
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    ok = True
    path = Path(page)
    for block in blocks(path.read_text()):
        if not _run_block(block, page, namespace, loop, addresses):
            ok = False
    loop.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_page(sys.argv[1]))
