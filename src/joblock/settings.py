"""Where and how to reach Redis: parsed from a URL, with keyword overrides.

``redis://[[user]:[password]@]host[:port][/db][?option=value...]``, ``rediss://`` for
TLS, and ``unix://[[user]:[password]@]/path/to.sock[?db=N]``. The password is kept out
of every repr and error message.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypedDict
from urllib.parse import parse_qsl, unquote, urlsplit

__all__ = ["ConnectionOptions", "Settings", "from_redis_options", "parse_url"]

_CERT_REQS = ("none", "optional", "required")


@dataclasses.dataclass(frozen=True, repr=False)
class Settings:
    """Connection settings. ``password`` never appears in ``repr``."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None  # a unix socket instead of host and port
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str = "required"
    ssl_check_hostname: bool = True
    connect_timeout: float = 5.0
    socket_timeout: float = 5.0
    keepalive: bool = True
    retries: int = 3  # reconnect attempts after a dropped connection
    client_name: str | None = None

    @property
    def address(self) -> str:
        """Where the server is, for messages: ``host:port`` or the socket's path."""
        return self.path if self.path is not None else f"{self.host}:{self.port}"

    def url(self) -> str:
        """The URL without the password (shown as ``***`` when there is one)."""
        auth = ""
        if self.username or self.password:
            auth = f"{self.username or ''}{':***' if self.password else ''}@"
        if self.path is not None:
            return f"unix://{auth}{self.path}?db={self.db}"
        scheme = "rediss" if self.tls else "redis"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{auth}{host}:{self.port}/{self.db}"

    def __repr__(self) -> str:
        return f"Settings({self.url()!r})"


class ConnectionOptions(TypedDict, total=False):
    """The keyword options of every client that override what its URL says (see ``Settings``)."""

    host: str
    port: int
    path: str | None
    db: int
    username: str | None
    password: str | None
    tls: bool
    ssl: bool  # the same as tls, as redis-py spells it
    ssl_ca_certs: str | None
    ssl_certfile: str | None
    ssl_keyfile: str | None
    ssl_cert_reqs: str
    ssl_check_hostname: bool
    connect_timeout: float
    socket_connect_timeout: float  # connect_timeout, as redis-py spells it
    socket_timeout: float
    keepalive: bool
    socket_keepalive: bool  # keepalive, as redis-py spells it
    retries: int
    client_name: str | None


_FLOATS = ("connect_timeout", "socket_timeout")
_INTS = ("db", "port", "retries")
_BOOLS = ("tls", "ssl_check_hostname", "keepalive")
_STRS = ("host", "path", "username", "password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "client_name")
_ALIASES = {"socket_connect_timeout": "connect_timeout", "ssl": "tls", "socket_keepalive": "keepalive"}


def _coerce(name: str, value: Any, from_url: bool) -> Any:
    """Checks (and, for values read from a URL, converts) one setting."""
    if value is None and name in _STRS:
        return None
    if name in _FLOATS:
        if from_url:
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"{name} must be a number of seconds, not {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number of seconds > 0, not {value!r}")
        return float(value)
    if name in _INTS:
        if from_url:
            if not str(value).isdigit():
                raise ValueError(f"{name} must be a whole number, not {value!r}")
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if value < 0 or (name == "port" and not 0 < value < 65536):
            raise ValueError(f"{name} is out of range: {value}")
        return value
    if name in _BOOLS:
        if from_url:
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(f"{name} must be true or false, not {value!r}")
            value = value.lower() in ("1", "true", "yes")
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
        return value
    if name == "ssl_cert_reqs":
        value = str(value).lower().removeprefix("cert_")
        if value not in _CERT_REQS:
            raise ValueError(f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    return value


# A password with an unescaped '/', '?' or '#' ends the host part early and spills
# into the port, path or query; messages about those parts then quote nothing.
_SPILLED = (
    " (not shown: the url has an '@' after its host, so this may be part of a password;"
    " write '/', '?' and '#' in a password as %2F, %3F and %23)"
)


def _options(pairs: dict[str, Any], from_url: bool, hide: bool = False) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(Settings)}
    out = {}
    for name, value in pairs.items():
        name = _ALIASES.get(name, name)
        if name not in fields:
            raise TypeError(
                "url: unknown connection option" + _SPILLED if hide else f"unknown connection option {name!r}"
            )
        try:
            out[name] = _coerce(name, value, from_url)
        except (TypeError, ValueError) as e:
            if not hide:
                raise
            raise type(e)(f"url: {name} is not valid" + _SPILLED) from None
    return out


def parse_url(url: str, **overrides: Any) -> Settings:
    """Settings from a Redis URL; keyword arguments override what the URL says."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, not {type(url).__name__}")
    # No message below quotes the URL: it may carry a password.
    try:
        parts = urlsplit(url)
    except ValueError as e:
        # Python's message may quote the whole host part, password included.
        reason = "its host part is malformed" if "@" in url else e
        raise ValueError(f"url is not a valid Redis URL: {reason}") from None
    spilled = "@" in parts.path + parts.query + parts.fragment
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"url is not a valid Redis URL: {'bad port' + _SPILLED if spilled else e}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"url scheme must be redis://, rediss:// or unix://, not {parts.scheme + '://'!r}")
    found: dict[str, Any] = {}
    if parts.username:
        found["username"] = unquote(parts.username)
    if parts.password:
        found["password"] = unquote(parts.password)
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("url: a unix:// URL needs the socket's path")
        found["path"] = unquote(parts.path)
    else:
        if parts.hostname:
            found["host"] = unquote(parts.hostname)
        if port is not None:
            found["port"] = str(port)
        db = parts.path.strip("/")
        if db:
            found["db"] = db
        found["tls"] = "true" if parts.scheme == "rediss" else "false"
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "password":
            raise ValueError(
                "url: put the password before the host (redis://user:password@host), not in the query"
            )
        found[name] = value
    settings = _options(found, from_url=True, hide=spilled)
    settings.update(_options(overrides, from_url=False))
    return Settings(**settings)


def from_redis_options(client: Any) -> tuple[str, dict[str, Any]]:
    """A URL and options reaching the same server, database and credentials as a redis-py client."""
    pool: Any = getattr(client, "connection_pool", None)  # redis-py's, checked by its connection_kwargs
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        raise TypeError(f"client must be a redis-py client (redis.Redis), not {type(client).__name__}")
    found: dict[str, Any] = {"db": kwargs.get("db", 0) or 0}
    if kwargs.get("path"):
        found["path"] = kwargs["path"]
        url = "unix:///"
    else:
        found["host"] = kwargs.get("host", "127.0.0.1")
        found["port"] = int(kwargs.get("port", 6379))
        url = "redis://"
    provider = kwargs.get("credential_provider")
    if provider is not None:
        credentials = provider.get_credentials()
        found["username"], found["password"] = (
            credentials if len(credentials) == 2 else (None, credentials[0])
        )
    else:
        found["username"] = kwargs.get("username")
        found["password"] = kwargs.get("password")
    for theirs, ours in (("socket_timeout", "socket_timeout"), ("socket_connect_timeout", "connect_timeout")):
        if kwargs.get(theirs) is not None:
            found[ours] = float(kwargs[theirs])
    if "ssl" in pool.connection_class.__name__.lower():
        found["tls"] = True
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if kwargs.get(name):
                found[name] = kwargs[name]
        if kwargs.get("ssl_cert_reqs") is not None:
            reqs = kwargs["ssl_cert_reqs"]
            found["ssl_cert_reqs"] = (
                reqs if isinstance(reqs, str) else {0: "none", 1: "optional"}.get(int(reqs), "required")
            )
        found["ssl_check_hostname"] = bool(kwargs.get("ssl_check_hostname", True))
    return url, found
