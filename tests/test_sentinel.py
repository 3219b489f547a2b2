"""Redis Sentinel: ``redis+sentinel://`` clients on real sentinels, a primary and a replica.

Every test runs on each twin of the core. The failover tests start a deployment of
their own (a failover leaves the old primary a primary for seconds, until the
sentinels convert it, so none is reused) and wait generously for the failover
itself; what they measure starts at the sentinels' ``+switch-master``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from redis.sentinel import Sentinel

import joblock
from conftest import locks_class
from joblock._engine.sentinel import Primary
from joblock._tools.servers import find_redis_server
from joblock.aio import AsyncLocks
from rig.sentinels import LocalSentinels

PRIMARY_PASSWORD = "primary-pw-1"
SENTINEL_PASSWORD = "sentinel-pw-2"

# The failover itself may take long on a loaded machine; joblock's part may not.
FAILOVER_WAIT = 40.0
MOVED_WITHIN = 2.0

# What a caller may see while the primary changes: Redis unreachable, or a replica.
SWITCH_ERRORS = (joblock.ConnectionError, joblock.ReadOnlyError)


def async_class(core: ModuleType) -> type[AsyncLocks]:
    return type("AsyncLocks", (AsyncLocks,), {"_core": core})


@pytest.fixture(scope="module")
def guarded() -> Iterator[LocalSentinels]:
    """Sentinels behind a password of their own, watching a primary behind another."""
    with LocalSentinels(password=PRIMARY_PASSWORD, sentinel_password=SENTINEL_PASSWORD) as deployment:
        yield deployment


def info_fields(reply: bytes) -> dict[str, str]:
    return dict(line.split(":", 1) for line in reply.decode().splitlines() if ":" in line)


def test_the_sentinels_are_the_suites_server_in_sentinel_mode(guarded):
    """A run on Valkey must test Valkey's Sentinel, not a Redis one beside Valkey servers.
    (Valkey names the mode server_mode, Redis redis_mode.)"""
    binary = os.path.realpath(find_redis_server())
    for server in guarded.servers:
        info = info_fields(guarded.call(server, "INFO", "server"))
        assert os.path.realpath(info["executable"]) == binary
    for sentinel in guarded.sentinels:
        info = info_fields(sentinel.call("INFO", "server"))
        assert info.get("server_mode", info.get("redis_mode")) == "sentinel"
        assert os.path.realpath(info["executable"]) == binary


def guarded_url(deployment: LocalSentinels, sentinel_password: str = SENTINEL_PASSWORD) -> str:
    return (
        deployment.url.replace("://", f"://:{PRIMARY_PASSWORD}@", 1)
        + f"?sentinel_password={sentinel_password}"
    )


class SwitchWatch:
    """The moment the first sentinel announces ``+switch-master``, seen by subscribing to it."""

    def __init__(self, deployment: LocalSentinels) -> None:
        self.client = redis.Redis(port=deployment.sentinels[0].port)
        self.pubsub = self.client.pubsub()
        self.pubsub.subscribe("+switch-master")
        self.pubsub.get_message(timeout=5)  # the subscription's confirmation
        self.at: float | None = None
        self.seen = threading.Event()
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while not self.seen.is_set():
            message = self.pubsub.get_message(timeout=0.2)
            if message is not None and message["type"] == "message":
                self.at = time.monotonic()
                self.seen.set()

    def wait(self) -> float:
        assert self.seen.wait(FAILOVER_WAIT), "the sentinels did not switch the primary"
        assert self.at is not None
        return self.at

    def close(self) -> None:
        self.seen.set()
        self.thread.join()
        self.pubsub.close()
        self.client.close()


def fail_over(deployment: LocalSentinels) -> float:
    """Forces a failover; the monotonic time of the sentinels' ``+switch-master``."""
    watch = SwitchWatch(deployment)
    try:
        assert deployment.sentinels[0].call("SENTINEL", "FAILOVER", deployment.service) == b"OK"
        return watch.wait()
    finally:
        watch.close()


# -- failover --------------------------------------------------------------------------------


class Takers:
    """Threads on a Locks and tasks on an AsyncLocks taking locks until told to stop.

    Each takes a fresh key at a time, releases every other lease and keeps the rest,
    noting when each kept one was asked for and its token. Errors a failover may
    cause are counted; any other is kept, for the test to fail on.
    """

    def __init__(self, core: ModuleType, url: str, threads: int = 3, tasks: int = 3) -> None:
        self.locks = locks_class(core)(url, prefix="fo")
        self.async_class = async_class(core)
        self.url = url
        self.kept: list[tuple[str, float, str, bytes]] = []  # (who, asked at, key, token)
        self.switch_errors: list[Exception] = []
        self.other_errors: list[BaseException] = []
        self.stop = threading.Event()
        self.mutex = threading.Lock()
        self.workers = [threading.Thread(target=self._thread, args=(n,)) for n in range(threads)]
        self.workers.append(threading.Thread(target=lambda: asyncio.run(self._tasks(tasks))))

    def _note(self, who: str, asked: float, key: str, lease: Any, keep: bool) -> None:
        if lease is None:
            self.other_errors.append(AssertionError(f"{key}, a fresh key, was not granted"))
        elif keep:
            with self.mutex:
                self.kept.append((who, asked, key, lease.token))

    def _thread(self, n: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            key = f"fo:thread{n}:{i}"
            asked = time.monotonic()
            try:
                lease = self.locks.acquire(key, 60)
                self._note("thread", asked, key, lease, keep=i % 2 == 0)
                if lease is not None and i % 2:
                    lease.release()  # False for a lock the failover lost: no error
            except SWITCH_ERRORS as e:
                self.switch_errors.append(e)
            except BaseException as e:
                self.other_errors.append(e)
                return
            time.sleep(0.005)

    async def _tasks(self, tasks: int) -> None:
        locks = self.async_class(self.url, prefix="fo")

        async def task(n: int) -> None:
            i = 0
            while not self.stop.is_set():
                i += 1
                key = f"fo:task{n}:{i}"
                asked = time.monotonic()
                try:
                    lease = await locks.acquire(key, 60)
                    self._note("task", asked, key, lease, keep=i % 2 == 0)
                    if lease is not None and i % 2:
                        await lease.release()
                except SWITCH_ERRORS as e:
                    self.switch_errors.append(e)
                except BaseException as e:
                    self.other_errors.append(e)
                    return
                await asyncio.sleep(0.005)

        try:
            await asyncio.gather(*(task(n) for n in range(tasks)))
        finally:
            await locks.close()

    def __enter__(self) -> Takers:
        for worker in self.workers:
            worker.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        for worker in self.workers:
            worker.join()
        self.locks.close()


def test_threads_and_tasks_take_locks_on_the_new_primary_soon_after_a_failover(core):
    with LocalSentinels() as deployment:
        old = deployment.primary()
        with Takers(core, deployment.url) as takers:
            time.sleep(0.5)  # under way before the failover
            switched = fail_over(deployment)
            # Past the 2 s, long enough for both threads and tasks to take more.
            while time.monotonic() < switched + MOVED_WITHIN + 1.5 and not takers.other_errors:
                time.sleep(0.05)
        assert takers.other_errors == []
        new = deployment.primary()
        assert new is not old
        late = [k for k in takers.kept if k[1] >= switched + MOVED_WITHIN]
        assert {who for who, *_ in late} == {"thread", "task"}
        tokens = deployment.call(new, "MGET", *(key for _, _, key, _ in late))
        assert tokens == [token for *_, token in late]  # every one granted by the new primary


def test_the_failover_caveat_a_lock_the_old_primary_grants_late_is_lost(core):
    """Replication is asynchronous: a lock granted by the old primary once the replica
    has taken over never reaches the new primary, so a second holder gets it too.
    (Locks replicated before the failover survive it.)"""
    with LocalSentinels() as deployment:
        locks = locks_class(core)(deployment.url, prefix="caveat")
        old = deployment.primary()
        kept = locks.acquire("caveat:before", 60)
        assert kept is not None
        replica = deployment.replica()
        deadline = time.monotonic() + FAILOVER_WAIT
        while deployment.call(replica, "GET", "caveat:before") != kept.token:  # replicated
            assert time.monotonic() < deadline, "the replica did not get the lock"
            time.sleep(0.02)
        fail_over(deployment)
        # A client yet to notice the failover: the old primary, a primary for a few
        # seconds more, still grants locks.
        late = locks_class(core)(f"redis://127.0.0.1:{old.port}/0").acquire("caveat:job", 60)
        assert late is not None
        second = locks.acquire("caveat:job", 60)
        assert second is not None  # two holders of one lock
        assert second.token != late.token
        assert kept.extend(60)  # replicated before the failover: still ours
        assert locks.acquire("caveat:before", 60) is None
        locks.close()


def sentinels_name(deployment: LocalSentinels, server: Any) -> None:
    """Tells every sentinel that ``server`` is the service's primary, as an operator would."""
    for sentinel in deployment.sentinels:
        sentinel.call("SENTINEL", "REMOVE", deployment.service)
        sentinel.call("SENTINEL", "MONITOR", deployment.service, "127.0.0.1", server.port, 2)


def test_a_primary_made_a_replica_answers_readonly_and_the_calls_move_to_the_new_one(core, monkeypatch):
    """Open connections to a primary demoted by hand (no failover the sentinels ran):
    its READONLY replies send the calls to the primary the sentinels name now; a
    connection the sentinels send to a replica is refused by the ROLE check."""
    monkeypatch.setattr(Primary, "recheck", 600.0)  # only the replies tell of the change
    with LocalSentinels() as deployment:
        old, new = deployment.primary(), deployment.replica()
        locks = locks_class(core)(deployment.url, prefix="ro")
        loop = asyncio.new_event_loop()
        alocks = async_class(core)(deployment.url, prefix="ro")
        try:
            assert locks.acquire("ro:thread-before", 60) is not None  # connections open to the primary
            assert loop.run_until_complete(alocks.acquire("ro:task-before", 60)) is not None
            sentinels_name(deployment, new)
            deployment.call(new, "REPLICAOF", "NO", "ONE")
            deployment.call(old, "REPLICAOF", "127.0.0.1", new.port)
            deadline = time.monotonic() + FAILOVER_WAIT
            while b"master_link_status:up" not in deployment.call(old, "INFO", "replication"):
                assert time.monotonic() < deadline, "the old primary did not become a replica"
                time.sleep(0.05)

            lease = locks.acquire("ro:thread-after", 60)
            assert lease is not None and deployment.call(new, "GET", "ro:thread-after") == lease.token
            alease = loop.run_until_complete(alocks.acquire("ro:task-after", 60))
            assert alease is not None and deployment.call(new, "GET", "ro:task-after") == alease.token
            assert b"errorstat_READONLY:count=2" in deployment.call(old, "INFO", "errorstats")

            sentinels_name(deployment, old)  # a replica now
            with pytest.raises(
                joblock.ConnectionError, match=f"{old.port} is a slave, no longer the primary"
            ):
                locks_class(core)(deployment.url).acquire("ro:k", 60)
        finally:
            locks.close()
            loop.run_until_complete(alocks.close())
            loop.close()


# -- discovery ---------------------------------------------------------------------------------


def test_locks_on_a_guarded_primary_behind_guarded_sentinels(core, guarded):
    g = core.__name__  # the deployment serves every twin's run
    locks = locks_class(core)(guarded_url(guarded))
    assert PRIMARY_PASSWORD not in repr(locks) and SENTINEL_PASSWORD not in repr(locks)
    lease = locks.acquire(f"{g}:one", 30)
    assert lease is not None
    assert guarded.call(guarded.primary(), "GET", f"{g}:one") == lease.token
    leases = locks.acquire_many([f"{g}:a", f"{g}:b", f"{g}:one"], 30)
    assert [bool(x) for x in leases] == [True, True, False]
    assert locks.release_many(leases) == [True, True, False]
    assert lease.release()
    locks.close()

    async def main() -> None:
        alocks = async_class(core)(guarded_url(guarded))
        lease = await alocks.acquire(f"{g}:async", 30)
        assert lease is not None
        assert guarded.call(guarded.primary(), "GET", f"{g}:async") == lease.token
        assert await lease.release()
        await alocks.close()

    asyncio.run(main())


def test_a_sentinel_down_the_others_answer(core, guarded):
    down = guarded.sentinels[0]
    down.stop()
    try:
        locks = locks_class(core)(guarded_url(guarded), prefix="d")
        lease = locks.acquire("d:one", 30)
        assert lease is not None and lease.release()
        locks.close()

        async def main() -> None:
            alocks = async_class(core)(guarded_url(guarded), prefix="d")
            lease = await alocks.acquire("d:two", 30)
            assert lease is not None and await lease.release()
            await alocks.close()

        asyncio.run(main())
    finally:
        down.start()


def test_a_wrong_service_name_is_a_clear_error(core, guarded):
    url = guarded_url(guarded).replace(f"/{guarded.service}/", "/no-such-service/")
    locks = locks_class(core)(url)
    with pytest.raises(joblock.ConnectionError, match="no sentinel knows a primary named 'no-such-service'"):
        locks.acquire("k", 30)
    with pytest.raises(joblock.ConnectionError, match="'no-such-service'"):
        locks.acquire_many(["k1", "k2"], 30)

    async def main() -> None:
        alocks = async_class(core)(url)
        with pytest.raises(
            joblock.ConnectionError, match="no sentinel knows a primary named 'no-such-service'"
        ):
            await alocks.acquire("k", 30)
        await alocks.close()

    asyncio.run(main())


def test_a_wrong_sentinel_password_is_a_clear_error_that_hides_it(core, guarded):
    wrong = "not-the-sentinel-pw"
    url = guarded_url(guarded, sentinel_password=wrong)
    locks = locks_class(core)(url)
    assert wrong not in repr(locks) and PRIMARY_PASSWORD not in repr(locks)
    with pytest.raises(joblock.AuthenticationError, match="refused the sentinel credentials") as info:
        locks.acquire("k", 30)
    for text in (str(info.value), repr(info.value)):
        assert wrong not in text and PRIMARY_PASSWORD not in text and SENTINEL_PASSWORD not in text

    async def main() -> None:
        alocks = async_class(core)(url)
        with pytest.raises(joblock.AuthenticationError, match="refused the sentinel credentials") as info:
            await alocks.acquire("k", 30)
        assert wrong not in str(info.value)
        await alocks.close()

    asyncio.run(main())


def test_from_redis_takes_a_master_for_client(core, guarded):
    sentinel = Sentinel(
        [("127.0.0.1", s.port) for s in guarded.sentinels],
        sentinel_kwargs={"password": SENTINEL_PASSWORD},
        password=PRIMARY_PASSWORD,
    )
    client = sentinel.master_for(guarded.service)
    locks = locks_class(core).from_redis(client, prefix="fr")
    assert locks.settings.service == guarded.service
    assert locks.settings.sentinels == tuple(("127.0.0.1", s.port) for s in guarded.sentinels)
    assert PRIMARY_PASSWORD not in repr(locks) and SENTINEL_PASSWORD not in repr(locks)
    lease = locks.acquire(f"{core.__name__}:one", 30)
    assert lease is not None
    assert client.get(f"{core.__name__}:one") == lease.token
    assert lease.release()
    locks.close()

    async def main() -> None:
        alocks = async_class(core).from_redis(client, prefix="fr")
        lease = await alocks.acquire(f"{core.__name__}:two", 30)
        assert lease is not None and client.get(f"{core.__name__}:two") == lease.token
        assert await lease.release()
        await alocks.close()

    asyncio.run(main())
    client.close()


def test_a_waiter_behind_sentinels_is_handed_the_lock_by_the_release(core, guarded):
    # The wake-up subscription goes to the primary the sentinels name, with its password.
    g = core.__name__
    holder, waiter = locks_class(core)(guarded_url(guarded)), locks_class(core)(guarded_url(guarded))
    lease = holder.acquire(f"{g}:wait", 30)
    assert lease is not None
    threading.Timer(0.2, lease.release).start()
    started = time.monotonic()
    got = waiter.acquire(f"{g}:wait", 30, wait=20)
    assert got is not None and time.monotonic() - started < 10
    assert guarded.call(guarded.primary(), "GET", f"{g}:wait") == got.token
    assert got.release()

    async def main() -> None:
        alocks = async_class(core)(guarded_url(guarded))
        lease = holder.acquire(f"{g}:await", 30)
        assert lease is not None
        threading.Timer(0.2, lease.release).start()
        got = await alocks.acquire(f"{g}:await", 30, wait=20, fair=True)
        assert got is not None and await got.release()
        await alocks.close()

    asyncio.run(main())
    holder.close()
    waiter.close()
