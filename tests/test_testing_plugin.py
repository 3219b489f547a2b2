"""``joblock.testing``: the pytest plugin's fixtures, its helpers, and the examples of
docs/testing.md.

The helpers are tested here on each core twin against the session's real redis-server.
The fixtures and the page's examples are tested as users get them: a pytest of their
own (pytester, in a subprocess, once per twin that a subprocess can choose) that loads
the plugin through its entry point, with no conftest of joblock's.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import joblock
import joblock.testing
from conftest import TWINS
from helpers import name, stored
from joblock import ClusterLocks, LockNotAcquired, Redlock, current_lease
from joblock._engine.waits import LOST_CHANNEL, queue_key
from joblock.aio import AsyncLocks
from joblock.testing import expire, hold, take_over

pytest_plugins = ["pytester"]

PAGE = Path(__file__).resolve().parent.parent / "docs" / "testing.md"
TTL = 30


_prefixes = itertools.count()


def async_locks(core: ModuleType, url: str) -> AsyncLocks:
    """An AsyncLocks on the test's twin, under a prefix of its own."""
    return type("AsyncLocks", (AsyncLocks,), {"_core": core})(url, prefix=f"tt{next(_prefixes)}")


def until(done: Callable[[], object], timeout: float = 30.0) -> None:
    """Waits for ``done()`` (another thread's progress), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the other thread did not get there"
        time.sleep(0.001)


def queued(raw: Any, key: str) -> Callable[[], bool]:
    """Whether a waiter has queued for the lock at ``key``."""
    return lambda: raw.lindex(queue_key(key.encode()), 0) is not None


# -- hold -------------------------------------------------------------------------------


def test_hold_gives_the_lock_to_another_holder(locks, raw, lease_type):
    key = name(locks, "report")
    theirs = hold(locks, key)
    assert type(theirs) is lease_type and theirs.held
    assert theirs._owner is not locks  # another client: another holder, as another process
    assert raw.get(key) == theirs.token
    assert TTL * 1000 < raw.pttl(key) <= 60_000  # the default ttl, 60 s
    assert locks.acquire(key, TTL) is None
    assert theirs.release() is True
    assert locks.acquire(key, TTL) is not None


def test_hold_takes_a_place_of_a_counting_lock_a_fenced_lock_or_a_readers_lock(locks, raw):
    counted = name(locks, "export")
    places = [hold(locks, counted, TTL, limit=2) for _ in range(2)]
    assert locks.acquire(counted, TTL, limit=2) is None
    assert raw.zscore(counted, "limit") == -2
    assert all(raw.zscore(counted, lease.token) for lease in places)
    fenced = name(locks, "fenced")
    assert hold(locks, fenced, fence=True).fence >= 1
    read = name(locks, "read")
    reader = hold(locks, read, shared=True)
    assert locks.acquire(read, TTL) is None  # the writer waits for the reader
    assert locks.acquire(read, TTL, shared=True) is not None  # another reader joins
    assert reader.release() is True


def test_hold_raises_when_the_lock_is_not_free(locks):
    key = name(locks, "busy")
    assert locks.acquire(key, TTL) is not None
    with pytest.raises(LockNotAcquired) as caught:
        hold(locks, key)
    assert caught.value.key == key


def test_hold_acts_for_an_asyncio_client_with_its_settings(core, redis_server, raw):
    aio = async_locks(core, redis_server.url)
    key = name(aio, "report")

    async def main() -> Any:
        theirs = hold(aio, key)  # no await: the helpers are plain functions
        assert await aio.acquire(key, TTL) is None
        mine = await aio.acquire(name(aio, "other"), TTL)
        assert await mine.release() is True
        await aio.close()
        return theirs, mine

    theirs, mine = asyncio.run(main())
    assert theirs.release() is True  # a threaded client's lease
    assert type(theirs) is type(mine) is core.Lease
    assert theirs._owner.settings == aio.settings and not theirs._owner.asynchronous
    assert raw.get(key) is None


# -- expire -----------------------------------------------------------------------------


def test_expire_ends_the_lock_as_its_ttl_would(locks, raw):
    key = name(locks, "cleanup")
    theirs = hold(locks, key)
    expire(theirs)
    assert raw.exists(key) == 0
    assert theirs.held  # it does not know yet, as after an expiry
    mine = locks.acquire(key, TTL)
    assert mine is not None
    assert theirs.release() is False and theirs.extend(TTL) is False
    assert raw.get(key) == mine.token  # their release left the new holder's lock alone


def test_expire_tells_the_first_waiter_to_take_the_lock(locks, raw):
    key = name(locks, "queued")
    theirs = hold(locks, key, ttl=600)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(locks.acquire(key, TTL, wait=120)))
    listener = raw.pubsub()
    listener.psubscribe("joblock:wake:*")
    assert listener.get_message(timeout=10)["type"] == "psubscribe"
    try:
        waiter.start()
        until(queued(raw, key))
        expire(theirs)
        message = listener.get_message(timeout=10)
        # "<waiter's number> ?": look again now, as at the lock's expiry
        assert message is not None and message["data"].endswith(b" ?")
        waiter.join(timeout=60)
    finally:
        listener.close()
    assert not waiter.is_alive() and got[0] is not None and got[0].held
    assert raw.get(key) == got[0].token
    assert got[0].release() is True


def test_expire_frees_one_place_of_a_counting_lock(locks, raw):
    key = name(locks, "export")
    places = [hold(locks, key, TTL, limit=3, fence=True) for _ in range(3)]
    assert locks.acquire(key, TTL, limit=3) is None
    expire(places[0])
    assert raw.zscore(key, places[0].token) is None
    assert raw.zscore(key, places[1].token) is not None
    assert locks.acquire(key, TTL, limit=3) is not None
    assert places[0].release() is False
    expire(places[1])
    expire(places[2])
    assert raw.zcard(key) == 2  # "limit" and the new holder: the key lives on with it


def test_expire_of_the_last_place_deletes_the_key(locks, raw):
    key = name(locks, "single")
    only = hold(locks, key, TTL, limit=2)
    expire(only)
    assert raw.exists(key) == 0


def test_expire_of_a_reader_lets_the_writer_in(locks, raw):
    key = name(locks, "read")
    reader = hold(locks, key, shared=True)
    assert locks.acquire(key, TTL) is None
    expire(reader)
    assert locks.acquire(key, TTL) is not None
    assert reader.release() is False


def test_expire_of_an_asyncio_lease(core, redis_server, raw):
    aio = async_locks(core, redis_server.url)
    key = name(aio, "job")

    async def main() -> tuple[bool, bool]:
        lease = await aio.acquire(key, TTL)
        expire(lease)
        assert raw.exists(key) == 0
        released = await lease.release(), await lease.extend(TTL)
        await aio.close()
        return released

    assert asyncio.run(main()) == (False, False)


# -- take_over --------------------------------------------------------------------------


def test_take_over_passes_the_lock_to_another_holder(locks, raw):
    key = name(locks, "sales")
    mine = locks.acquire(key, TTL)
    theirs = take_over(mine)
    assert theirs.held and theirs.token != mine.token
    assert raw.get(key) == theirs.token
    assert locks.acquire(key, TTL) is None
    assert mine.extend(TTL) is False and mine.release() is False  # lock_expired_before_release
    assert raw.get(key) == theirs.token
    assert theirs.release() is True


def test_take_over_grants_the_next_fencing_number(locks):
    key = name(locks, "fenced")
    mine = locks.acquire(key, TTL, fence=True)
    theirs = take_over(mine)
    assert theirs.fence > mine.fence
    assert mine.release() is False


def test_take_over_of_a_counting_lock_takes_the_same_place(locks, raw):
    key = name(locks, "export")
    mine = locks.acquire(key, TTL, limit=2, fence=True)
    other = locks.acquire(key, TTL, limit=2, fence=True)
    theirs = take_over(mine, ttl=45)
    assert theirs.fence > other.fence
    assert raw.zscore(key, "limit") == -2
    assert raw.zscore(key, mine.token) is None and raw.zscore(key, theirs.token) is not None
    assert TTL < theirs.remaining() <= 45
    assert locks.acquire(key, TTL, limit=2) is None  # still full: other and theirs
    assert mine.release() is False
    assert other.release() is True and theirs.release() is True


def test_take_over_of_a_reader_is_another_reader(locks, raw):
    key = name(locks, "read")
    mine = locks.acquire(key, TTL, shared=True)
    theirs = take_over(mine)
    assert raw.zscore(key, "limit") == 0 and raw.zscore(key, theirs.token) is not None
    assert locks.acquire(key, TTL) is None  # the writer still waits for a reader
    assert mine.release() is False and theirs.release() is True


def test_take_over_makes_a_job_hear_its_lock_expired(locks, raw):
    expired = []
    theirs = []

    @locks.job(ttl=TTL, on_expired=expired.append)
    def report(day):
        theirs.append(take_over(current_lease()))
        return "done"

    assert report("2024-05-01") == "done"
    assert expired == ["2024-05-01"]
    assert raw.get(theirs[0].key) == theirs[0].token  # the job's release left theirs alone


def test_take_over_of_an_asyncio_lease(core, redis_server):
    aio = async_locks(core, redis_server.url)
    key = name(aio, "job")

    async def main() -> tuple[bool, Any]:
        lease = await aio.acquire(key, TTL)
        theirs = take_over(lease)
        released = await lease.release()
        await aio.close()
        return released, theirs

    released, theirs = asyncio.run(main())
    assert released is False
    assert theirs.release() is True


def test_take_over_raises_when_a_waiter_comes_first_and_the_waiter_takes_the_lock(locks, raw):
    # A new reader passes no queued writer: the reader's lock expires, to the writer.
    key = name(locks, "read")
    mine = locks.acquire(key, TTL, shared=True)
    got: list[Any] = []
    writer = threading.Thread(target=lambda: got.append(locks.acquire(key, TTL, wait=120)))
    listener = raw.pubsub()
    listener.psubscribe("joblock:wake:*")
    assert listener.get_message(timeout=10)["type"] == "psubscribe"
    try:
        writer.start()
        until(queued(raw, key))
        with pytest.raises(LockNotAcquired):
            take_over(mine)
        message = listener.get_message(timeout=10)
        assert message is not None and message["channel"] == LOST_CHANNEL  # its holder is told
        assert message["data"] == b"taken " + mine.token
        message = listener.get_message(timeout=10)  # the writer: told to look again, as at an expiry
        assert message is not None and message["data"].endswith(b" ?")
        writer.join(timeout=60)
    finally:
        listener.close()
    assert not writer.is_alive() and got[0] is not None and raw.get(key) == got[0].token
    assert mine.release() is False and got[0].release() is True


# -- bad input ----------------------------------------------------------------------------


def test_bad_input_is_refused_naming_the_argument_and_writes_nothing(make_locks, raw, redis_server):
    locks = make_locks()
    key = name(locks, "k")
    with pytest.raises(TypeError, match=r"^locks must be a joblock Locks or AsyncLocks, not NoneType"):
        hold(None, key)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^locks must be .* not ClusterLocks"):
        hold(ClusterLocks(redis_server.url), key)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^locks must be .* not Redlock"):
        hold(Redlock([redis_server.url]), key)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^key must be str or bytes, not int"):
        hold(locks, 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^ttl must be"):
        hold(locks, key, ttl=0)
    with pytest.raises(ValueError, match=r"^limit must be"):
        hold(locks, key, limit=0)
    with pytest.raises(ValueError, match=r"^shared=True takes no limit"):
        hold(locks, key, limit=2, shared=True)
    for helper in (expire, take_over):
        with pytest.raises(TypeError, match=r"^lease must be a Lease of a Locks or an AsyncLocks, not str"):
            helper("lease")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^lease must be a Lease .* not NoneType"):
            helper(None)  # type: ignore[arg-type]
    lease = locks.acquire(key, TTL)
    with pytest.raises(ValueError, match=r"^ttl must be"):
        take_over(lease, ttl=-1)
    assert lease.release() is True
    assert stored(raw, locks) == []
    with pytest.raises(ValueError, match=r"^lease does not hold its lock .*: it was released"):
        expire(lease)
    with pytest.raises(ValueError, match=r"^lease does not hold its lock"):
        take_over(lease)
    taken = locks.acquire(key, TTL)
    expire(taken)
    with pytest.raises(ValueError, match=r"^lease does not hold its lock"):
        expire(taken)  # once only
    assert stored(raw, locks) == []


# -- the plugin, as users get it ---------------------------------------------------------

# The twins a subprocess can be put on: by JOBLOCK_NO_EXTENSIONS (not the pure twin
# without hiredis, which only this process's conftest can make).
SUBPROCESS_TWINS = [twin for twin in TWINS if twin != "python-nohiredis"]


@pytest.fixture(params=SUBPROCESS_TWINS)
def user(request, pytester, monkeypatch):
    """A user's pytest run: a project of its own, on one twin, with no $REDIS_URL."""
    if request.param == "c":
        monkeypatch.delenv("JOBLOCK_NO_EXTENSIONS", raising=False)
    else:
        monkeypatch.setenv("JOBLOCK_NO_EXTENSIONS", "1")
    monkeypatch.delenv("REDIS_URL", raising=False)
    # Not a conftest (the page brings its own): a plugin that run() names with -p.
    pytester.makepyfile(
        twin_check=f"""
        import joblock

        def pytest_report_header():
            assert joblock.implementation == {"c" if request.param == "c" else "python"!r}
            return "twin checked"
        """
    )
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "twin_check", *args, timeout=300)
    result.stdout.fnmatch_lines(["twin checked"])
    return result


def test_import_joblock_imports_neither_pytest_nor_the_plugin():
    code = "import sys, joblock; print('pytest' in sys.modules, 'joblock.testing' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


def test_the_plugin_is_registered_by_its_entry_point_beside_the_suites_conftest(request, locks):
    assert request.config.pluginmanager.get_plugin("joblock") is joblock.testing
    # Its fixtures work beside the suite's own (tests/conftest.py), whose names it does not take.
    theirs = request.getfixturevalue("joblock_locks")
    assert type(theirs) is joblock.Locks and theirs.prefix != locks.prefix


def test_the_fixtures_start_a_throwaway_server_and_give_each_test_its_prefix(user):
    user.makepyfile(
        """
        import asyncio, os
        import redis
        import joblock
        import joblock.testing
        from joblock.aio import AsyncLocks
        from joblock.testing import hold

        seen = []

        def test_first(joblock_redis, joblock_locks):
            assert joblock_redis.startswith("redis://127.0.0.1:") and "REDIS_URL" not in os.environ
            assert type(joblock_locks) is joblock.Locks and joblock_locks.settings.url() == joblock_redis
            seen.append(joblock_locks.prefix)
            key = joblock_locks.key("J", 1)
            assert key.startswith(joblock_locks.prefix + ":")
            assert joblock_locks.acquire(key, 10, fence=True) is not None
            hold(joblock_locks, "app:J:1")  # a key of no test's prefix
            with open("state", "w") as f:
                f.write(joblock_locks.prefix)

        def test_second(joblock_redis, joblock_locks, joblock_async_locks):
            assert joblock_locks.prefix not in seen and joblock_async_locks.prefix != joblock_locks.prefix
            assert type(joblock_async_locks) is AsyncLocks
            # What the helpers took in the first test is free again; they use one client
            # of this server, whatever the prefix (none is left open per test).
            assert joblock_locks.acquire("app:J:1", 10) is not None
            assert len(joblock.testing._clients) == 1
            # Nothing is left under the first test's prefix: its lock, its fencing counter.
            prefix = open("state").read()
            client = redis.Redis.from_url(joblock_redis)
            assert client.keys(prefix + ":*") == client.keys("{" + prefix + ":*") == []
            with open("state", "w") as f:
                f.write(str(client.info("server")["process_id"]))
        """
    )
    result = run(user, "-s")  # -s: what the session fixture says is not captured
    result.assert_outcomes(passed=2)
    result.stderr.fnmatch_lines(["*started a throwaway redis-server at redis://127.0.0.1:*"])
    # The server was the session's: it stopped with it.
    with pytest.raises(ProcessLookupError):
        os.kill(int((user.path / "state").read_text()), 0)


def test_redis_url_wins_and_no_server_is_started(user, monkeypatch, redis_server, raw):
    monkeypatch.setenv("REDIS_URL", redis_server.url)
    user.makepyfile(
        f"""
        def test_it(joblock_redis, joblock_locks):
            assert joblock_redis == {redis_server.url!r}
            key = joblock_locks.key("J", 1)
            assert joblock_locks.acquire(key, 10, fence=True) is not None
            with open("prefix", "w") as f:
                f.write(joblock_locks.prefix)
        """
    )
    result = run(user, "-s")
    result.assert_outcomes(passed=1)
    assert "started a throwaway redis-server" not in result.stderr.str()
    prefix = (user.path / "prefix").read_text()
    # After the test, nothing is left under its prefix on the server $REDIS_URL named:
    # its lock, nor the fencing counter.
    assert list(raw.scan_iter(match=f"*{prefix}:*")) == []


# Warnings as errors, as strict projects run: a connection left unclosed fails the run.
STRICT = ("-W", "error::ResourceWarning", "-W", "error::pytest.PytestUnraisableExceptionWarning")


def test_the_async_fixture_closes_its_connections_on_the_loop_of_the_test(user):
    user.makepyfile(
        """
        import asyncio, gc
        import pytest
        from joblock.testing import hold, take_over

        @pytest.fixture
        def test_loop():
            # As pytest-asyncio's loop of one test: closed in its fixture's teardown,
            # which comes before that of joblock_async_locks, set up first.
            loop = asyncio.new_event_loop()
            yield loop
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        @pytest.fixture(scope="module")
        def kept_loop():
            # A loop that outlives each test: pytest-asyncio's loop_scope="module".
            loop = asyncio.new_event_loop()
            yield loop
            loop.close()

        async def busy(locks, key):
            theirs = hold(locks, key)
            assert await locks.acquire(key, 10) is None
            mine = await locks.acquire(key + ":2", 10)
            taken = take_over(mine)
            assert await mine.release() is False and taken.release() is True
            return theirs

        def test_its_own_loop(joblock_async_locks, test_loop):
            test_loop.run_until_complete(busy(joblock_async_locks, joblock_async_locks.key("A")))

        def test_a_kept_loop(joblock_async_locks, kept_loop):
            kept_loop.run_until_complete(busy(joblock_async_locks, joblock_async_locks.key("B")))

        def test_the_kept_loop_again(joblock_async_locks, kept_loop):
            kept_loop.run_until_complete(busy(joblock_async_locks, joblock_async_locks.key("B")))

        def test_asyncio_run_closing_the_client_itself(joblock_async_locks):
            async def main():
                async with joblock_async_locks:
                    await busy(joblock_async_locks, joblock_async_locks.key("C"))

            asyncio.run(main())

        def test_no_transport_was_left_open():
            gc.collect()  # an unclosed one would say so now
        """
    )
    result = run(user, *STRICT)
    result.assert_outcomes(passed=5)
    assert result.ret == 0


def test_a_missing_redis_server_is_an_error_saying_how_to_get_one(user, monkeypatch, tmp_path):
    monkeypatch.setenv("JOBLOCK_REDIS_SERVER", str(tmp_path / "no-redis-server"))
    user.makepyfile("def test_it(joblock_locks):\n    pass\n")
    result = run(user)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*JOBLOCK_REDIS_SERVER=* is not an executable file*"])


# -- docs/testing.md's examples ----------------------------------------------------------

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MODULE = re.compile(r"# (\w+)\.py[ \t]*\n")


def page_modules() -> dict[str, str]:
    """The page's python blocks, each a module named by its first line (``# shop.py``)."""
    modules = {}
    for code in _FENCE.findall(PAGE.read_text()):
        found = _MODULE.match(code)
        assert found is not None, f"a python block of {PAGE.name} is no module, so it would not run:\n{code}"
        modules[found.group(1)] = code
    return modules


def test_the_pages_examples_pass_as_a_users_tests(user):
    modules = page_modules()
    assert {"shop", "conftest", "test_shop", "test_shop_celery", "test_shop_rq", "test_shop_dramatiq"} <= set(
        modules
    )
    user.makepyfile(**modules)
    tests = sum(len(re.findall(r"^def test_", code, re.MULTILINE)) for code in modules.values())
    result = run(user, "-v", *STRICT)
    result.assert_outcomes(passed=tests)  # every test of the page ran and passed
    assert result.ret == 0


def test_the_pages_examples_fail_when_the_job_misbehaves(user):
    """The examples can fail: with the cleanup's busy run not rescheduled, its tests say so."""
    modules = page_modules()
    modules["shop"] = modules["shop"].replace(
        "on_locked=lambda user_id: enqueue_in(120, cleanup_data, user_id),", 'on_locked="skip",'
    )
    assert 'on_locked="skip"' in modules["shop"]
    user.makepyfile(**{k: v for k, v in modules.items() if k in ("shop", "conftest", "test_shop")})
    result = run(user)
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*FAILED test_shop.py::test_a_busy_cleanup_runs_again_in_2_minutes*"])
