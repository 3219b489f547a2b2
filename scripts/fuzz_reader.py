#!/usr/bin/env python3
"""Coverage-guided fuzzing of the compiled RESP reader against the pure one (atheris).

Each input is cut into pieces (bytes, bytearray or memoryview) and fed to the compiled
``Reader`` and to the pure ``PyReader``, reading replies with ``take`` a few at a time as
a connection does. Both must return the same replies and stop the same way (waiting for
more bytes, or the same ProtocolError); neither may crash, hang, or return a reply
without consuming input. The same pieces then go to the engine's ``Wire`` (compiled
with the core) as the replies of a few requests in flight: each request complete must
reach its operation with the replies the pure reader read. A difference raises, and
atheris saves the input as crash-*.

    pip install atheris
    python setup.py build_ext --inplace
    python scripts/fuzz_reader.py -atheris_runs=200000      # or -max_total_time=60
    python scripts/fuzz_reader.py corpus/ -max_total_time=600  # keeps what it finds

Run this way, atheris is guided by coverage of the Python side (the pure reader, whose
grammar the compiled one shares). For coverage of the C code itself, with AddressSanitizer
and UndefinedBehaviorSanitizer watching it, ``scripts/sanitize.sh --fuzz ARGS`` builds the
core with ``-fsanitize=address,undefined,fuzzer-no-link`` and runs this script on it.
Arguments are libFuzzer's; a RESP dictionary is added unless ``-dict=`` is given.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import tempfile
from typing import Any

import atheris

if importlib.util.find_spec("joblock") is None:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

with atheris.instrument_imports(include=["joblock"]):
    from joblock import _core_py
    from joblock._core import compiled
    from joblock._engine.ops import Operation
    from joblock._engine.requests import Request
    from joblock._engine.wire import Wire
    from joblock.errors import ConnectionError, ProtocolError, ReplyError
    from joblock.settings import parse_url

_core_c = compiled()
if _core_c is None:
    sys.exit("fuzz_reader: the compiled core is not built here (python setup.py build_ext --inplace)")

# Words of the grammar, so mutations reach deep replies quickly.
DICTIONARY = [
    b"\r\n", b"+", b"-", b":", b"$", b"*", b"-1", b"0", b"1", b"2", b"9223372036854775807",
    b"-9223372036854775808", b"9223372036854775808", b"+OK\r\n", b"$-1\r\n", b"*-1\r\n", b"*1\r\n",
    b"-NOSCRIPT No matching script\r\n", b"$3\r\nabc\r\n",
]  # fmt: skip


def plain(value: Any) -> Any:
    if isinstance(value, ReplyError):
        return ("error", type(value).__name__, value.message)
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def read(reader: Any, take: Any, pieces: list[Any], batch: int) -> tuple[list[Any], str]:
    """Every reply, read ``batch`` at a time after each piece, and how reading stopped."""
    out: list[Any] = []
    fed = 0
    try:
        for piece in pieces:
            reader.feed(piece)
            fed += len(piece)
            while True:
                want = len(out) + batch
                if take(reader, out, want) < want:
                    break
                # Every reply takes at least 3 bytes: more replies than bytes is a reader
                # that returns replies without consuming input (a hang on a socket).
                if len(out) > fed:
                    raise AssertionError(f"{len(out)} replies from {fed} bytes")
    except ProtocolError as e:
        return [plain(v) for v in out], f"ProtocolError: {e}"
    return [plain(v) for v in out], "incomplete"


KINDS = (bytes, bytearray, memoryview)

# The engine's wire (compiled where the core is), fed the same pieces as the replies of
# REQUESTS requests of ``batch`` commands each: every request complete must reach its
# operation with the very replies the pure reader reads, in order, until the bytes stop
# being RESP (ProtocolError) or a request's first reply is LOADING (the connection ends).
REQUESTS = 4
# No native commands: a wire that probes for them would take the first replies as the
# probes' answers, and the fuzzed replies are for the requests submitted here.
SETTINGS = parse_url("redis://127.0.0.1:6379/0?native_commands=false")


class Recorded(Operation):
    """An operation that keeps the replies of each of its requests."""

    __slots__ = ("replies",)

    def __init__(self) -> None:
        super().__init__(0)
        self.replies: list[Any] = []

    def answer(self, request: Any, replies: list[Any]) -> None:
        self.replies.append([plain(v) for v in replies])


def through_wire(pieces: list[Any], batch: int) -> tuple[list[Any], str]:
    wire = Wire(_core_c, SETTINGS, set())
    wire.connected()  # no AUTH, SELECT or name: ready at once
    op = Recorded()
    for _ in range(REQUESTS):
        wire.submit(Request(op, None, b"", batch))
    wire.output()
    try:
        for piece in pieces:
            wire.feed(piece)
    except ProtocolError as e:
        return op.replies, f"ProtocolError: {e}"
    except ConnectionError:
        return op.replies, "LOADING"
    return op.replies, "incomplete" if wire.busy() else "done"


def expected_of_wire(replies: list[Any], stop: str, batch: int) -> tuple[list[Any], str]:
    groups = [replies[i : i + batch] for i in range(0, min(len(replies), REQUESTS * batch), batch)]
    out = []
    for group in groups:
        if len(group) < batch:
            break
        first = group[0]
        if isinstance(first, tuple) and first[0] == "error" and first[2].startswith("LOADING "):
            return out, "LOADING"
        out.append(group)
    if len(out) == REQUESTS:
        return out, "done"
    return out, stop


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    batch = fdp.ConsumeIntInRange(1, 8)
    cuts = sorted(fdp.ConsumeIntInRange(0, 1 << 16) for _ in range(fdp.ConsumeIntInRange(0, 6)))
    kind = KINDS[fdp.ConsumeIntInRange(0, 2)]
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    bounds = [0, *sorted(c % (len(stream) + 1) for c in cuts), len(stream)]
    pieces = [kind(stream[a:b]) for a, b in itertools.pairwise(bounds)]
    compiled = read(_core_c.Reader(), _core_c.take, pieces, batch)
    pure = read(_core_py.PyReader(), _core_py.take, pieces, batch)
    if compiled != pure:
        pieces_note = f"{stream!r} in {len(pieces)} pieces"
        raise AssertionError(f"the readers disagree on {pieces_note}:\n{compiled}\n{pure}")
    got, expected = through_wire(pieces, batch), expected_of_wire(*pure, batch)
    if got != expected:
        raise AssertionError(f"the wire disagrees with the reader on {stream!r}:\n{got}\n{expected}")


def main() -> None:
    argv = list(sys.argv)
    if not any(arg.startswith("-dict=") for arg in argv):
        words = tempfile.NamedTemporaryFile("w", suffix=".dict", delete=False)  # noqa: SIM115
        with words:
            for word in DICTIONARY:
                words.write('"' + "".join(f"\\x{b:02x}" for b in word) + '"\n')
        argv.append(f"-dict={words.name}")
    print(f"fuzz_reader: compiled reader from {_core_c.__file__}", file=sys.stderr)
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
