"""The ``joblock`` command, run for real: ``python -m joblock`` in a subprocess.

``demo`` runs against the session's server through ``$REDIS_URL`` and once without
it (starting its own throwaway server); ``inspect`` and ``release`` look at locks this
test process holds. The command runs on the compiled core where it is built and on
the pure twin (``JOBLOCK_NO_EXTENSIONS=1``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import uuid

import pytest

import joblock
from joblock.compat import RedisLock

SRC = os.path.dirname(os.path.dirname(joblock.__file__))


def joblock_command(*args, url=None, pure=False, timeout=120):
    """Runs ``python -m joblock ARGS``; ``url`` becomes $REDIS_URL (None: unset)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    env.pop("REDIS_URL", None)
    env.pop("JOBLOCK_NO_EXTENSIONS", None)
    if url is not None:
        env["REDIS_URL"] = url
    if pure:
        env["JOBLOCK_NO_EXTENSIONS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "joblock", *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(SRC),
    )


@pytest.fixture(params=[False, True], ids=["active-core", "pure-core"])
def pure(request):
    return request.param


@pytest.fixture
def prefix():
    return f"cli{uuid.uuid4().hex[:8]}"


@pytest.fixture
def locks(redis_server, prefix):
    locks = joblock.Locks(redis_server.url, prefix=prefix)
    yield locks
    locks.close()


HOLDER = f"{socket.gethostname()} pid {os.getpid()}"


def rows(stdout):
    """The lines of ``inspect`` after its header, before its count."""
    lines = stdout.strip().splitlines()
    assert lines[0].split() == ["KEY", "HOLDER", "TTL", "FENCE"]
    return lines[1:-1]


# -- help and demo -------------------------------------------------------------------------


def test_help():
    result = joblock_command("--help")
    assert result.returncode == 0, result.stderr
    for word in ("demo", "bench", "inspect", "release", "--prefix", "--url"):
        assert word in result.stdout


def test_unknown_command_is_refused():
    result = joblock_command("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def check_demo_report(result):
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "CleanupDataJob" in out and "ProductSalesJob" in out
    assert "most running at once: 1" in out
    assert "most runs of one product at once: 1" in out
    dedupe = re.search(r"dispatched ([\d,]+), dropped ([\d,]+) duplicates", out)
    assert dedupe is not None, out
    dispatched, dropped = (int(n.replace(",", "")) for n in dedupe.groups())
    assert dispatched + dropped == 200_000
    distinct = re.search(r"200,000 submissions of ReportJob \(([\d,]+) distinct\)", out)
    assert distinct is not None and int(distinct.group(1).replace(",", "")) == dispatched
    assert f"released {dispatched:,} locks" in out
    assert "200,000/200,000" in result.stderr  # the progress bar
    assert "Traceback" not in result.stderr
    assert len(out.splitlines()) < 30  # a short report


def test_demo_against_redis_url(redis_server, raw):
    result = joblock_command("demo", url=redis_server.url)
    check_demo_report(result)
    assert f"127.0.0.1:{redis_server.port}" in result.stdout
    assert "throwaway" not in result.stderr
    assert list(raw.scan_iter(match="joblock-demo-*")) == []  # it cleaned up after itself


def test_demo_starts_a_throwaway_server_without_redis_url():
    result = joblock_command("demo", pure=True)
    check_demo_report(result)
    started = re.search(r"started a throwaway redis-server at redis://127\.0\.0\.1:(\d+)/0", result.stderr)
    assert started is not None, result.stderr
    assert f"127.0.0.1:{started.group(1)}" in result.stdout
    assert "(core: python)" in result.stdout
    with pytest.raises(OSError):  # and stopped it
        socket.create_connection(("127.0.0.1", int(started.group(1))), timeout=1).close()


# -- bench -----------------------------------------------------------------------------------


def test_bench_only_asyncio_runs_its_groups_as_json(redis_server, raw):
    result = joblock_command(
        "bench", "--only", "asyncio", "--quick", "--repeat", "1", "--no-memory", "--json",
        "--contenders", "joblock-c", "joblock-py", "redis-py-asyncio-pipeline",
        url=redis_server.url,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    groups = json.loads(result.stdout)["groups"]
    assert list(groups) == ["aio_single", "aio_acquire", "aio_tasks16", "aio_tasks128", "aio_tasks512"]
    # The command runs without JOBLOCK_NO_EXTENSIONS: the compiled core runs where built.
    compiled = importlib.util.find_spec("joblock._core_c") is not None
    chosen = {"joblock-c": compiled, "joblock-py": True, "redis-py-asyncio-pipeline": True}
    for group in groups.values():
        ran = {c: row["ops_per_s"] is not None for c, row in group["results"].items()}
        assert ran == {c: chosen.get(c, False) for c in ran}
        assert {"joblock-c", "joblock-py"} <= set(ran)
    assert groups["aio_acquire"]["results"]["redis-py-asyncio-pipeline"]["ops_per_s"] is not None
    assert list(raw.scan_iter(match="joblock:bench:*")) == []  # it cleaned up after itself


# -- inspect ---------------------------------------------------------------------------------


def test_inspect_lists_held_locks_with_holder_ttl_and_fence(locks, raw, redis_server, prefix, pure):
    fenced = locks.acquire(locks.key("ProductSalesJob", 42), 30, fence=True)
    plain = locks.acquire(locks.key("CleanupDataJob"), 60)
    assert fenced.fence == 1
    raw.set(f"{prefix}:not-a-lock", "hello")  # a plain string under the prefix
    raw.set(f"{prefix}:lookalike", "0123456789abcdef@host:12")  # not a token
    raw.rpush(f"{prefix}:queue", "job")
    assert raw.exists(f"{{{fenced.key}}}:fence") == 1  # the fence counter
    result = joblock_command("--prefix", prefix, "inspect", url=redis_server.url, pure=pure)
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0]: line for line in rows(result.stdout)}
    assert set(listed) == {fenced.key, plain.key}
    product = listed[fenced.key]
    assert HOLDER in product
    ttl = float(re.search(r"([\d.]+)s\s+1$", product).group(1))
    assert 25 < ttl <= 30
    cleanup = listed[plain.key]
    assert HOLDER in cleanup
    assert re.search(r"\s(5\d|60)\.\ds\s+-$", cleanup), cleanup
    assert result.stdout.strip().endswith("2 locks held")
    assert "fence" not in result.stdout  # the counter is not listed as a lock
    fenced.release()
    plain.release()


def test_inspect_pattern_and_url_option(locks, redis_server, prefix):
    leases = [locks.acquire(locks.key("ProductSalesJob", p), 30) for p in (1, 2)]
    leases.append(locks.acquire(locks.key("CleanupDataJob"), 30))
    result = joblock_command("--url", redis_server.url, "--prefix", prefix, "inspect", "ProductSalesJob:*")
    assert result.returncode == 0, result.stderr
    assert sorted(line.split()[0] for line in rows(result.stdout)) == [
        f"{prefix}:ProductSalesJob:1",
        f"{prefix}:ProductSalesJob:2",
    ]
    assert result.stdout.strip().endswith("2 locks held")
    locks.release_many(leases)


def test_inspect_respects_the_prefix(redis_server, prefix):
    ours = joblock.Locks(redis_server.url, prefix=prefix)
    theirs = joblock.Locks(redis_server.url, prefix=f"{prefix}-other")
    try:
        a = ours.acquire(ours.key("Job", 1), 30)
        b = theirs.acquire(theirs.key("Job", 1), 30)
        for who, lease in ((ours, a), (theirs, b)):
            result = joblock_command("--prefix", who.prefix, "inspect", url=redis_server.url)
            assert result.returncode == 0, result.stderr
            assert [line.split()[0] for line in rows(result.stdout)] == [lease.key]
        empty = joblock_command("--prefix", f"{prefix}-nothing", "inspect", url=redis_server.url)
        assert empty.returncode == 0
        assert empty.stdout.strip().endswith("0 locks held")
        a.release()
        b.release()
    finally:
        ours.close()
        theirs.close()


def test_inspect_pages_through_scan(locks, redis_server, prefix, pure):
    leases = locks.acquire_many([locks.key("Report", i) for i in range(2500)], 60)
    assert all(leases)
    result = joblock_command("--prefix", prefix, "inspect", url=redis_server.url, pure=pure)
    assert result.returncode == 0, result.stderr
    keys = [line.split()[0] for line in rows(result.stdout)]
    assert len(keys) == len(set(keys)) == 2500
    assert result.stdout.strip().endswith("2500 locks held")
    locks.release_many(leases)


def test_inspect_shows_a_lock_without_ttl(redis_server, raw, prefix):
    """compat.RedisLock with timeout=None: held until released; inspect shows it."""
    name = f"{prefix}:forever"
    lock = raw.lock(name, lock_class=RedisLock)
    assert lock.acquire() is True
    result = joblock_command("--prefix", prefix, "inspect", url=redis_server.url)
    assert result.returncode == 0, result.stderr
    [line] = rows(result.stdout)
    assert line.split()[0] == name
    assert HOLDER in line and "no ttl" in line
    released = joblock_command("release", name, url=redis_server.url)
    assert released.returncode == 0, released.stdout
    assert released.stdout.strip() == f"released {name} (held by {HOLDER}, no ttl)"
    assert raw.exists(name) == 0


# -- release ---------------------------------------------------------------------------------


def test_release_removes_a_lock_and_says_what_it_removed(locks, raw, redis_server, pure):
    lease = locks.acquire(locks.key("ProductSalesJob", 7), 30, fence=True)
    result = joblock_command("release", lease.key, url=redis_server.url, pure=pure)
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    expected = rf"released {re.escape(lease.key)} \(held by {re.escape(HOLDER)}, (\d+\.\d) s left, fence 1\)"
    assert re.fullmatch(expected, message), message
    assert 25 < float(re.search(r"(\d+\.\d) s left", message).group(1)) <= 30
    assert raw.exists(lease.key) == 0
    assert lease.release() is False  # the holder learns it lost the lock
    again = locks.acquire(lease.key, 30, fence=True)
    assert again.fence == 2  # the counter survived the forced release
    again.release()


def test_release_of_a_missing_key_says_so(locks, redis_server, pure):
    key = locks.key("Nothing", 1)
    result = joblock_command("release", key, url=redis_server.url, pure=pure)
    assert result.returncode == 1
    assert result.stdout.strip() == f"no lock at {key}"


def test_release_leaves_keys_that_are_not_locks(raw, redis_server, prefix):
    raw.set(f"{prefix}:plain", "hello")
    raw.rpush(f"{prefix}:queue", "job")
    for key in (f"{prefix}:plain", f"{prefix}:queue"):
        result = joblock_command("release", key, url=redis_server.url)
        assert result.returncode == 1
        assert result.stdout.strip() == f"no lock at {key}"
    assert raw.get(f"{prefix}:plain") == b"hello"
    assert raw.lrange(f"{prefix}:queue", 0, -1) == [b"job"]


def test_release_of_a_lock_held_by_another_process(redis_server, raw, prefix):
    """The holder column names the other process, and release frees its lock."""
    script = (
        "import sys, joblock\n"
        f"locks = joblock.Locks({redis_server.url!r}, prefix={prefix!r})\n"
        "lease = locks.acquire(locks.key('Nightly'), 60)\n"
        "print(lease.key, flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = dict(os.environ, PYTHONPATH=SRC)
    holder = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        key = holder.stdout.readline().strip()
        assert key == f"{prefix}:Nightly"
        listing = joblock_command("--prefix", prefix, "inspect", url=redis_server.url)
        assert f"pid {holder.pid}" in listing.stdout
        result = joblock_command("release", key, url=redis_server.url)
        assert result.returncode == 0
        assert f"pid {holder.pid}" in result.stdout
        assert raw.exists(key) == 0
    finally:
        holder.stdin.close()
        holder.wait(10)
