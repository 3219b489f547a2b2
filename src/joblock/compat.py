"""``RedisLock``: a drop-in for redis-py's ``Lock`` whose commands go through joblock.

Pass it where redis-py takes a lock class::

    lock = redis_client.lock("resource", timeout=30, lock_class=RedisLock)

It takes the same arguments, has the same methods (``acquire`` with ``blocking``,
``blocking_timeout`` and ``token``; ``release``; ``extend`` with ``replace_ttl``;
``reacquire``; ``locked``; ``owned``), keeps the token in ``lock.local.token`` and
raises redis-py's ``LockError`` and ``LockNotOwnedError``, so code and tests written
for redis-py's Lock keep working. The commands are encoded and parsed by joblock's
core over joblock's pool; tokens are 128 random bits plus the holder (redis-py's
default is a time-based UUID1).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Literal

from redis import exceptions as redis_errors
from redis.exceptions import LockError, LockNotOwnedError
from redis.lock import Lock

from . import errors
from ._client import holder_suffix
from ._core import core as _active_core
from ._engine.ops import Call
from ._engine.sync import Driver
from ._scripts import EXTEND_ADD_SHA, EXTEND_SHA, RELEASE_SHA
from .settings import Settings, from_redis_options, parse_url

__all__ = ["RedisLock"]

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


class _Server:
    """joblock's driver to the server of one redis-py client, shared by that client's locks."""

    def __init__(self, client: Any, core: ModuleType) -> None:
        url, options = from_redis_options(client)
        self.settings: Settings = parse_url(url, **options)
        self.core = core
        settings = self.settings
        self.driver = Driver(core, lambda _: settings)

    def call(self, *command: Any, scripted: bool = False) -> Any:
        """One command, not retried after a lost reply (redis-py's Lock does not either)."""
        with _redis_errors():
            op = Call(None, self.core, [command], self.settings.retries, scripted=scripted)
            return self.driver.run(op)[0]


class RedisLock(Lock):
    """redis-py's ``Lock`` API on joblock's core (see the module docstring)."""

    # The core to build on; tests bind it to each twin.
    _core: ModuleType = _active_core
    _servers: weakref.WeakKeyDictionary[Any, dict[ModuleType, _Server]] = weakref.WeakKeyDictionary()
    _servers_lock = threading.Lock()

    def register_scripts(self) -> None:
        # joblock loads its own scripts on the first NOSCRIPT; nothing to register.
        self._server = self._server_for(self.redis)
        self._key = self._core.as_key(self.name, "name")

    @classmethod
    def _server_for(cls, client: Any) -> _Server:
        with cls._servers_lock:
            per_core = cls._servers.setdefault(client, {})
            server = per_core.get(cls._core)
            if server is None:
                server = per_core[cls._core] = _Server(client, cls._core)
            return server

    def acquire(
        self,
        sleep: float | None = None,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        sleep = self.sleep if sleep is None else sleep
        blocking = self.blocking if blocking is None else blocking
        blocking_timeout = self.blocking_timeout if blocking_timeout is None else blocking_timeout
        if token is None:
            token = self._core.new_values(1, holder_suffix())[0]
        else:
            token = self.redis.get_encoder().encode(token)
        give_up = None if blocking_timeout is None else time.monotonic() + blocking_timeout
        while True:
            if self.do_acquire(token):
                self.local.token = token
                return True
            if not blocking or (give_up is not None and time.monotonic() + sleep > give_up):
                return False
            time.sleep(sleep)

    def _evalsha(self, sha: bytes, *args: bytes | str | int) -> Any:
        return self._server.call(b"EVALSHA", sha, 1, self._key, *args, scripted=True)

    def do_acquire(self, token: str | bytes) -> bool:
        ttl = ("PX", int(self.timeout * 1000)) if self.timeout else ()
        return self._server.call("SET", self._key, token, "NX", *ttl) is not None

    def locked(self) -> bool:
        # GET, as redis-py does (EXISTS would call a key of another type locked).
        return self._server.call("GET", self._key) is not None

    def owned(self) -> bool:
        token = self.local.token
        return token is not None and self._server.call("GET", self._key) == token

    def do_release(self, expected_token: str | bytes) -> None:
        if self._evalsha(RELEASE_SHA, expected_token) != 1:
            raise LockNotOwnedError("Cannot release a lock that's no longer owned", lock_name=self.name)

    def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
        ms = int(additional_time * 1000)
        token = self.local.token
        if self._evalsha(EXTEND_ADD_SHA, token, ms, "1" if replace_ttl else "0") != 1:
            raise LockNotOwnedError("Cannot extend a lock that's no longer owned", lock_name=self.name)
        return True

    def do_reacquire(self) -> Literal[True]:
        if self.timeout is None:
            raise LockError("Cannot reacquire a lock with no timeout", lock_name=self.name)
        ms = int(self.timeout * 1000)
        if self._evalsha(EXTEND_SHA, self.local.token, ms) != 1:
            raise LockNotOwnedError("Cannot reacquire a lock that's no longer owned", lock_name=self.name)
        return True
