"""Fixtures: real redis-server processes, and every API test on each core twin.

``core`` runs a test once per twin: the compiled core ("c", where it is built and
not disabled by JOBLOCK_NO_EXTENSIONS), the pure core ("python") and the pure core
with hiredis absent ("python-nohiredis", its own RESP parser).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

import joblock
from joblock import _core_py
from joblock._core import compiled
from joblock._tools.servers import LocalCluster, RedisServer
from joblock.locks import Locks


def _worker_ports() -> str:
    """This process's share of the suite's loopback ports (cluster bus ports +10000):
    ``$JOBLOCK_PORTS`` when the caller sets it (.ci/run gives runs at once ranges apart),
    else 10000-19999. pytest-xdist's workers start servers at once, and a share of its own
    keeps each one off the ports another has just let go of or is about to bind
    (joblock._tools.servers)."""
    first, _, last = os.environ.get("JOBLOCK_PORTS", "10000-19999").partition("-")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    share = (int(last) + 1 - int(first)) // max(workers, 1)
    start = int(first) + worker * share
    return f"{start}-{start + share - 1}"


# Set before any fixture starts a server; the child processes of tests inherit it.
os.environ["JOBLOCK_PORTS"] = _worker_ports()


def _load_without_hiredis() -> ModuleType:
    saved = sys.modules.get("hiredis")
    sys.modules["hiredis"] = None  # type: ignore[assignment]  # makes `import hiredis` fail
    try:
        spec = importlib.util.spec_from_file_location("joblock._core_py_nohiredis", _core_py.__file__)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        module.__package__ = "joblock"
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["hiredis"]
        else:
            sys.modules["hiredis"] = saved
    assert module.Reader is module.PyReader
    return module


TWINS: dict[str, ModuleType] = {"python": _core_py, "python-nohiredis": _load_without_hiredis()}
if (_c := compiled()) is not None:
    TWINS = {"c": _c, **TWINS}


def _api_twins() -> list[str]:
    """The twins each API test runs on: all of them, or those ``$JOBLOCK_TWINS`` names.

    CI's runs after the README's command name some, so they do not run again what it ran:
    the pure build's run (the pure hot path) needs the "python" twin only, as every twin's
    core already ran under the README's command; the Valkey run takes "c" and "python".
    Tests of the twins themselves (the parsers, the differential tests) use ``TWINS``."""
    chosen = os.environ.get("JOBLOCK_TWINS", "")
    if not chosen:
        return list(TWINS)
    names = [name.strip() for name in chosen.split(",")]
    unknown = [name for name in names if name not in TWINS]
    if unknown:
        raise pytest.UsageError(f"JOBLOCK_TWINS names {unknown}: the twins here are {list(TWINS)}")
    return names


API_TWINS = _api_twins()


@pytest.fixture(params=API_TWINS)
def core(request: pytest.FixtureRequest) -> ModuleType:
    return TWINS[request.param]


def locks_class(core: ModuleType) -> type[Locks]:
    """Locks bound to one twin of the core."""
    return type("Locks", (Locks,), {"_core": core})


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


_prefixes = itertools.count()


@pytest.fixture
def make_locks(core: ModuleType, redis_server: RedisServer) -> Iterator[Callable[..., Locks]]:
    """Builds Locks on the test's twin; each test gets its own key prefix."""
    made: list[Locks] = []
    prefix = f"t{next(_prefixes)}"

    def make(url: str | None = None, **kwargs: Any) -> Locks:
        kwargs.setdefault("prefix", prefix)
        locks = locks_class(core)(url or redis_server.url, **kwargs)
        made.append(locks)
        return locks

    yield make
    for locks in made:
        locks.close()


@pytest.fixture
def locks(make_locks: Callable[..., Locks]) -> Locks:
    return make_locks()


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[Any]:
    """A redis-py client on the suite's server, to look at what joblock wrote."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """A real local Redis Cluster: 3 primaries, each with a replica."""
    with LocalCluster(primaries=3, replicas=1) as started:
        yield started


@pytest.fixture(scope="session")
def cluster_raw(cluster: LocalCluster) -> Iterator[Any]:
    """redis-py's RedisCluster on the suite's cluster, to look at what joblock wrote."""
    from redis.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    yield client
    client.close()


@pytest.fixture(scope="session")
def one_key_per_slot() -> list[str]:
    """16384 keys, the i-th one in hash slot i."""
    found: dict[int, str] = {}
    for i in itertools.count():
        key = f"s{i}"
        found.setdefault(_core_py.key_slot(key.encode()), key)
        if len(found) == 16384:
            return [found[slot] for slot in range(16384)]
    raise AssertionError


@pytest.fixture(scope="session")
def servers() -> Iterator[list[RedisServer]]:
    """Five independent redis-servers, for Redlock."""
    started: list[RedisServer] = []
    try:
        for _ in range(5):
            started.append(RedisServer().start())
        yield started
    finally:
        for server in started:
            server.close()


@pytest.fixture(scope="session")
def down_url() -> Iterator[str]:
    """The URL of a server that was started and stopped: its port refuses connections."""
    server = RedisServer().start()
    server.stop()
    yield server.url
    server.close()


@pytest.fixture
def lease_type(core: ModuleType) -> type:
    return core.Lease  # type: ignore[no-any-return]


def pytest_report_header() -> str:
    twins = ", ".join(API_TWINS)
    return f"joblock {joblock.__version__}: active core {joblock.implementation}; twins tested: {twins}"


def _xdist_workers() -> int:
    """Four workers per CPU this process may run on: the suite waits (servers starting, ttls
    running out, workers, failovers) more than it computes. On a quiet 2-core machine the
    README's command took 6 min 34 s with 4 workers, 4 min 27 s with 6 and 3 min 29 s to
    4 min 57 s with 8 (where the CPUs were busy 55%, 77% and 74-92% of the time); with
    worksteal (below), 3 min 12 s to 3 min 38 s."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 4 * cpus


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """``python -m pytest`` runs in parallel when pytest-xdist is installed (the ``test``
    extra brings it) and no ``-n`` was given: ``-n 0`` or ``-p no:xdist`` runs it in this
    process. Here rather than in pyproject.toml's addopts, which would break the pytest runs
    without xdist (the benchmarks, whose timings xdist turns off, and scripts/ venvs)."""
    if not config.pluginmanager.hasplugin("xdist") or config.option.numprocesses is not None:
        return
    if hasattr(config, "workerinput"):  # a worker: its numprocesses is None, and must stay so
        return
    if config.option.collectonly or config.option.usepdb:
        return
    # Each worker starts on a contiguous share of the tests, in the order collected (below),
    # and one that runs out takes half of what another has left (xdist's "worksteal"):
    # with "load", the tests queued behind a long one (a page whose RQ worker took 60 s
    # to exit) waited for it, and the run ended on that worker, 30-60 s after the others.
    # No test is grouped: with pytest 9.2 a worker's group names no longer reach the
    # scheduler (pytest-dev/pytest-xdist#1386), so "loadgroup" would only say it does.
    config.option.numprocesses = _xdist_workers()
    if config.option.dist == "no":
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """test_exclusion's stress runs first. They take turns (its ``one_at_a_time``), a
    minute in all, so they start on the first worker's share at once, beside the others'
    waits; collected in place, they were left for last and were the run's last minute."""
    items.sort(key=lambda item: item.path.name != "test_exclusion.py")  # stable: the rest keep their order
