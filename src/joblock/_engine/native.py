"""The server's own compare-and-act commands, where it has them, found by asking it.

A plain lock nobody waits for is released by a compare-and-delete and extended by a
compare-and-set of its ttl. Servers that have these as commands run them several
times faster than any script: Valkey >= 9.0 ``DELIFEQ key value``, Redis >= 8.4 and
Valkey >= 9.2 ``DELEX key IFEQ value``, Valkey >= 8.1 and Redis >= 8.4 ``SET key
value IFEQ value PX ms``. Valkey reports ``redis_version:7.2.4``, so no version
string says which a server has: each connection asks it in its handshake (``PROBE``),
and ``Dialect`` is the answer. Elsewhere the same steps run as the scripts
``RELEASE_PLAIN`` and ``EXTEND_PLAIN``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = ["PROBE", "Dialect", "dialect"]

# Asked when ``native_commands`` is on, after the rest of the handshake. Neither may
# fail the connection: a server or an ACL that refuses them leaves the scripts in use.
PROBE: list[tuple[Any, ...]] = [("COMMAND", "INFO", "DELIFEQ", "DELEX"), ("COMMAND", "DOCS", "SET")]

_DELIFEQ = (b"*3\r\n$7\r\nDELIFEQ\r\n", b"")
_DELEX = (b"*4\r\n$5\r\nDELEX\r\n", b"$4\r\nIFEQ\r\n")
_SET = b"*7\r\n$3\r\nSET\r\n"
_IFEQ = b"$4\r\nIFEQ\r\n"


class Dialect:
    """The native release (DELIFEQ or DELEX IFEQ) and extend (SET IFEQ PX) of one server."""

    __slots__ = ("extend", "release")

    def __init__(self, release: tuple[bytes, bytes] | None, extend: bool) -> None:
        self.release = release
        self.extend = extend

    def encode(
        self, core: ModuleType, keys: list[bytes], values: list[bytes], arg: int | None
    ) -> bytes | None:
        """The release (``arg`` None) or extend by ``arg`` ms of each key whose lock holds
        its value, as this server's own commands; None where it has no such command."""
        if arg is None:
            if self.release is None:
                return None
            head, middle = self.release
            return core.encode_compare(head, keys, values, middle, b"", False)  # type: ignore[no-any-return]
        if not self.extend:
            return None
        ms = b"%d" % arg
        tail = b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
        return core.encode_compare(_SET, keys, values, _IFEQ, tail, True)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        release = "DELIFEQ" if self.release is _DELIFEQ else "DELEX IFEQ" if self.release else "script"
        return f"Dialect(release={release}, extend={'SET IFEQ' if self.extend else 'script'})"


def _mentions(reply: Any, word: bytes) -> bool:
    """Whether ``word`` stands anywhere in a (nested) reply, in any case."""
    if isinstance(reply, list):
        return any(_mentions(item, word) for item in reply)
    return isinstance(reply, bytes) and reply.upper() == word


def dialect(info: Any, docs: Any) -> Dialect | None:
    """The dialect the replies to ``PROBE`` describe; None when the server has no native form."""
    release = None
    if isinstance(info, list) and len(info) == 2:
        if isinstance(info[0], list):
            release = _DELIFEQ
        elif isinstance(info[1], list):
            release = _DELEX
    extend = _mentions(docs, b"IFEQ")
    return Dialect(release, extend) if release is not None or extend else None
