"""docs/frameworks/arq-taskiq.md's examples, run against real arq and taskiq workers.

The page's blocks are fenced ```py, not ```python: tests/test_docs_examples.py runs the
```python blocks in the main venv, which cannot import arq or taskiq (redis-py 8). Here
the page runs under that test's own runner and rules (``python tests/test_docs_examples.py
<page>``), its blocks read as ```python, in this venv. Its module blocks (``# name.py``)
are also written out as files for the workers, which import them as a user's would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import redis
from legacy import legacy_env

from conftest import TWINS
from joblock._tools.servers import RedisServer
from workers import TESTS, Worker, python, wait_for

PAGE = Path(TESTS).parent / "docs" / "frameworks" / "arq-taskiq.md"
RUNNER = os.path.join(TESTS, "test_docs_examples.py")
_PY_FENCE = re.compile(r"^```py[ \t]*$", re.MULTILINE)
_MODULE = re.compile(r"^```py[ \t]*\n# (\w+)\.py\b.*?\n(.*?)^```", re.MULTILINE | re.DOTALL)


def test_the_page_runs_with_real_workers(redis_server: RedisServer, tmp_path: Path) -> None:
    text = PAGE.read_text()
    shown = "127.0.0.1:6379"
    real = f"127.0.0.1:{redis_server.port}"
    modules = {name: body for name, body in _MODULE.findall(text)}
    assert {"shop_arq", "search_arq", "shop_taskiq", "export_taskiq"} <= set(modules)
    for name, body in modules.items():
        (tmp_path / f"{name}.py").write_text(body.replace(shown, real))
    page = tmp_path / PAGE.name
    page.write_text(_PY_FENCE.sub("```python", text))

    twin = "python" if os.environ.get("JOBLOCK_NO_EXTENSIONS") or "c" not in TWINS else "c"
    env = legacy_env(twin, redis_server.url)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    commands = {
        "arq-shop": [python(), "-m", "arq", "shop_arq.WorkerSettings"],
        "arq-search": [python(), "-m", "arq", "search_arq.WorkerSettings"],
        "taskiq": [
            python(),
            "-m",
            "taskiq",
            "worker",
            "shop_taskiq:broker",
            "export_taskiq",
            "--workers",
            "1",
        ],
    }
    workers = {name: Worker(command, env, tmp_path / f"{name}.log") for name, command in commands.items()}
    try:
        for name, worker in workers.items():
            started = "Listening started" if name == "taskiq" else "Starting worker"
            wait_for(lambda w=worker, s=started: s in w.log() or not w.alive(), 60, f"the {name} worker")
            assert worker.alive(), worker.report()
        done = subprocess.run(
            [python(), RUNNER, str(page)],
            env={**env, "JOBLOCK_DOCS_ADDRESSES": json.dumps({shown: real})},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        logs = "\n".join(f"-- {name}\n{w.log()[-3000:]}" for name, w in workers.items())
        assert done.returncode == 0, f"{PAGE}: an example failed\n{done.stdout}\n{done.stderr}\n{logs}"
    finally:
        for worker in workers.values():
            worker.stop()
        base = redis_server.url.rsplit("/", 1)[0]
        for db in range(4):
            redis.Redis.from_url(f"{base}/{db}").flushdb()
