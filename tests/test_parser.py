"""The RESP readers at every split point: each twin's reader fed the same bytes in every
possible two pieces, byte by byte, and truncated at every length.

test_differential.py feeds random pieces; here every cut of each stream is tried, so a
reader that mishandles a reply split at one particular byte (inside "\\r\\n", between a
bulk's length and its data, inside a nested array) cannot pass by chance. Valid input
must give the same replies on every twin; malformed input must give a ProtocolError or
wait for more bytes, never a crash, a hang or a reply made of nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TWINS
from joblock.errors import ProtocolError, ReplyError
from test_differential import KNOWN_BAD, plain, read_all, replies

TOKEN = b"0123456789abcdef0123456789abcdef@host:4242"


def nest(depth: int) -> tuple[bytes, Any]:
    wire, value = b":1\r\n", 1
    for _ in range(depth):
        wire, value = b"*1\r\n" + wire, [value]
    return wire, [value]


VALID: list[tuple[bytes, list[Any]]] = [
    (b"+OK\r\n", [b"OK"]),
    (b"+OK\r\n$-1\r\n+OK\r\n", [b"OK", None, b"OK"]),
    (b":0\r\n:-1\r\n:9223372036854775807\r\n:-9223372036854775808\r\n", [0, -1, 2**63 - 1, -(2**63)]),
    (b"$0\r\n\r\n$2\r\n\r\n\r\n$4\r\na\r\nb\r\n", [b"", b"\r\n", b"a\r\nb"]),
    (b"-NOSCRIPT No matching script\r\n-ERR\r\n", [ReplyError("NOSCRIPT No matching script"),
                                               ReplyError("ERR")]),
    (b"*0\r\n*-1\r\n*2\r\n*1\r\n:1\r\n$3\r\nabc\r\n", [[], None, [[1], b"abc"]]),
    (b"*3\r\n+a\r\n-WRONGTYPE x\r\n*2\r\n$-1\r\n:7\r\n", [[b"a", ReplyError("WRONGTYPE x"), [None, 7]]]),
    nest(31),  # as deep as every reader goes
    # What joblock reads: SET NX replies, a retried window's GET, fences, release verdicts.
    (b"+OK\r\n$-1\r\n$%d\r\n%s\r\n:12\r\n:-1\r\n" % (len(TOKEN), TOKEN), [b"OK", None, TOKEN, 12, -1]),
]  # fmt: skip

MALFORMED = [
    *KNOWN_BAD,
    b"+OK\r\n?\r\n",
    b"*2\r\n:1\r\n!\r\n",
    b"$2\r\nabc\r\n",
    b"$-2\r\n",
    b"*1\r\n$3\r\nab\r\n+OK\r\n",
    b":1\n:2\r\n",
    b"\x00\x00\x00\x00",
    b"$1\r\n\xff\r\n\xff",
]


def expected_plain(values: list[Any]) -> list[Any]:
    return [plain(value) for value in values]


def outcomes(pieces: list[bytes]) -> dict[str, tuple[list[Any], str]]:
    return {twin: read_all(core.Reader(), pieces) for twin, core in TWINS.items()}


def every_split(wire: bytes) -> list[list[bytes]]:
    """The stream in two pieces at every point, then one byte at a time."""
    return [[wire[:i], wire[i:]] for i in range(len(wire) + 1)] + [
        [wire[i : i + 1] for i in range(len(wire))]
    ]


@pytest.mark.parametrize(("wire", "values"), VALID, ids=range(len(VALID)))
def test_valid_replies_at_every_split_point(wire, values):
    want = (expected_plain(values), "incomplete")
    for pieces in every_split(wire):
        assert outcomes(pieces) == dict.fromkeys(TWINS, want), pieces


@pytest.mark.parametrize(("wire", "values"), VALID, ids=range(len(VALID)))
def test_valid_replies_truncated_at_every_length(wire, values):
    """A prefix gives exactly the replies complete within it, and then waits."""
    reader, ends = TWINS["python"].PyReader(), []
    for i in range(len(wire)):
        reader.feed(wire[i : i + 1])
        while reader.gets() is not False:
            ends.append(i + 1)  # where each reply is complete
    assert len(ends) == len(values)
    for length in range(len(wire) + 1):
        want = (expected_plain(values[: sum(end <= length for end in ends)]), "incomplete")
        for pieces in ([wire[:length]], [wire[: length // 2], wire[length // 2 : length]]):
            assert outcomes(pieces) == dict.fromkeys(TWINS, want)


def agree_or_fail_cleanly(pieces: list[bytes]) -> None:
    found = outcomes(pieces)
    own = read_all(TWINS["python"].PyReader(), pieces)
    # The compiled scanner and PyReader share one grammar: the same replies, the same error.
    assert found["python-nohiredis"] == own
    if "c" in found:
        assert found["c"] == own
    # hiredis may stop elsewhere on malformed input, but only with a ProtocolError or by waiting.
    _, end = found["python"]
    assert end == "incomplete" or end.startswith("ProtocolError")


@pytest.mark.parametrize("wire", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_input_at_every_split_point(wire):
    for pieces in every_split(wire):
        agree_or_fail_cleanly(pieces)
    # The same after a valid reply, and with the valid reply after it never surfacing.
    for pieces in every_split(b"+OK\r\n" + wire + b"+OK\r\n"):
        agree_or_fail_cleanly(pieces)


def test_a_protocol_error_is_raised_again_not_skipped():
    # A reader that hit bad bytes must not resynchronise on later bytes and hand out
    # replies a server never meant: each later gets() raises again (or waits).
    for core in TWINS.values():
        reader = core.Reader()
        reader.feed(b"+OK\r\n?bad\r\n+NOT-A-REPLY\r\n")
        assert reader.gets() == b"OK"
        for _ in range(3):
            with pytest.raises(ProtocolError):
                reader.gets()


def test_take_stops_at_n_and_resumes_at_every_split_point():
    wire = b"".join(w for w, _ in VALID)
    values = expected_plain([v for _, vs in VALID for v in vs])
    for core in TWINS.values():
        for i in range(0, len(wire) + 1, 7):
            reader, out = core.Reader(), []
            reader.feed(wire[:i])
            core.take(reader, out, 3)
            assert len(out) <= 3
            reader.feed(wire[i:])
            core.take(reader, out, len(values))
            assert [plain(v) for v in out] == values


BIG = 1 << 20


def test_a_megabyte_bulk_split_anywhere():
    data = bytes(range(256)) * (BIG // 256)
    wire = b"$%d\r\n%s\r\n:1\r\n" % (len(data), data)
    cuts = [0, 1, 4, 5, 6, 7, BIG // 2, len(wire) - 6, len(wire) - 5, len(wire) - 4, len(wire) - 1]
    for cut in cuts:
        assert outcomes([wire[:cut], wire[cut:]]) == dict.fromkeys(TWINS, ([data, 1], "incomplete"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(replies, min_size=1, max_size=6))
def test_random_valid_replies_at_every_split_point(batch):
    wire = b"".join(w for w, _ in batch)
    want = (expected_plain([value for _, value in batch]), "incomplete")
    for pieces in every_split(wire):
        assert outcomes(pieces) == dict.fromkeys(TWINS, want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(replies, min_size=1, max_size=4), cut=st.data())
def test_random_replies_with_a_byte_corrupted_at_every_split_point(batch, cut):
    wire = bytearray(b"".join(w for w, _ in batch))
    at = cut.draw(st.integers(0, len(wire) - 1), label="at")
    wire[at] = cut.draw(st.sampled_from(b"\r\n$*:+-?0-9\x00\xff"), label="byte")
    for pieces in every_split(bytes(wire)):
        agree_or_fail_cleanly(pieces)
