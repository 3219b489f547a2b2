"""The twins of the core, fed the same inputs, give the same results and the same errors.

Every twin present is compared: the compiled one ("c", where it is built), the pure
one with hiredis ("python") and the pure one with its own RESP parser
("python-nohiredis"). Where the compiled twin is missing the two pure ones are still
held to each other.
"""

from __future__ import annotations

import collections
import enum
import itertools
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TWINS
from joblock._scripts import MARK
from joblock.errors import ProtocolError, ReplyError

differential = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome(run: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("returned", run())
    except AssertionError:
        raise  # a check inside ``run`` failed: not an outcome to compare
    except Exception as e:
        return ("raised", type(e), str(e))


def assert_twins_agree(run: Callable[[ModuleType], Any]) -> Any:
    """Runs ``run`` on every twin; all must return equal values or raise alike."""
    results = {name: outcome(lambda core=core: run(core)) for name, core in TWINS.items()}
    first = next(iter(results.values()))
    assert results == dict.fromkeys(results, first)
    return first


def test_the_pure_twins_are_always_compared() -> None:
    assert {"python", "python-nohiredis"} <= set(TWINS)


# -- arguments, valid and not ----------------------------------------------------------------


class Level(enum.IntEnum):
    ONE = 1


class Color(str, enum.Enum):
    RED = "red"


class Point(NamedTuple):
    x: Any
    y: Any


surrogate_text = st.text(max_size=4).map(lambda s: s + "\ud800")
text = st.text(max_size=6) | st.text(alphabet="a-1,:'={}#% ", max_size=4) | surrogate_text
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    text,
    st.binary(max_size=6),
    st.sampled_from([Level.ONE, Color.RED]),
)
unsupported = st.sampled_from([object(), {1, 2}, frozenset(), 1j, bytearray(b"x"), range(2), type])


def deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


values = st.recursive(
    scalars | unsupported,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.none() | st.integers(-2, 2) | text, children, max_size=3),
        st.builds(collections.OrderedDict, st.dictionaries(text, children, max_size=2)),
        st.builds(Point, children, children),
    ),
    max_leaves=10,
) | st.integers(28, 36).map(deep)
arg_tuples = st.lists(values, max_size=4).map(tuple)
kwargs = st.none() | st.dictionaries(text, values, max_size=3)
jobs = st.sampled_from(["J", "ProductSalesJob", "", "J\ud800", "a:b{c}", 5, b"J", None]) | st.text(max_size=5)
prefixes = st.sampled_from([b"", b"joblock", b"{tag}"]) | st.binary(max_size=8)


@differential
@given(prefix=prefixes, job=jobs, args=arg_tuples, kw=kwargs)
def test_build_key(prefix: bytes, job: Any, args: tuple[Any, ...], kw: Any) -> None:
    assert_twins_agree(lambda core: core.build_key(prefix, job, args, kw))


batch_items = arg_tuples | st.lists(values, max_size=3) | st.sampled_from([None, 5, "ab", Point(1, 2)])


@differential
@given(prefix=prefixes, job=jobs, items=st.lists(batch_items, max_size=5), start=st.integers(0, 10**6))
def test_build_keys(prefix: bytes, job: Any, items: list[Any], start: int) -> None:
    assert_twins_agree(lambda core: core.build_keys(prefix, job, items, start))


class RawKey(bytes):
    pass


user_keys = st.one_of(
    text,
    st.binary(max_size=8),
    st.binary(max_size=4).map(RawKey),
    st.sampled_from([b"", "", None, 7, 1.5, bytearray(b"k"), Color.RED]),
    st.sampled_from([65535, 65536, 65537]).map(lambda n: b"k" * n),
    st.sampled_from([32768, 32769]).map(lambda n: "\u00e9" * n),
)


@differential
@given(key=user_keys, where=st.sampled_from(["key", "prefix", "keys[3]"]))
def test_as_key(key: Any, where: str) -> None:
    assert_twins_agree(lambda core: core.as_key(key, where))


@differential
@given(keys=st.lists(user_keys, max_size=5), start=st.integers(0, 10**6))
def test_as_keys(keys: list[Any], start: int) -> None:
    assert_twins_agree(lambda core: core.as_keys(keys, start))


# Keys biased towards braces, where hash tags and their edge cases live.
lock_keys = st.binary(max_size=10) | st.lists(st.sampled_from(b"{}a:"), max_size=8).map(bytes)


@differential
@given(key=lock_keys)
def test_fence_key(key: bytes) -> None:
    assert_twins_agree(lambda core: core.fence_key(key))


# -- command encoding ----------------------------------------------------------------------------

command_args = st.one_of(
    st.binary(max_size=8),
    text,
    st.integers(),
    st.sampled_from([None, True, 1.5, bytearray(b"x"), memoryview(b"y")]),
)


@differential
@given(args=st.lists(command_args, max_size=6) | st.lists(command_args, max_size=6).map(tuple))
def test_encode_command(args: Any) -> None:
    assert_twins_agree(lambda core: core.encode_command(args))


int64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def windows(draw: st.DrawFn) -> tuple[list[bytes], list[bytes]]:
    """Keys and values for a window; now and then their lengths differ (an error)."""
    keys = draw(st.lists(lock_keys, max_size=5))
    n = draw(st.sampled_from([len(keys)] * 5 + [len(keys) + 1, max(len(keys) - 1, 0)]))
    return keys, draw(st.lists(st.binary(max_size=40), min_size=n, max_size=n))


# A script's further arguments: ints and bytes, and now and then what is neither.
extra_arguments = st.tuples() | st.lists(
    st.one_of(int64, st.integers(), st.binary(max_size=6), st.sampled_from([True, 1.5, "s", None])),
    max_size=4,
).map(tuple)


@differential
@given(window=windows(), ms=int64, sha=st.none() | st.binary(max_size=40), extra=extra_arguments)
def test_encode_acquire(
    window: tuple[list[bytes], list[bytes]], ms: int, sha: bytes | None, extra: tuple[Any, ...]
) -> None:
    keys, values = window
    assert_twins_agree(lambda core: core.encode_acquire(keys, values, ms, sha, extra))


@differential
@given(window=windows(), sha=st.binary(max_size=40), arg=st.none() | int64)
def test_encode_evalsha(window: tuple[list[bytes], list[bytes]], sha: bytes, arg: int | None) -> None:
    keys, values = window
    assert_twins_agree(lambda core: core.encode_evalsha(sha, keys, values, arg))


@differential
@given(
    window=windows(),
    head=st.binary(max_size=20),
    middle=st.binary(max_size=12),
    tail=st.binary(max_size=12),
    twice=st.booleans(),
)
def test_encode_compare(
    window: tuple[list[bytes], list[bytes]], head: bytes, middle: bytes, tail: bytes, twice: bool
) -> None:
    keys, values = window
    assert_twins_agree(lambda core: core.encode_compare(head, keys, values, middle, tail, twice))


@pytest.mark.parametrize("n", [0, 1, 7, 1000])
@pytest.mark.parametrize("holder", [b"", b":host:123"])
def test_new_values_are_fresh_hex_tokens_then_the_holder(n: int, holder: bytes) -> None:
    made = {name: core.new_values(n, holder) for name, core in TWINS.items()}
    for name, tokens in made.items():
        assert len(tokens) == n, name
        for token in tokens:
            assert re.fullmatch(rb"[0-9a-f]{32}" + re.escape(holder), token), (name, token)
    every = [token for tokens in made.values() for token in tokens]
    assert len(set(every)) == len(every)


# -- leases ---------------------------------------------------------------------------------------

OWNER = object()

acquire_replies = st.one_of(
    st.none(),
    st.just(b"OK"),
    st.integers(0, 2**64),
    st.sampled_from(["NOSCRIPT No matching script", "OOM", "ERR x"]).map(ReplyError),
)
names = st.none() | st.text(max_size=3) | st.binary(max_size=3)


@st.composite
def acquire_windows(draw: st.DrawFn) -> tuple[list[bytes], list[Any] | None, list[bytes], list[Any]]:
    replies = draw(st.lists(acquire_replies, max_size=6))
    keys = [b"k%d" % i for i in range(len(replies))]
    values = [b"v%d" % i for i in range(len(replies))]
    given_names = draw(st.none() | st.lists(names, min_size=len(replies), max_size=len(replies)))
    return keys, given_names, values, replies


def describe(item: Any) -> Any:
    """A twin-neutral picture of a lease (or of whatever stands in its place)."""
    if type(item).__name__ != "Lease":
        return item
    assert item._owner is OWNER
    fields = (item._key, item._name, item._value, item._fence, item._held, item._deadline, item._lost)
    return (fields, item.key, item.token, item.fence, item.held, repr(item))


# A lease's deadline: not known (0.0, an adopted lease), long passed, or far ahead.
DEADLINES = (0.0, 1.0, 1e12)


def make_leases(core: ModuleType, window: Any, deadline: float = 1e12) -> tuple[list[Any], int]:
    keys, given_names, values, replies = window
    return core.make_leases(OWNER, keys, given_names, values, replies, deadline)  # type: ignore[no-any-return]


@differential
@given(window=acquire_windows(), deadline=st.sampled_from(DEADLINES))
def test_make_leases(window: Any, deadline: float) -> None:
    def run(core: ModuleType) -> Any:
        leases, errors = make_leases(core, window, deadline)
        assert all(a is b for a, b in zip(leases, window[3]) if type(a) is ReplyError)
        return [describe(lease) for lease in leases], errors

    assert_twins_agree(run)


@differential
@given(
    window=acquire_windows(),
    released=st.sets(st.integers(0, 5)),
    intruder=st.none() | st.tuples(st.integers(0, 6), st.sampled_from([5, "lease", ("k", "v")])),
    start=st.integers(0, 1000),
)
def test_lease_fields(window: Any, released: set[int], intruder: Any, start: int) -> None:
    def run(core: ModuleType) -> Any:
        leases, _ = make_leases(core, window)
        for i in released & set(range(len(leases))):
            if type(leases[i]) is core.Lease:
                leases[i]._held = False
        if intruder is not None:
            leases.insert(*intruder)
        return core.lease_fields(leases, start)

    assert_twins_agree(run)


verdict_replies = st.one_of(
    st.integers(-2, 2),
    st.integers(),
    st.sampled_from([None, b"OK", True, 1.0, ReplyError("NOSCRIPT x"), ReplyError("ERR y")]),
)


@differential
@given(
    window=acquire_windows(),
    verdicts=st.lists(verdict_replies, max_size=7),
    drop_all=st.booleans(),
    granted=st.sampled_from(DEADLINES),
)
def test_settle(window: Any, verdicts: list[Any], drop_all: bool, granted: float) -> None:
    """Verdicts, and what they say of each lease: held, its deadline, why it was lost."""

    def run(core: ModuleType) -> Any:
        leases = [lease for lease in make_leases(core, window, granted)[0] if type(lease) is core.Lease]
        idx, _, _ = core.lease_fields(leases, 0)
        out: list[Any] = [None] * len(leases)
        errors = core.settle(leases, idx, verdicts, out, drop_all, 2e12)
        return errors, out, [(lease.held, lease._deadline, lease._lost) for lease in leases]

    assert_twins_agree(run)


@differential
@given(
    deadline=st.sampled_from(DEADLINES),
    causes=st.lists(st.sampled_from(["deadline", "expired", "taken", "released", "ended"]), max_size=3),
)
def test_lose_and_loss(deadline: float, causes: list[str]) -> None:
    """The first cause stays; a passed deadline is a loss; the watch hears of it once."""

    def run(core: ModuleType) -> Any:
        (lease,), _ = make_leases(core, ([b"k"], None, [b"v"], [b"OK"]), deadline)
        heard: list[Any] = []
        lease._watch = lambda lost: heard.append(lost._lost)
        first = core.loss(lease)
        for cause in causes:
            core.lose(lease, cause)
        return first, core.loss(lease), heard, lease.valid_for() if lease._lost else "sure"

    assert_twins_agree(run)


class OtherError(ReplyError):
    pass


error_replies = st.one_of(
    st.builds(
        ReplyError, st.sampled_from(["NOSCRIPT", "NOSCRIPTX", "ERR", "", " NOSCRIPT"]) | st.text(max_size=8)
    ),
    st.builds(
        lambda code, rest: ReplyError(f"{code} {rest}"), st.sampled_from(["NOSCRIPT", "ERR"]), st.text()
    ),
    st.just(OtherError("NOSCRIPT x")),
    st.sampled_from([None, b"NOSCRIPT", "NOSCRIPT", 1]),
)


@differential
@given(replies=st.lists(error_replies, max_size=6))
def test_error_positions(replies: list[Any]) -> None:
    assert_twins_agree(lambda core: core.error_positions(replies))


# SET NX GET replies: nil, a value (ours or not, marked by a waiter or not), an error, or
# what Redis never sends there.
set_get_replies = st.one_of(
    st.none(),
    st.sampled_from(
        [b"v1", b"v2", b"", b"OK", b"v1" + MARK, b"" + MARK, b"v1" + MARK[:1], b"v1" + MARK + MARK]
    ),
    st.binary(max_size=4),
    error_replies,
    st.just(7),
)


@differential
@given(
    replies=st.lists(set_get_replies, max_size=6),
    values=st.lists(st.sampled_from([b"v1", b"v2", b"", b"OK"]), max_size=7),
)
def test_claims(replies: list[Any], values: list[bytes]) -> None:
    assert_twins_agree(lambda core: core.claims(list(replies), values))


@differential
@given(reply=st.binary(max_size=6) | st.sampled_from([b"v" + MARK, MARK]), value=st.binary(max_size=4))
def test_mine(reply: bytes, value: bytes) -> None:
    assert_twins_agree(lambda core: core.mine(reply, value))


# -- reply parsing ----------------------------------------------------------------------------------

# A reply is modelled as (bytes on the wire, value a reader must return).
line = st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
int64_edges = st.sampled_from([0, -1, 2**63 - 1, -(2**63), 2**31, -(2**31) - 1])
bulk_data = st.binary(max_size=30) | st.sampled_from([b"", b"\r\n", b"a\r\nb", b"\r", b"\n", b"$3\r\n"])
Reply = tuple[bytes, Any]

simple_replies: st.SearchStrategy[Reply] = st.one_of(
    line.map(lambda s: (b"+%s\r\n" % s, s)),
    line.map(lambda s: (b"-%s\r\n" % s, ReplyError(s.decode(errors="replace")))),
    (int64 | int64_edges).map(lambda i: (b":%d\r\n" % i, i)),
    bulk_data.map(lambda s: (b"$%d\r\n%s\r\n" % (len(s), s), s)),
    st.just((b"$-1\r\n", None)),
    st.just((b"*-1\r\n", None)),
)


def array(items: list[Reply]) -> Reply:
    return b"*%d\r\n" % len(items) + b"".join(wire for wire, _ in items), [value for _, value in items]


def depth(value: Any) -> int:
    return 1 + max(map(depth, value), default=0) if isinstance(value, list) else 0


# Shallow enough for every reader: joblock's stop at 32 levels of nesting.
replies = st.recursive(
    simple_replies, lambda children: st.lists(children, max_size=4).map(array), max_leaves=12
).filter(lambda reply: depth(reply[1]) < 8)


def plain(value: Any) -> Any:
    """Replies made comparable: a ReplyError by its exact type and message."""
    if isinstance(value, ReplyError):
        return ("error", type(value), value.message)
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    return [data[a:b] for a, b in itertools.pairwise([0, *sorted(cuts), len(data)])]


@differential
@given(batch=st.lists(replies, min_size=1, max_size=8), data=st.data())
def test_readers_parse_split_replies_alike(batch: list[Reply], data: st.DataObject) -> None:
    wire = b"".join(w for w, _ in batch)
    pieces = split(wire, data.draw(st.lists(st.integers(0, len(wire)), max_size=12), label="cuts"))
    expected = plain([value for _, value in batch])

    def run(core: ModuleType) -> Any:
        reader, out = core.Reader(), []
        for piece in pieces:
            reader.feed(piece)
            assert core.take(reader, out, len(batch)) == len(out)
        assert reader.gets() is False
        return plain(out)

    assert assert_twins_agree(run) == ("returned", expected)


# Fragments of the grammar, so random concatenations come close to valid RESP.
FRAGMENTS = [
    b"+", b"-", b":", b"$", b"*", b"?", b"0", b"1", b"3", b"-1", b"-5", b"9223372036854775807",
    b"9223372036854775808", b"99999999999999999999", b" ", b"abc", b"\r\n", b"\r", b"\n", b"\x00", b"\xff",
]  # fmt: skip
KNOWN_BAD = [
    b"?x\r\n", b":abc\r\n", b":\r\n", b":-\r\n", b":+5\r\n", b": 5\r\n", b":1.5\r\n",
    b":9223372036854775808\r\n", b":-9223372036854775809\r\n", b":99999999999999999999\r\n",
    b"$abc\r\n", b"$3\r\nabcXY", b"$3\r\nab", b"$3\r\nabc\r", b"*2\r\n:1\r\n", b"*x\r\n",
    b"$9223372036854775807\r\nabc\r\n", b"$9223372036854775806\r\n", b"*9223372036854775807\r\n:1\r\n",
    b"*1\r\n" * 40 + b":1\r\n", b"+OK", b"\r\n", b"\r\r\n",
]  # fmt: skip

malformed = st.one_of(
    st.binary(max_size=40),
    st.lists(st.sampled_from(FRAGMENTS), max_size=12).map(b"".join),
    st.sampled_from(KNOWN_BAD),
    st.tuples(replies, st.sampled_from(KNOWN_BAD)).map(lambda r: r[0][0] + r[1]),
    st.tuples(replies, st.integers(0, 200), st.binary(min_size=1, max_size=1)).map(
        lambda r: r[0][0][: r[1]] + r[2] + r[0][0][r[1] + 1 :]
    ),
)


def read_all(reader: Any, pieces: list[bytes]) -> tuple[list[Any], str]:
    """Every reply the reader gives, then how it stopped: "incomplete" or its ProtocolError.

    Each reply takes at least 3 bytes, so more gets() than bytes fed means a reader
    that returns replies without consuming input: it would hang a connection.
    """
    got: list[Any] = []
    fed = 0
    for piece in pieces:
        fed += len(piece)
        try:
            reader.feed(piece)
            while (reply := reader.gets()) is not False:
                got.append(plain(reply))
                assert len(got) <= fed, "the reader returns replies without consuming input"
        except ProtocolError as e:
            return got, f"ProtocolError: {e}"
    return got, "incomplete"


@differential
@given(wire=malformed, data=st.data())
def test_malformed_input_gives_incomplete_or_protocol_error(wire: bytes, data: st.DataObject) -> None:
    pieces = split(wire, data.draw(st.lists(st.integers(0, len(wire)), max_size=4), label="cuts"))
    # Any exception but ProtocolError (or a crash of the process) fails here.
    outcomes = {name: read_all(core.Reader(), pieces) for name, core in TWINS.items()}
    # hiredis (the "python" twin's reader) may stop or go on differently on malformed
    # input; the compiled scanner and PyReader follow one grammar and agree exactly.
    own = read_all(TWINS["python"].PyReader(), pieces)
    assert outcomes["python-nohiredis"] == own
    if "c" in outcomes:
        assert outcomes["c"] == own
