"""Drop-ins for redis-py's locks whose commands go through joblock.

``RedisLock`` stands in for ``redis.lock.Lock``, ``AsyncRedisLock`` for
``redis.asyncio.lock.Lock``. Pass one where redis-py takes a lock class::

    lock = redis_client.lock("resource", timeout=30, lock_class=RedisLock)
    lock = async_redis_client.lock("resource", timeout=30, lock_class=AsyncRedisLock)

They take the same arguments, have the same methods (``acquire`` with ``blocking``,
``blocking_timeout`` and ``token``, plus ``sleep`` on the threaded one; ``release``;
``extend`` with ``replace_ttl``; ``reacquire``; ``locked``; ``owned``; the ``do_*``
steps; ``with`` or ``async with``), keep the token in ``lock.local.token`` and raise
redis-py's ``LockError`` and ``LockNotOwnedError``, so code and tests written for
redis-py's locks keep working. The commands are encoded and parsed by joblock's
core and carried by joblock's drivers, one per redis-py client, shared by that
client's locks; tokens are 128 random bits plus the holder (redis-py's default is a
time-based UUID1).

One thing goes beyond redis-py: an acquire whose caller stops waiting (a cancelled
task, an interrupted thread) gives back the lock if Redis granted it, so no lock is
left held that nobody owns.

``await joblock.compat.aclose(client)`` closes the connections joblock opened for a
redis.asyncio client's locks, for a shutdown that leaves no transport open.
"""

from __future__ import annotations

import inspect
import threading
import time
import weakref
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, ClassVar, Generic, Literal, TypeVar, cast

from redis import exceptions as redis_errors
from redis.asyncio.lock import Lock as AsyncLock
from redis.exceptions import LockError, LockNotOwnedError
from redis.lock import Lock

from . import errors
from ._client import MAX_SECONDS, holder_suffix, queueable
from ._core import core as _active_core
from ._engine import aio, sync
from ._engine.ops import Call, Pause
from ._engine.waits import QueueOne, waiting
from ._scripts import EXTEND_ADD_SHA, EXTEND_SHA, RELEASE_SHA
from .settings import Settings, check_bool, from_redis_options, parse_url

__all__ = ["AsyncRedisLock", "RedisLock", "aclose"]

T = TypeVar("T")
D = TypeVar("D", sync.Driver, aio.Driver)

# Every method is written once, as a plan of operations (see _Plans); the threaded and
# the asyncio driver each carry it out in their own way.
Plan = Generator[Any, Any, T]

# Code written for redis-py's Lock catches redis-py's exceptions (a retry on
# redis.exceptions.ConnectionError, say): joblock's are raised as those.
_AS_REDIS_ERRORS = (
    (errors.AuthenticationError, redis_errors.AuthenticationError),
    (errors.TimeoutError, redis_errors.TimeoutError),
    (errors.ConnectionError, redis_errors.ConnectionError),
    (errors.ReplyError, redis_errors.ResponseError),
)


@contextmanager
def _redis_errors() -> Iterator[None]:
    try:
        yield
    except errors.JoblockError as e:
        theirs = next((t for ours, t in _AS_REDIS_ERRORS if isinstance(e, ours)), redis_errors.RedisError)
        raise theirs(getattr(e, "message", str(e))) from e


class _Server(Generic[D]):
    """joblock's driver to the server of one redis-py client, shared by that client's locks."""

    def __init__(self, client: Any, core: ModuleType, driver: type[D]) -> None:
        url, options = from_redis_options(client)
        self.settings: Settings = parse_url(url, **options)
        self.core = core
        settings = self.settings
        self.driver: D = driver(core, lambda _: settings)


# One _Server per client, core twin and kind of driver; a client's go when it does.
_servers: weakref.WeakKeyDictionary[Any, dict[tuple[ModuleType, type], _Server[Any]]] = (
    weakref.WeakKeyDictionary()
)
_servers_lock = threading.Lock()


def _server_for(client: Any, core: ModuleType, driver: type[D]) -> _Server[D]:
    with _servers_lock:
        per_client = _servers.setdefault(client, {})
        server = per_client.get((core, driver))
        if server is None:
            server = per_client[core, driver] = _Server(client, core, driver)
        return server


async def aclose(client: Any) -> None:
    """Closes the connections joblock opened for ``client``'s AsyncRedisLocks.

    For a clean shutdown, next to ``await client.aclose()``: redis-py's client closes
    only its own pool. They open again if its locks are used again.
    """
    with _servers_lock:
        servers = [s for (_, kind), s in _servers.get(client, {}).items() if kind is aio.Driver]
    for server in servers:
        await server.driver.close()


class _TakenBack(Call):
    """A SET NX whose grant is released when its caller stopped waiting for the reply."""

    __slots__ = ()

    def undo(self) -> None:
        if self.result[0] is not None:
            _, key, token = self.commands[0][:3]
            release = (b"EVALSHA", RELEASE_SHA, 1, key, token)
            self.engine.spawn(Call(self.target, self.core, [release], self.retries, scripted=True))


class _Plans:
    """What RedisLock and AsyncRedisLock share: redis-py's Lock methods as plans.

    Each plan yields the operations its method needs and is carried out by the lock's
    driver (``_run``); it reads ``self.local`` before its first operation, in the
    caller's thread, as redis-py's methods do.
    """

    # The core to build on; tests bind it to each twin.
    _core: ModuleType = _active_core
    _driver: ClassVar[type[sync.Driver] | type[aio.Driver]]
    _init_signature: ClassVar[inspect.Signature]  # redis-py's Lock.__init__'s

    # Set by redis-py's Lock.__init__ (which calls register_scripts).
    redis: Any
    name: Any
    timeout: float | None
    sleep: float
    blocking: bool
    blocking_timeout: float | None
    local: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # redis-py's Lock stores its flags as given (thread_local as bool(...)): a truthy
        # "no" would block, or share the token between threads. Its signature, as this
        # redis-py version spells it, finds them given by position too.
        given = self._init_signature.bind(self, *args, **kwargs).arguments
        for flag in ("blocking", "thread_local", "raise_on_release_error"):
            if flag in given:
                check_bool(given[flag], flag)
        super().__init__(*args, **kwargs)

    def register_scripts(self) -> None:
        # joblock loads its own scripts on the first NOSCRIPT; nothing to register.
        self._server: _Server[Any] = _server_for(self.redis, self._core, self._driver)
        self._key = self._core.as_key(self.name, "name")

    def _command(self, *command: Any, scripted: bool = False, op: type[Call] = Call) -> Plan[Any]:
        """One command, not retried after a lost reply (redis-py's Lock does not either)."""
        server = self._server
        replies = yield op(None, server.core, [command], server.settings.retries, scripted=scripted)
        return replies[0]

    def _script(self, sha: bytes, *args: bytes | str | int) -> Plan[Any]:
        return self._command(b"EVALSHA", sha, 1, self._key, *args, scripted=True)

    def _acquiring(
        self,
        sleep: float | None,
        blocking: bool | None,
        blocking_timeout: float | None,
        token: str | bytes | None,
    ) -> Plan[bool]:
        sleep = self.sleep if sleep is None else sleep
        blocking = self.blocking if blocking is None else check_bool(blocking, "blocking")
        blocking_timeout = self.blocking_timeout if blocking_timeout is None else blocking_timeout
        # As redis-py's, the time to give up counts from the call, the first try included.
        give_up = time.monotonic() + (MAX_SECONDS if blocking_timeout is None else blocking_timeout)
        if token is None:
            token = self._core.new_values(1, holder_suffix())[0]
        else:
            token = self.redis.get_encoder().encode(token)
        # The first try is the plan of do_acquire rather than a call of it: a plan runs
        # on either driver, and an asyncio do_acquire is a coroutine it could not await.
        taken = yield from self._taking(token)
        core = self._server.core
        if not taken and blocking and (blocking_timeout is None or blocking_timeout >= sleep):
            if queueable(core, self._key):
                # Queued until a release hands the lock over (``sleep`` no longer polls:
                # it only says, as in redis-py, that a timeout shorter than it tries once).
                # The wait ends one ``sleep`` before blocking_timeout, then the last try
                # leaves the queue: as redis-py's acquire, which makes no try a ``sleep``
                # would carry past blocking_timeout, it returns after blocking_timeout -
                # sleep and by blocking_timeout, with a ``sleep`` to spare for a late
                # timer on a busy machine (redis-py's own tests assert both bounds).
                ms = int(self.timeout * 1000) if self.timeout else 0  # 0: no expiry, as redis-py's
                value = cast(bytes, token)  # encoded above
                retries = self._server.settings.retries
                first = QueueOne(None, None, core, self._key, self.name, value, ms, False, 1, retries)
                patience = max(0.0, give_up - sleep - time.monotonic())
                taken = (yield from waiting(first, patience)) is not None
            else:  # a name with a "}" but no hash tag has no queue: it tries every ``sleep``
                while not taken and time.monotonic() + sleep <= give_up:
                    yield Pause(sleep)
                    taken = yield from self._taking(token)
        if taken:
            self.local.token = token
        return taken

    def _taking(self, token: str | bytes) -> Plan[bool]:
        ttl = ("PX", int(self.timeout * 1000)) if self.timeout else ()
        reply = yield from self._command("SET", self._key, token, "NX", *ttl, op=_TakenBack)
        return reply is not None

    def _locking(self) -> Plan[bool]:
        # GET, as redis-py does (EXISTS would call a key of another type locked).
        return (yield from self._command("GET", self._key)) is not None

    def _owning(self) -> Plan[bool]:
        token = self.local.token
        if token is None:
            return False
        value = yield from self._command("GET", self._key)
        # Ours also when marked by a waiter that queued (see _scripts.MARK).
        return type(value) is bytes and type(token) is bytes and self._server.core.mine(value, token)

    def _releasing(self, expected_token: str | bytes) -> Plan[None]:
        if (yield from self._script(RELEASE_SHA, expected_token)) != 1:
            raise LockNotOwnedError("Cannot release a lock that's no longer owned", lock_name=self.name)

    def _extending(self, additional_time: float, replace_ttl: bool) -> Plan[Literal[True]]:
        check_bool(replace_ttl, "replace_ttl")
        ms = int(additional_time * 1000)
        token = self.local.token
        if (yield from self._script(EXTEND_ADD_SHA, token, ms, "1" if replace_ttl else "0")) != 1:
            raise LockNotOwnedError("Cannot extend a lock that's no longer owned", lock_name=self.name)
        return True

    def _reacquiring(self) -> Plan[Literal[True]]:
        if self.timeout is None:
            raise LockError("Cannot reacquire a lock with no timeout", lock_name=self.name)
        ms = int(self.timeout * 1000)
        if (yield from self._script(EXTEND_SHA, self.local.token, ms)) != 1:
            raise LockNotOwnedError("Cannot reacquire a lock that's no longer owned", lock_name=self.name)
        return True


class RedisLock(_Plans, Lock):
    """redis-py's ``Lock`` API on joblock's core (see the module docstring)."""

    _driver = sync.Driver
    _server: _Server[sync.Driver]
    _init_signature = inspect.signature(Lock.__init__)

    def _run(self, plan: Plan[T]) -> T:
        with _redis_errors():
            return self._server.driver.drive(plan)

    def acquire(
        self,
        sleep: float | None = None,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        return self._run(self._acquiring(sleep, blocking, blocking_timeout, token))

    def do_acquire(self, token: str | bytes) -> bool:
        return self._run(self._taking(token))

    def locked(self) -> bool:
        return self._run(self._locking())

    def owned(self) -> bool:
        return self._run(self._owning())

    def do_release(self, expected_token: str | bytes) -> None:
        self._run(self._releasing(expected_token))

    def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
        return self._run(self._extending(additional_time, replace_ttl))

    def do_reacquire(self) -> Literal[True]:
        return self._run(self._reacquiring())


class AsyncRedisLock(_Plans, AsyncLock):
    """redis-py's asyncio ``Lock`` API on joblock's core (see the module docstring).

    Its commands go over joblock's asyncio connection for the client, shared by every
    task using the client's locks on that event loop.
    """

    _driver = aio.Driver
    _server: _Server[aio.Driver]
    _init_signature = inspect.signature(AsyncLock.__init__)

    async def _run(self, plan: Plan[T]) -> T:
        with _redis_errors():
            return await self._server.driver.drive(plan)

    async def acquire(
        self,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
        *,
        sleep: float | None = None,
    ) -> bool:
        return await self._run(self._acquiring(sleep, blocking, blocking_timeout, token))

    async def do_acquire(self, token: str | bytes) -> bool:
        return await self._run(self._taking(token))

    async def locked(self) -> bool:
        return await self._run(self._locking())

    async def owned(self) -> bool:
        return await self._run(self._owning())

    async def do_release(self, expected_token: str | bytes) -> None:
        await self._run(self._releasing(expected_token))

    async def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
        return await self._run(self._extending(additional_time, replace_ttl))

    async def do_reacquire(self) -> Literal[True]:
        return await self._run(self._reacquiring())
