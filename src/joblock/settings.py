"""Where and how to reach Redis: parsed from a URL, with keyword overrides.

``redis://[[user]:[password]@]host[:port][/db][?option=value...]``, ``rediss://`` for
TLS, ``unix://[[user]:[password]@]/path/to.sock[?db=N]``, and
``redis+sentinel://[[user]:[password]@]host[:port][,host[:port]...]/service[/db]``
(``rediss+sentinel://`` for TLS) for a primary that Redis Sentinel names: the hosts
are the sentinels, the credentials the primary's, and ``sentinel_username`` and
``sentinel_password`` the sentinels' own. Passwords are kept out of every repr and
error message.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypedDict
from urllib.parse import parse_qsl, quote, unquote, urlsplit

__all__ = ["ConnectionOptions", "Settings", "check_bool", "from_redis_options", "parse_url"]

_CERT_REQS = ("none", "optional", "required")
# Most replicas a grant may wait for (min_replicas): far beyond any deployment, a bound on typos.
MAX_REPLICAS = 100


def check_bool(value: object, name: str) -> bool:
    """Checks a boolean option of any client, call or decorator: True or False only.

    Truthiness would read ``fair="no"`` or ``shared="false"`` as True: a lock the
    caller did not ask for, taken without a word.
    """
    if value is True or value is False:
        return value
    raise TypeError(f"{name} must be a bool, not {type(value).__name__}")


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
    # Grants and extends confirmed by this many replicas (WAIT) before they are handed out.
    min_replicas: int = 0
    replica_timeout: float = 0.5
    # Plain locks released and extended by the server's own compare-and-act commands
    # (DELIFEQ, DELEX IFEQ, SET IFEQ) where it has them (each connection asks), else by scripts.
    native_commands: bool = True
    # Redis Sentinel: the primary's service name, and the sentinels to ask for it. The
    # settings of a discovered primary keep the name and drop the sentinels.
    service: str | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    @property
    def address(self) -> str:
        """Where the server is, for messages: ``host:port``, the socket's path, or the sentinels'."""
        if self.sentinels:
            return f"the primary {self.service!r} of the sentinels at {_hosts(self.sentinels)}"
        return self.path if self.path is not None else f"{_host(self.host)}:{self.port}"

    @property
    def found(self) -> bool:
        """Whether these settings say where the server is (a Sentinel service's primary is asked for)."""
        return not self.sentinels

    def url(self) -> str:
        """The URL without the passwords (shown as ``***`` when there are some)."""
        auth = ""
        if self.username or self.password:
            auth = f"{self.username or ''}{':***' if self.password else ''}@"
        if self.path is not None:
            return f"unix://{auth}{self.path}?db={self.db}"
        if self.sentinels:
            scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
            query = "&".join(
                f"{name}={shown}"
                for name, shown in (
                    ("sentinel_username", self.sentinel_username),
                    ("sentinel_password", self.sentinel_password and "***"),
                )
                if shown
            )
            query = "?" + query if query else ""
            return f"{scheme}://{auth}{_hosts(self.sentinels)}/{self.service}/{self.db}{query}"
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}{_host(self.host)}:{self.port}/{self.db}"

    def __repr__(self) -> str:
        return f"Settings({self.url()!r})"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _hosts(hosts: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{_host(host)}:{port}" for host, port in hosts)


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
    min_replicas: int
    replica_timeout: float
    native_commands: bool
    sentinel_username: str | None
    sentinel_password: str | None


_FLOATS = ("connect_timeout", "socket_timeout", "replica_timeout")
_INTS = ("db", "port", "retries", "min_replicas")
_BOOLS = ("tls", "ssl_check_hostname", "keepalive", "native_commands")
_STRS = (
    "host", "path", "username", "password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "client_name",
    "sentinel_username", "sentinel_password",
)  # fmt: skip
# Set by a redis+sentinel:// URL's host and path parts only.
_URL_ONLY = ("service", "sentinels")
_ALIASES = {"socket_connect_timeout": "connect_timeout", "ssl": "tls", "socket_keepalive": "keepalive"}


def _coerce(name: str, value: Any, from_url: bool, label: str) -> Any:
    """Checks (and, for values read from a URL, converts) one setting; messages name it
    ``label``, as the caller spelled it (``ssl`` for ``tls``)."""
    if value is None and name in _STRS:
        return None
    if name in _FLOATS:
        if from_url:
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"{label} must be a number of seconds, not {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{label} must be a number of seconds, not {type(value).__name__}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{label} must be a finite number of seconds > 0, not {value!r}")
        return float(value)
    if name in _INTS:
        if from_url:
            if not str(value).isdigit():
                raise ValueError(f"{label} must be a whole number, not {value!r}")
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, not {type(value).__name__}")
        if (
            value < 0
            or (name == "port" and not 0 < value < 65536)
            or (name == "min_replicas" and value > MAX_REPLICAS)
        ):
            raise ValueError(f"{label} is out of range: {value}")
        return value
    if name in _BOOLS:
        if from_url:
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(f"{label} must be true or false, not {value!r}")
            value = value.lower() in ("1", "true", "yes")
        return check_bool(value, label)
    if name == "ssl_cert_reqs":
        value = str(value).lower().removeprefix("cert_")
        if value not in _CERT_REQS:
            raise ValueError(f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{label} must be a str, not {type(value).__name__}")
    return value


# A password with an unescaped '/', '?' or '#' ends the host part early and spills
# into the port, path or query; messages about those parts then quote nothing.
_SPILLED = (
    " (not shown: the url has an '@' after its host, so this may be part of a password;"
    " write '/', '?' and '#' in a password as %2F, %3F and %23)"
)


def _options(pairs: dict[str, Any], from_url: bool, hide: bool = False) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(Settings)} - set(_URL_ONLY)
    out = {}
    for given, value in pairs.items():
        name = _ALIASES.get(given, given)
        if name not in fields:
            raise TypeError(
                "url: unknown connection option" + _SPILLED if hide else f"unknown connection option {name!r}"
            )
        try:
            out[name] = _coerce(name, value, from_url, given)
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
    found: dict[str, Any] = {}
    sentinel: dict[str, Any] = {}
    if parts.scheme in ("redis+sentinel", "rediss+sentinel"):
        sentinel = _sentinel_parts(parts.netloc, parts.path, spilled)
        found["tls"] = "true" if parts.scheme == "rediss+sentinel" else "false"
        if "db" in sentinel:
            found["db"] = sentinel.pop("db")
        port = None
    else:
        try:
            port = parts.port
        except ValueError as e:
            reason = "bad port" + _SPILLED if spilled else e
            raise ValueError(f"url is not a valid Redis URL: {reason}") from None
    if parts.scheme not in ("redis", "rediss", "unix") and not sentinel:
        raise ValueError(
            "url scheme must be redis://, rediss://, unix:// or redis+sentinel://,"
            f" not {parts.scheme + '://'!r}"
        )
    if parts.username:
        found["username"] = unquote(parts.username)
    if parts.password:
        found["password"] = unquote(parts.password)
    if sentinel:
        pass  # the hosts are the sentinels': taken apart above
    elif parts.scheme == "unix":
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
    settings.update(sentinel)
    made = Settings(**settings)
    # A WAIT that outlasts socket_timeout would end its connection: refused now when it
    # was asked for (replica_timeout given, or grants confirmed by default), not at the
    # first call. A call's own min_replicas on a client of neither is checked then.
    if (made.min_replicas or "replica_timeout" in settings) and made.replica_timeout >= made.socket_timeout:
        raise ValueError(replica_timeout_error(made))
    return made


def replica_timeout_error(s: Settings) -> str:
    return (
        f"replica_timeout ({s.replica_timeout} s) must be shorter than socket_timeout"
        f" ({s.socket_timeout} s): a WAIT that outlasts it would end the connection"
    )


def _sentinel_parts(netloc: str, path: str, spilled: bool) -> dict[str, Any]:
    """The sentinels, the service name and the db of a ``redis+sentinel://`` URL."""
    hosts = netloc.rpartition("@")[2]  # the credentials before it are the primary's
    sentinels = []
    for host in hosts.split(","):
        name, port = host, "26379"
        if host.startswith("["):
            name, _, rest = host[1:].partition("]")
            if rest:
                port = rest.removeprefix(":")
        elif ":" in host:
            name, _, port = host.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            bad = "a sentinel's address is malformed" + (_SPILLED if spilled else "")
            raise ValueError(f"url is not a valid Redis URL: {bad}")
        sentinels.append((unquote(name), int(port)))
    service, _, db = path.strip("/").partition("/")
    if spilled:
        raise ValueError("url is not a valid Redis URL: its service name is malformed" + _SPILLED)
    if not service:
        raise ValueError(
            "url: a redis+sentinel:// URL needs the primary's service name after the sentinels"
            " (redis+sentinel://host:26379,host:26379/mymaster/0)"
        )
    out: dict[str, Any] = {"sentinels": tuple(sentinels), "service": unquote(service)}
    if db:
        out["db"] = db
    return out


def from_redis_options(client: Any) -> tuple[str, dict[str, Any]]:
    """A URL and options reaching the same server, database and credentials as a redis-py client."""
    pool: Any = getattr(client, "connection_pool", None)  # redis-py's, checked by its connection_kwargs
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        raise TypeError(f"client must be a redis-py client (redis.Redis), not {type(client).__name__}")
    found: dict[str, Any] = {"db": kwargs.get("db", 0) or 0}
    service = getattr(pool, "service_name", None)
    manager = getattr(pool, "sentinel_manager", None)
    if service is not None and manager is not None:  # redis.sentinel.Sentinel(...).master_for(service)
        sentinels = []
        for sentinel in manager.sentinels:
            theirs = sentinel.connection_pool.connection_kwargs
            sentinels.append((theirs.get("host", "127.0.0.1"), int(theirs.get("port", 26379))))
            found["sentinel_username"] = theirs.get("username")
            found["sentinel_password"] = theirs.get("password")
        scheme = "rediss+sentinel" if "ssl" in pool.connection_class.__name__.lower() else "redis+sentinel"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in sentinels)
        url = f"{scheme}://{hosts}/{quote(service, safe='')}"
    elif kwargs.get("path"):
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
