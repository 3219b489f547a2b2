"""joblock's core in pure Python: the twin of ``_core_c.pyx``.

Both twins expose the same functions with the same results and the same errors (a
differential test holds them to it). This one runs wherever the compiled wheel or a
compiler is missing; it parses replies with ``hiredis.Reader`` when hiredis is
importable and with :class:`PyReader` otherwise.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

from ._scripts import MARK
from ._slot_tags import COUNTER, TAGS
from .errors import LockLost, ProtocolError, ReplyError

MAX_KEY_BYTES = 65536
# Identifiers longer than this become "#" + a 128-bit BLAKE2b digest, so keys stay
# short whatever the job's arguments are.
MAX_IDENTIFIER_BYTES = 200
MAX_DEPTH = 32
_RANDOM_POOL = 4096  # bytes of randomness drawn from the OS at once for single tokens

# Bytes that the key grammar uses (or Redis Cluster reads as hash tags) are written
# as %XX inside names, strings and bytes, so keys built from different arguments
# never collide. Bytes >= 0x80 are escaped only inside bytes arguments (str keeps its
# UTF-8 readable, bytes may not be valid UTF-8).
_SPECIAL = b"%-:{}'()[],=# "
_TEXT_ESCAPES = {c: b"%%%02X" % c for c in [*_SPECIAL, *range(0x20), 0x7F]}
_BYTES_ESCAPES = {**_TEXT_ESCAPES, **{c: b"%%%02X" % c for c in range(0x80, 0x100)}}
_TEXT_TABLE = [_TEXT_ESCAPES.get(c, bytes((c,))) for c in range(256)]
_BYTES_TABLE = [_BYTES_ESCAPES.get(c, bytes((c,))) for c in range(256)]
_NEEDS_ESCAPE = bytes(range(256)).translate(None, bytes(c for c in range(256) if c not in _TEXT_ESCAPES))
# A str that could read as another type's rendering is quoted: '42' is not 42.
_RESERVED = frozenset((b"None", b"True", b"False", b"nan", b"inf"))


def _escape(raw: bytes, table: list[bytes]) -> bytes:
    return b"".join([table[c] for c in raw])


def _utf8(s: str, where: str) -> bytes:
    try:
        return str.encode(s)
    except UnicodeEncodeError:
        raise ValueError(f"{where}: str with lone surrogates cannot be encoded as UTF-8") from None


def _text(s: str, where: str) -> bytes:
    raw = _utf8(s, where)
    if raw.translate(None, _NEEDS_ESCAPE) != raw:
        raw = _escape(raw, _TEXT_TABLE)
    if not raw or 0x30 <= raw[0] <= 0x39 or raw in _RESERVED:
        return b"'" + raw + b"'"
    return raw


def _token(value: Any, where: str, depth: int) -> bytes:
    # Subclasses (IntEnum, str-based enums, namedtuples...) render as their base type.
    if value is None:
        return b"None"
    if value is True:
        return b"True"
    if value is False:
        return b"False"
    if isinstance(value, str):
        return _text(value, where)
    if isinstance(value, int):
        return int.__repr__(value).encode()
    if isinstance(value, float):
        return float.__repr__(value).encode()
    if isinstance(value, bytes):
        return b"b'" + _escape(value, _BYTES_TABLE) + b"'"
    if depth >= MAX_DEPTH:
        raise ValueError(f"{where}: arguments nest deeper than {MAX_DEPTH} levels")
    if isinstance(value, (tuple, list)):
        return b"[" + b",".join([_token(v, where, depth + 1) for v in value]) + b"]"
    if isinstance(value, dict):
        return b"(" + _pairs(value, where, depth + 1, b",") + b")"
    raise TypeError(
        f"{where}: cannot build a lock key from {type(value).__name__!r}; pass str, int, float, "
        "bool, None, bytes, or a list, tuple or dict of those (or give the job an identifier)"
    )


def _pairs(mapping: Mapping[Any, Any], where: str, depth: int, sep: bytes) -> bytes:
    return sep.join(
        sorted([_token(k, where, depth) + b"=" + _token(v, where, depth) for k, v in mapping.items()])
    )


def _identifier(args: Sequence[Any], kwargs: Mapping[str, Any] | None, where: str) -> bytes:
    parts = [_token(a, f"{where}[{i}]", 0) for i, a in enumerate(args)]
    if kwargs:
        for name, value in sorted(kwargs.items()):
            where = f"kwargs[{name!r}]"
            parts.append(_text(name, where) + b"=" + _token(value, where, 0))
    ident = b"-".join(parts)
    if len(ident) > MAX_IDENTIFIER_BYTES:
        return b"#" + hashlib.blake2b(ident, digest_size=16).hexdigest().encode()
    return ident


def _job(job: object) -> bytes:
    if type(job) is not str:
        raise TypeError(f"job must be a str, not {type(job).__name__}")
    if not job:
        raise ValueError("job must not be empty")
    return _escape(_utf8(job, "job"), _TEXT_TABLE)


def _join(head: bytes, ident: bytes) -> bytes:
    return head + b":" + ident if ident else head


def _head(prefix: bytes, job: object) -> bytes:
    return prefix + b":" + _job(job) if prefix else _job(job)


def build_key(prefix: bytes, job: str, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> bytes:
    """``prefix:job:identifier``; the identifier renders args then sorted kwargs, joined by ``-``."""
    return _join(_head(prefix, job), _identifier(args, kwargs, "args"))


def build_keys(prefix: bytes, job: str, arg_tuples: list[Any], start: int) -> list[bytes]:
    """The keys of ``dedupe``: one per argument tuple; ``start`` numbers them in errors."""
    head = _head(prefix, job)
    keys = []
    for i, args in enumerate(arg_tuples, start):
        if type(args) is not tuple and type(args) is not list:
            raise TypeError(f"arg_tuples[{i}] must be a tuple of arguments, not {type(args).__name__}")
        keys.append(_join(head, _identifier(args, None, f"arg_tuples[{i}]")))
    return keys


def as_key(key: object, where: str = "key") -> bytes:
    """A lock key given by the user as str (UTF-8) or bytes (as is), checked."""
    if isinstance(key, str):
        raw = _utf8(key, where)
    elif isinstance(key, bytes):
        raw = bytes(key)
    else:
        raise TypeError(f"{where} must be str or bytes, not {type(key).__name__}")
    if not raw:
        raise ValueError(f"{where} must not be empty")
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"{where} is {len(raw)} bytes long; the limit is {MAX_KEY_BYTES}")
    return raw


def as_keys(keys: list[Any], start: int) -> list[bytes]:
    return [as_key(k, f"keys[{i}]") for i, k in enumerate(keys, start)]


def fence_key(key: bytes) -> bytes:
    """The fencing counter of ``key``: the one of its Redis Cluster hash slot, which all
    the keys of that slot share (docs/keys.md).

    A key with a "}" but no hash tag is refused, as waiting refuses it: the scripts name
    a lock's other keys (its waiters' queue, and the per-key counter that earlier releases kept
    and that they fold into the slot's) by its hash tag."""
    start = key.find(b"{")
    tagged = start >= 0 and key.find(b"}", start + 1) > start + 1
    if not tagged and b"}" in key:
        raise ValueError(f"fence=True needs a key without an unmatched '}}': {key!r}")
    slot = 3 * key_slot(key)
    return COUNTER % TAGS[slot : slot + 3]


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
        table.append(crc)
    return table


_CRC16 = _crc16_table()
SLOTS = 16384


def _cluster_bytes(data: object, name: str) -> bytes:
    if not isinstance(data, bytes):
        raise TypeError(f"{name} must be bytes, not {type(data).__name__}")
    return data


def crc16(data: bytes) -> int:
    """CRC16-XMODEM (polynomial 0x1021, initial 0), the checksum Redis Cluster hashes keys with."""
    crc = 0
    table = _CRC16
    for c in _cluster_bytes(data, "data"):
        crc = ((crc << 8) & 0xFFFF) ^ table[(crc >> 8) ^ c]
    return crc


def key_slot(key: bytes) -> int:
    """The Redis Cluster hash slot of ``key`` (0..16383), hash tags included.

    When the key has a ``{`` followed later by a ``}`` with at least one byte between
    them, only the bytes between the first ``{`` and the first ``}`` after it are
    hashed, so ``{user1}.a`` and ``{user1}.b`` share a slot. ``{}`` is no tag.
    """
    key = _cluster_bytes(key, "key")
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc16(key) & (SLOTS - 1)


def key_slots(keys: list[bytes]) -> list[int]:
    """``key_slot`` of each key, in order."""
    if type(keys) is not list:
        raise TypeError(f"keys must be a list, not {type(keys).__name__}")
    return [key_slot(k) for k in keys]


# Single tokens' random bytes come from a pool the OS fills _RANDOM_POOL bytes at once (see
# _core_c's pool). No lock: each token takes a slot from the pool's own counter (a C
# iterator: no two threads get the same), and the bytes, the counter and the process
# they are for are swapped as one tuple. A forked child refills (its parent draws the
# same bytes), also when forked without Python's at-fork hooks.
_pool: list[tuple[bytes, Iterator[int], int]] = [(b"", itertools.count(), -1)]


def new_values(n: int, holder: bytes) -> list[bytes]:
    """``n`` lock values: 128 random bits from the OS's CSPRNG in hex, then the holder."""
    if n < 0:
        raise ValueError(f"n must not be negative, not {n}")
    if n == 1:
        left, slots, pid = _pool[0]
        at = next(slots) * 16
        if at >= len(left) or pid != os.getpid():  # used up, or the parent's: a new pool, its first slot ours
            left, slots, pid = _pool[0] = (os.urandom(_RANDOM_POOL), itertools.count(1), os.getpid())
            at = 0
        return [left[at : at + 16].hex().encode() + holder]
    hexes = os.urandom(16 * n).hex().encode()
    return [hexes[i : i + 32] + holder for i in range(0, 32 * n, 32)]


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def encode_command(args: Iterable[bytes | str | int]) -> bytes:
    """One command in RESP, its arguments given as bytes, str (UTF-8) or int."""
    parts = []
    for arg in args:
        if type(arg) is str:
            arg = arg.encode()
        elif type(arg) is int:
            arg = b"%d" % arg
        elif type(arg) is not bytes:
            raise TypeError(f"command arguments must be bytes, str or int, not {type(arg).__name__}")
        parts.append(_bulk(arg))
    return b"*%d\r\n" % len(parts) + b"".join(parts)


def _check_window(keys: list[bytes], values: list[bytes]) -> None:
    if len(keys) != len(values):
        raise ValueError("keys and values differ in length")


def _arg(arg: object) -> bytes:
    if type(arg) is int:
        return b"%d" % arg
    if type(arg) is not bytes:
        raise TypeError(f"command arguments must be bytes or int, not {type(arg).__name__}")
    return arg


def encode_acquire(
    keys: list[bytes], values: list[bytes], ms: int, sha: bytes | None, extra: tuple[bytes | int, ...] = ()
) -> bytes:
    """A window of ``SET key value NX PX ms GET``, or with ``sha`` of a script's
    ``EVALSHA sha 2 key fence_key value ms *extra`` (the fenced-acquire script, or the
    counting-lock script with its further arguments)."""
    _check_window(keys, values)
    if sha is None and extra:
        raise ValueError("extra arguments go to a script: give its sha")
    tail = _bulk(b"%d" % ms)
    if sha is None:
        head = b"*7\r\n$3\r\nSET\r\n"
        tail = b"$2\r\nNX\r\n$2\r\nPX\r\n" + tail + b"$3\r\nGET\r\n"
        return b"".join([head + _bulk(k) + _bulk(v) + tail for k, v in zip(keys, values)])
    head = b"*%d\r\n$7\r\nEVALSHA\r\n" % (7 + len(extra)) + _bulk(sha) + b"$1\r\n2\r\n"
    tail += b"".join([_bulk(_arg(arg)) for arg in extra])
    return b"".join([head + _bulk(k) + _bulk(fence_key(k)) + _bulk(v) + tail for k, v in zip(keys, values)])


def encode_compare(
    head: bytes, keys: list[bytes], values: list[bytes], middle: bytes, tail: bytes, twice: bool
) -> bytes:
    """A window of ``head key [value] middle value tail`` per key (``value`` twice with
    ``twice``): a compare-and-act command, the server's own (DELIFEQ, SET IFEQ) or EVALSHA."""
    _check_window(keys, values)
    if twice:
        return b"".join([head + _bulk(k) + _bulk(v) + middle + _bulk(v) + tail for k, v in zip(keys, values)])
    return b"".join([head + _bulk(k) + middle + _bulk(v) + tail for k, v in zip(keys, values)])


def encode_evalsha(sha: bytes, keys: list[bytes], values: list[bytes], arg: int | None) -> bytes:
    """A window of ``EVALSHA sha 1 key value [arg]``: release, extend and remaining."""
    if arg is None:
        return encode_compare(
            b"*5\r\n$7\r\nEVALSHA\r\n" + _bulk(sha) + b"$1\r\n1\r\n", keys, values, b"", b"", False
        )
    head = b"*6\r\n$7\r\nEVALSHA\r\n" + _bulk(sha) + b"$1\r\n1\r\n"
    return encode_compare(head, keys, values, b"", _bulk(b"%d" % arg), False)


class LeaseOwner(Protocol):
    """The client whose lock a Lease is, as a lease of a threaded client sees it.

    An AsyncLocks owner returns coroutines instead; type checkers see its leases as
    ``joblock.aio.AsyncLease``.
    """

    def _release(self, lease: Lease) -> bool: ...
    def _extend(self, lease: Lease, ttl: float | timedelta, min_replicas: int | None) -> bool: ...
    def _remaining(self, lease: Lease) -> float | None: ...
    def _exit(self, lease: Lease) -> None: ...
    def _lost_signal(self, lease: Lease) -> Any: ...


class LeaseWatch(Protocol):
    """What a lease tells of itself (``joblock.lost.Watch``): that it is lost, and that its
    deadline moved."""

    def __call__(self, lease: Any) -> None: ...
    def moved(self, lease: Any) -> None: ...


class Sure:
    """What a lease knows of how long it is sure of its lock (``RedlockLease`` has it too)."""

    __slots__ = ()

    key: Any
    _owner: Any
    _deadline: float
    _lost: str | None

    @property
    def lost(self) -> Any:
        """Set once the lease cannot be sure it holds its lock: a ``threading.Event``-like
        object (``is_set()``, ``wait(timeout)``), awaitable with an asyncio client."""
        return self._owner._lost_signal(self)

    def check(self) -> None:
        """Raises LockLost, naming the key and why, once the lease is lost."""
        cause = loss(self)  # type: ignore[arg-type]  # any lease: loss reads its attributes
        if cause is not None:
            raise LockLost(self.key, cause)

    def valid_for(self) -> float:
        """Seconds the lease is sure to hold its lock, by its local deadline (0.0 once lost)."""
        if loss(self) is not None:  # type: ignore[arg-type]
            return 0.0
        return max(0.0, self._deadline - time.monotonic())


class Lease(Sure):
    """A granted lock: its key, its token, and (with ``fence=True``) its fencing number.

    ``release()`` returns False when the lock had expired or been taken before the
    release (resque-lock-timeout's ``lock_expired_before_release``); ``extend(ttl)``
    returns True while the lock is still ours. Usable as a context manager that
    releases on exit.
    """

    __slots__ = (
        "_deadline",
        "_fence",
        "_handed_over",
        "_held",
        "_key",
        "_lost",
        "_name",
        "_owner",
        "_stamp",
        "_value",
        "_watch",
    )

    _owner: LeaseOwner
    _key: bytes
    _name: str | bytes | None
    _value: bytes
    _fence: int | None
    _held: bool
    # The monotonic time until which the lease is sure of its lock (0.0: not known, for
    # a lease adopted from another process until an extend confirms it); why it was
    # lost (None while it holds); and what to call when it is lost (joblock.lost's guard).
    _deadline: float
    _lost: str | None
    _watch: LeaseWatch | None
    # Whether a release handed it the lock: its release and extend then go by the scripts
    # at once (joblock._scripts, MARK). A lock waited for is likely waited for again, and a
    # waiter that queues after the hand-off marks the lock: the plain command would find
    # the mark, and a second round trip, the script's, would follow.
    _handed_over: bool
    # Set by joblock.metrics while instrumented (grant time, job), else unset: no cost per grant.
    _stamp: tuple[float, str | None] | None  # set by joblock.metrics while instrumented

    def __init__(self) -> None:
        raise TypeError("leases come from Locks.acquire and its kin")

    @property
    def key(self) -> str | bytes:
        """The key as given (str or bytes); built keys are str."""
        return self._key.decode() if self._name is None else self._name

    @property
    def token(self) -> bytes:
        """The lock's value in Redis: a fresh 128-bit token, then the holder's host and pid
        (``~`` before them for a counting lock's holder, ``#`` and its fence after)."""
        return self._value

    @property
    def fence(self) -> int | None:
        """The fencing number of a lease acquired with ``fence=True``, else None."""
        return self._fence

    @property
    def held(self) -> bool:
        """False once released, or once an extend found the lock gone (local knowledge)."""
        return self._held

    # With an AsyncLocks owner these return awaitables: ``await lease.release()``.

    def release(self) -> bool:
        """True once released; False when it had expired or been taken (or was released)."""
        return self._owner._release(self)

    def extend(self, ttl: float | timedelta, *, min_replicas: int | None = None) -> bool:
        """True while the lock is ours (its ttl is now ``ttl``), else False. With
        ``min_replicas`` (default: the client's), only once that many replicas
        acknowledged it; else the lock is released and ReplicationError raised."""
        return self._owner._extend(self, ttl, min_replicas)

    def remaining(self) -> float | None:
        """Seconds left on the lock per Redis while it is ours, else None."""
        return self._owner._remaining(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._owner._exit(self)

    def __repr__(self) -> str:
        state = "held" if self._held else "released"
        fence = "" if self._fence is None else f" fence={self._fence}"
        return f"<Lease {self.key!r} {state}{fence}>"


def make_leases(
    owner: Any,
    keys: list[bytes],
    names: list[Any] | None,
    values: list[bytes],
    replies: list[Any],
    deadline: float,
) -> tuple[list[Any], int]:
    """Leases (or None where busy) from an acquire window's replies, each sure of its
    lock until ``deadline`` (monotonic seconds).

    Error replies stay in place as ReplyError objects; the count of them is returned
    so the caller can reload a script or give up.
    """
    out: list[Any] = []
    errors = 0
    for i, reply in enumerate(replies):
        if reply is None:
            out.append(None)
            continue
        if type(reply) is ReplyError:
            errors += 1
            out.append(reply)
            continue
        out.append(
            make_lease(owner, keys[i], None if names is None else names[i], values[i], reply, deadline)
        )
    return out, errors


def make_lease(owner: Any, key: bytes, name: Any, value: bytes, reply: Any, deadline: float) -> Lease:
    """The lease a single acquire's grant (``reply``: b"OK" or a fencing number) makes."""
    lease = Lease.__new__(Lease)
    lease._owner = owner
    lease._key = key
    lease._name = name
    lease._value = value
    lease._fence = reply if type(reply) is int else None
    lease._held = True
    lease._deadline = deadline
    lease._lost = None
    lease._watch = None
    lease._handed_over = False
    return lease


def lose(lease: Lease, cause: str) -> None:
    """Marks ``lease`` lost for ``cause`` (the first cause stays) and tells its watch."""
    if lease._lost is None:
        lease._lost = cause
        watch = lease._watch
        if watch is not None:
            watch(lease)


def loss(lease: Lease) -> str | None:
    """Why ``lease`` is lost, or None while it is sure of its lock; a deadline found
    passed is marked as its loss (a lease once lost stays lost)."""
    if lease._lost is None and 0.0 < lease._deadline <= time.monotonic():
        lose(lease, "deadline")
    return lease._lost


def confirm(lease: Lease, reply: Any, deadline: float | None) -> bool:
    """What a release's (``deadline`` None) or extend's reply (1 done, 0 gone, -1 another's)
    says of ``lease``: True when done. An extend done in time moves its deadline to
    ``deadline``; one that came after the old deadline leaves the lease lost, as are the
    leases it did not extend."""
    ok = type(reply) is int and reply > 0
    if deadline is None:
        lease._held = False
        lose(lease, "ended" if ok else "taken" if reply == -1 else "expired")
    elif not ok:
        lease._held = False
        lose(lease, "taken" if reply == -1 else "expired")
    elif loss(lease) is None:
        lease._deadline = deadline
        if lease._watch is not None:  # the kernel's stop of its "exit" blocks moves too
            lease._watch.moved(lease)
    return ok


def claims(replies: list[Any], values: list[bytes]) -> list[Any]:
    """``SET NX GET`` replies as acquire replies, in place: ``b"OK"`` where the key was free
    (nil) or held our own value (a grant whose reply was lost; marked, if a waiter has
    queued since), None where it held another; error replies stay as they are."""
    for i in range(min(len(replies), len(values))):
        reply = replies[i]
        if reply is None:
            replies[i] = b"OK"
        elif type(reply) is bytes:
            replies[i] = b"OK" if mine(reply, values[i]) else None
    return replies


def mine(reply: bytes, value: bytes) -> bool:
    """Whether a lock's value ``reply`` is ``value``'s: the token itself, or the token
    marked by a waiter that queued for the lock."""
    return reply == value or (len(reply) == len(value) + len(MARK) and reply == value + MARK)


def error_positions(replies: list[Any]) -> list[int]:
    """Positions of the error replies among ``replies``."""
    return [i for i, r in enumerate(replies) if type(r) is ReplyError]


def lease_fields(leases: list[Any], start: int) -> tuple[list[int], list[bytes], list[bytes]]:
    """Positions, keys and values of the held leases among ``leases`` (None is skipped)."""
    idx = []
    keys = []
    values = []
    for i, lease in enumerate(leases):
        if lease is None:
            continue
        if type(lease) is not Lease:
            raise TypeError(f"leases[{start + i}] must be a Lease or None, not {type(lease).__name__}")
        if lease._held:
            idx.append(i)
            keys.append(lease._key)
            values.append(lease._value)
    return idx, keys, values


def settle(
    leases: list[Any], idx: list[int], replies: list[Any], out: list[Any], drop_all: bool, deadline: float
) -> int:
    """Writes each reply's verdict (``confirm``'s) into ``out`` at its position.

    A lease whose verdict is False is no longer held; with ``drop_all`` (release) none
    is; an extended one is sure of its lock until ``deadline``. Error replies go into
    ``out`` as they are; their count is returned.
    """
    errors = 0
    for i, reply in zip(idx, replies):
        if type(reply) is ReplyError:
            errors += 1
            out[i] = reply
            continue
        out[i] = confirm(leases[i], reply, None if drop_all else deadline)
    return errors


class PyReader:
    """A RESP2 reply parser in Python, with ``hiredis.Reader``'s ``feed``/``gets``."""

    __slots__ = ("_buf", "_pos")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def gets(self) -> Any:
        """The next complete reply, or False when more bytes are needed."""
        try:
            reply, pos = self._parse(self._pos, 0)
        except _Incomplete:
            return False
        self._pos = pos
        return reply

    def _line(self, pos: int) -> tuple[bytes, int]:
        end = self._buf.find(b"\r\n", pos)
        if end < 0:
            raise _Incomplete
        return bytes(self._buf[pos:end]), end + 2

    def _parse(self, pos: int, depth: int) -> tuple[Any, int]:
        if pos >= len(self._buf):
            raise _Incomplete
        kind = self._buf[pos]
        line, pos = self._line(pos + 1)
        if kind == 0x2B:  # +
            return line, pos
        if kind == 0x2D:  # -
            return ReplyError(line.decode(errors="replace")), pos
        if kind == 0x3A:  # :
            return _integer(line), pos
        if kind == 0x24:  # $
            n = _integer(line)
            if n < 0:
                return None, pos
            if len(self._buf) < pos + n + 2:
                raise _Incomplete
            if self._buf[pos + n : pos + n + 2] != b"\r\n":
                raise ProtocolError("Protocol error: bulk string not terminated by CRLF")
            return bytes(self._buf[pos : pos + n]), pos + n + 2
        if kind == 0x2A:  # *
            n = _integer(line)
            if n < 0:
                return None, pos
            if depth >= MAX_DEPTH:
                raise ProtocolError("Protocol error: replies nest too deep")
            items = []
            for _ in range(n):
                item, pos = self._parse(pos, depth + 1)
                items.append(item)
            return items, pos
        raise ProtocolError(f'Protocol error, got "{chr(kind)}" as reply type byte')


class _Incomplete(Exception):
    pass


def _integer(line: bytes) -> int:
    digits = line[1:] if line[:1] == b"-" else line
    if not digits.isdigit() or len(digits) > 19 or not -(2**63) <= int(line) < 2**63:
        raise ProtocolError(f"Protocol error: bad integer {line[:32]!r}")
    return int(line)


def _hiredis_reader() -> Any:
    import hiredis

    return hiredis.Reader(replyError=ReplyError, protocolError=ProtocolError)


try:
    _hiredis_reader()
    Reader: Any = _hiredis_reader
except ImportError:
    Reader = PyReader


def receive(sock: Any, inbox: list[bytes], size: int) -> None:
    """One read of ``sock`` (up to ``size`` bytes), kept in ``inbox``. The read and the
    keeping are one C call (list.extend over map): a signal handler that raises just after
    the read (run between any two bytecodes) leaves the bytes kept, not lost."""
    inbox.extend(map(sock.recv, (size,)))


def take(reader: Any, out: list[Any], n: int) -> int:
    """Appends complete replies from ``reader`` to ``out`` until it holds ``n``."""
    while len(out) < n:
        reply = reader.gets()
        if reply is False:
            break
        out.append(reply)
    return len(out)
