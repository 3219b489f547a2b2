"""Key building on every twin of the core: readable, deterministic, collision-free.

The exact renderings pinned here are part of the contract in practice: a key that
changed between two releases would let an old and a new worker hold "the same" lock
at once during a rolling upgrade.
"""

from __future__ import annotations

import binascii
import collections
import enum
import hashlib
import re
from types import ModuleType
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PREFIX = b"joblock"
MAX_KEY_BYTES = 65536

# The `core` fixture only hands out a module, so reusing it across examples is safe.
property_settings = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def key(core: ModuleType, *args: Any, **kwargs: Any) -> bytes:
    return core.build_key(PREFIX, "J", args, kwargs or None)  # type: ignore[no-any-return]


def ident(core: ModuleType, *args: Any, **kwargs: Any) -> bytes:
    """The identifier part of the key for these arguments."""
    built = key(core, *args, **kwargs)
    assert built.startswith(b"joblock:J:")
    return built[len(b"joblock:J:") :]


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


# -- the documented shape ----------------------------------------------------------------


def test_design_example(core: ModuleType) -> None:
    assert core.build_key(b"joblock", "ProductSalesJob", (42,), None) == b"joblock:ProductSalesJob:42"


@pytest.mark.parametrize("kwargs", [None, {}])
def test_no_arguments_give_one_lock_per_job_class(core: ModuleType, kwargs: Any) -> None:
    assert core.build_key(b"joblock", "CleanupDataJob", (), kwargs) == b"joblock:CleanupDataJob"


def test_empty_prefix_leaves_no_leading_colon(core: ModuleType) -> None:
    assert core.build_key(b"", "J", (1,), None) == b"J:1"


def test_build_keys_matches_build_key(core: ModuleType) -> None:
    arg_tuples = [(1,), ("a", "b"), (), [2, [3]]]
    expected = [core.build_key(PREFIX, "J", tuple(args), None) for args in arg_tuples]
    assert core.build_keys(PREFIX, "J", arg_tuples, 0) == expected


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((42,), {}, b"42"),
        ((-7,), {}, b"-7"),
        ((2**70,), {}, b"1180591620717411303424"),
        ((1.5,), {}, b"1.5"),
        (("abc",), {}, b"abc"),
        (("a", "b"), {}, b"a-b"),
        (("a-b",), {}, b"a%2Db"),
        (("caf\u00e9",), {}, "caf\u00e9".encode()),
        (("42",), {}, b"'42'"),
        (("None",), {}, b"'None'"),
        (("",), {}, b"''"),
        ((True, False, None), {}, b"True-False-None"),
        ((b"ab",), {}, b"b'ab'"),
        ((b"\xff",), {}, b"b'%FF'"),
        (([1, "x"],), {}, b"[1,x]"),
        (({"b": 2, "a": 1},), {}, b"(a=1,b=2)"),
        ((), {"user": 3}, b"user=3"),
        ((7,), {"b": 2, "a": 1}, b"7-a=1-b=2"),
    ],
)
def test_short_scalars_render_readably(core: ModuleType, args: Any, kwargs: Any, expected: bytes) -> None:
    assert ident(core, *args, **kwargs) == expected


# -- collision freedom ----------------------------------------------------------------------

# Values that compare equal in Python (1 == 1.0 == True) or look alike once written
# out, yet are different arguments: each must get a key of its own.
LOOKALIKES: list[Any] = [
    1, 1.0, True, "1", b"1", [1], {1: 1}, (1, 1),
    0, 0.0, -0.0, False, "0", None, "None", "",
    "a-b", ["a", "b"], {"a": "b"}, "a=b", "[a,b]", "(a=b)",
    float("inf"), "inf", float("nan"), "nan", -1, "-1", "'1'", "b'1'",
]  # fmt: skip


def test_lookalike_values_get_distinct_keys(core: ModuleType) -> None:
    keys = [key(core, value) for value in LOOKALIKES]
    assert len(set(keys)) == len(keys), sorted(keys)


def call(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (call("a-b"), call("a", "b")),
        (call(42), call("42")),
        (call("x"), call(b"x")),
        (call([1, 2]), call({1: 2})),
        (call([1, 2]), call(1, 2)),
        (call(x=1), call("x=1")),
        (call(x=1), call({"x": 1})),
        (call(x=1), call(x="1")),
        (call(1, x=2), call(1, {"x": 2})),
        (call([["a"]]), call(["a"])),
        (call([1, [2]]), call([[1], 2])),
        (call(["a,b"]), call(["a", "b"])),
        (call({"a": "b,c=d"}), call({"a": "b", "c": "d"})),
        (call(""), call()),
        (call(1, -2), call(1, "-2")),
        (call(1e-05), call("1e-05")),
    ],
    ids=repr,
)
def test_different_calls_get_distinct_keys(core: ModuleType, first: Any, second: Any) -> None:
    assert key(core, *first[0], **first[1]) != key(core, *second[0], **second[1])


def test_job_name_cannot_fake_an_argument(core: ModuleType) -> None:
    assert core.build_key(PREFIX, "J:1", (), None) != core.build_key(PREFIX, "J", (1,), None)
    assert core.build_key(PREFIX, "J-1", (), None) != core.build_key(PREFIX, "J", (1,), None)


# -- determinism -----------------------------------------------------------------------------


def test_dict_order_does_not_matter(core: ModuleType) -> None:
    forward = {"a": 1, "b": {"x": 1, "y": 2}, 3: None}
    backward = {3: None, "b": {"y": 2, "x": 1}, "a": 1}
    assert key(core, forward) == key(core, backward)
    assert key(core, a=1, b=2) == key(core, b=2, a=1)


def test_same_arguments_give_the_same_key_every_time(core: ModuleType) -> None:
    args = ("x", 1, 2.5, None, b"\x00", [1, {"k": "v"}])
    assert len({key(core, *args) for _ in range(5)}) == 1


# -- long identifiers -------------------------------------------------------------------------


def digest_key(rendered: bytes) -> bytes:
    return b"joblock:J:#" + hashlib.blake2b(rendered, digest_size=16).hexdigest().encode()


def test_long_identifier_becomes_digest_of_its_rendering(core: ModuleType) -> None:
    assert key(core, "x" * 300) == digest_key(b"x" * 300)


def test_identifier_of_200_bytes_stays_readable(core: ModuleType) -> None:
    assert ident(core, "a" * 200) == b"a" * 200


def test_identifier_of_201_bytes_is_digested(core: ModuleType) -> None:
    assert key(core, "a" * 201) == digest_key(b"a" * 201)


def test_length_limit_counts_escaped_bytes(core: ModuleType) -> None:
    # 67 dashes escape to 201 bytes: over the limit though the str has 67 characters.
    assert key(core, "-" * 67) == digest_key(b"%2D" * 67)


@pytest.mark.parametrize(
    "args",
    [tuple(range(100)), ("x" * 1000, 1), ([["y" * 500]],), (b"\xff" * 100,)],
    ids=["many-ints", "long-str", "nested-long-str", "long-bytes"],
)
def test_long_arguments_give_short_keys(core: ModuleType, args: tuple[Any, ...]) -> None:
    assert re.fullmatch(rb"joblock:J:#[0-9a-f]{32}", key(core, *args))


# -- subclasses render as their base type -------------------------------------------------------


class Level(enum.IntEnum):
    ONE = 1


class Color(str, enum.Enum):
    RED = "red"


class Point(NamedTuple):
    x: int
    y: int


class SneakyInt(int):
    def __repr__(self) -> str:
        return f"<SneakyInt at {id(self):#x}>"

    __str__ = __repr__


class SneakyStr(str):
    def __str__(self) -> str:
        return "other"


@pytest.mark.parametrize(
    ("value", "base"),
    [
        (Level.ONE, 1),
        (Color.RED, "red"),
        (Point(1, 2), (1, 2)),
        (SneakyInt(5), 5),
        (SneakyStr("s"), "s"),
        (collections.OrderedDict(b=2, a=1), {"a": 1, "b": 2}),
        (collections.defaultdict(int, a=1), {"a": 1}),
        (collections.Counter("aab"), {"a": 2, "b": 1}),
    ],
    ids=lambda v: type(v).__name__,
)
def test_subclass_renders_as_base_type(core: ModuleType, value: Any, base: Any) -> None:
    assert key(core, value) == key(core, base)
    assert key(core, [value]) == key(core, [base])


def test_int_enum_is_not_a_bool(core: ModuleType) -> None:
    assert key(core, Level.ONE) != key(core, True)


# -- errors name the argument ---------------------------------------------------------------------

BAD_BUILD_KEY = [  # (job, args, kwargs, exception, text the message must contain)
    ("", (), None, ValueError, "job must not be empty"),
    (b"J", (), None, TypeError, "job must be a str, not bytes"),
    (5, (), None, TypeError, "job must be a str, not int"),
    ("J\ud800", (), None, ValueError, "job: str with lone surrogates"),
    ("J", (1, object()), None, TypeError, "args[1]: cannot build a lock key from 'object'"),
    ("J", (1, {2, 3}), None, TypeError, "args[1]: cannot build a lock key from 'set'"),
    ("J", ([1, 2j],), None, TypeError, "args[0]: cannot build a lock key from 'complex'"),
    ("J", (), {"x": {1}}, TypeError, "kwargs['x']: cannot build a lock key from 'set'"),
    ("J", ("ok", "\ud800"), None, ValueError, "args[1]: str with lone surrogates"),
    ("J", ({"\udc80": 1},), None, ValueError, "args[0]: str with lone surrogates"),
    ("J", (), {"x": ["\ud800"]}, ValueError, "kwargs['x']: str with lone surrogates"),
    ("J", (), {"\ud800": 1}, ValueError, r"kwargs['\ud800']: str with lone surrogates"),
    ("J", (1, nested(33)), None, ValueError, "args[1]: arguments nest deeper than 32"),
    ("J", (), {"d": nested(40)}, ValueError, "kwargs['d']: arguments nest deeper than 32"),
]


@pytest.mark.parametrize(("job", "args", "kwargs", "error", "message"), BAD_BUILD_KEY)
def test_build_key_error_names_the_argument(
    core: ModuleType, job: Any, args: Any, kwargs: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        core.build_key(PREFIX, job, args, kwargs)


BAD_BUILD_KEYS = [  # (job, arg_tuples, start, exception, text the message must contain)
    ("J", [(1,)] * 5 + [(object(),)], 0, TypeError, "arg_tuples[5][0]: cannot build a lock key"),
    ("J", [(1,), (2, set())], 10, TypeError, "arg_tuples[11][1]: cannot build a lock key"),
    ("J", [(1,), 7], 0, TypeError, "arg_tuples[1] must be a tuple of arguments, not int"),
    ("J", [("\ud800",)], 3, ValueError, "arg_tuples[3][0]: str with lone surrogates"),
    ("J", [(nested(33),)], 0, ValueError, "arg_tuples[0][0]: arguments nest deeper than 32"),
    ("", [], 0, ValueError, "job must not be empty"),
]


@pytest.mark.parametrize(("job", "arg_tuples", "start", "error", "message"), BAD_BUILD_KEYS)
def test_build_keys_error_names_the_tuple_and_argument(
    core: ModuleType, job: Any, arg_tuples: Any, start: int, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        core.build_keys(PREFIX, job, arg_tuples, start)


TOO_LONG = b"x" * (MAX_KEY_BYTES + 1)
BAD_KEYS = [  # (function, arguments, exception, text the message must contain)
    ("as_key", (7,), TypeError, "key must be str or bytes, not int"),
    ("as_key", (None, "prefix"), TypeError, "prefix must be str or bytes, not NoneType"),
    ("as_key", ("",), ValueError, "key must not be empty"),
    ("as_key", (b"",), ValueError, "key must not be empty"),
    ("as_key", ("\udc80",), ValueError, "key: str with lone surrogates"),
    ("as_key", (TOO_LONG,), ValueError, "key is 65537 bytes long; the limit is 65536"),
    ("as_key", ("\u00e9" * (MAX_KEY_BYTES // 2 + 1),), ValueError, "key is 65538 bytes long"),
    ("as_keys", ([b"a", b"b", b"c", 7], 0), TypeError, "keys[3] must be str or bytes, not int"),
    ("as_keys", (["a", ""], 5), ValueError, "keys[6] must not be empty"),
    ("as_keys", ([TOO_LONG], 0), ValueError, "keys[0] is 65537 bytes long"),
    ("fence_key", (b"a}b",), ValueError, "fence=True needs a key without an unmatched '}'"),
    ("fence_key", (b"a{}b",), ValueError, "fence=True needs a key without an unmatched '}'"),
]


@pytest.mark.parametrize(("function", "args", "error", "message"), BAD_KEYS, ids=lambda v: str(v)[:30])
def test_bad_key_error_names_the_argument(
    core: ModuleType, function: str, args: tuple[Any, ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        getattr(core, function)(*args)


def test_error_message_never_carries_a_memory_address(core: ModuleType) -> None:
    with pytest.raises(TypeError) as info:
        key(core, object())
    assert "0x" not in str(info.value)


def test_nesting_of_32_levels_is_accepted(core: ModuleType) -> None:
    assert key(core, nested(32)) == b"joblock:J:" + b"[" * 32 + b"1" + b"]" * 32


def test_self_containing_list_raises_value_error(core: ModuleType) -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match=r"args\[0\]: arguments nest deeper"):
        key(core, loop)


# -- keys given by the user -------------------------------------------------------------------------


def test_limits_are_the_same_on_every_twin(core: ModuleType) -> None:
    assert (core.MAX_KEY_BYTES, core.MAX_IDENTIFIER_BYTES, core.MAX_DEPTH) == (MAX_KEY_BYTES, 200, 32)


@pytest.mark.parametrize(
    ("given", "raw"),
    [
        ("lock", b"lock"),
        ("caf\u00e9", "caf\u00e9".encode()),
        (b"\xff\x00", b"\xff\x00"),
        (b"x" * MAX_KEY_BYTES, b"x" * MAX_KEY_BYTES),
        ("\u00e9" * (MAX_KEY_BYTES // 2), "\u00e9".encode() * (MAX_KEY_BYTES // 2)),
        (Color.RED, b"red"),
    ],
    ids=lambda v: repr(v)[:20],
)
def test_as_key_encodes_str_as_utf8_and_keeps_bytes(core: ModuleType, given: Any, raw: bytes) -> None:
    assert core.as_key(given) == raw
    assert core.as_keys([given, given], 0) == [raw, raw]


def test_as_key_returns_plain_bytes_for_a_bytes_subclass(core: ModuleType) -> None:
    class Raw(bytes):
        pass

    got = core.as_key(Raw(b"k"))
    assert type(got) is bytes
    assert got == b"k"


# -- fencing keys stay in the lock's cluster slot -------------------------------------------------------


def hash_slot(key: bytes) -> int:
    """Redis Cluster's HASH_SLOT: CRC16-XMODEM of the hash tag (or the whole key) mod 16384."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % 16384


def test_hash_slot_helper_matches_redis() -> None:
    assert binascii.crc_hqx(b"123456789", 0) == 0x31C3  # the check value Redis' crc16.c documents
    assert hash_slot(b"{user1000}.following") == hash_slot(b"{user1000}.followers")
    assert hash_slot(b"foo{}{bar}") == binascii.crc_hqx(b"foo{}{bar}", 0) % 16384


@pytest.mark.parametrize(
    ("lock_key", "fence"),
    [
        (b"joblock:J:42", b"joblock:fences:{2gA}"),
        (b"{user1}:lock", b"joblock:fences:{5F6}"),
        (b"{user1}:other", b"joblock:fences:{5F6}"),  # the slot's counter: the same
        (b"a{b}c", b"joblock:fences:{061}"),
        (b"}{x}", b"joblock:fences:{2Ra}"),
        (b"a{b", b"joblock:fences:{4q2}"),
        (b"{", b"joblock:fences:{2Rb}"),
    ],
)
def test_fence_key_is_the_lock_keys_slots_counter(core: ModuleType, lock_key: bytes, fence: bytes) -> None:
    assert core.fence_key(lock_key) == fence
    assert hash_slot(fence) == hash_slot(lock_key)


@property_settings
# Keys reach fence_key through as_key, so they are never empty.
@given(
    lock_key=st.binary(min_size=1, max_size=12) | st.lists(st.sampled_from(b"{}a:"), min_size=1).map(bytes)
)
def test_fence_key_keeps_the_slot_or_refuses(core: ModuleType, lock_key: bytes) -> None:
    try:
        fence = core.fence_key(lock_key)
    except ValueError:
        assert b"}" in lock_key
    else:
        assert fence != lock_key
        assert hash_slot(fence) == hash_slot(lock_key)


def test_built_keys_always_have_a_fence_key(core: ModuleType) -> None:
    built = key(core, "{tag}", {"}": "{"}, b"{}")
    assert b"{" not in built and b"}" not in built
    assert hash_slot(core.fence_key(built)) == hash_slot(built)


# -- injectivity, as a property ------------------------------------------------------------------------

# Small alphabets and lookalike floats make near-collisions ("a-b" vs "a", "b") likely.
tricky_text = st.text(alphabet="ab1-,:'=()[]{}#% bNT\u00e9\x00", max_size=4)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.integers(),
    st.sampled_from([0.0, -0.0, 1.0, 1e-05, 1e16, float("inf"), float("-inf"), float("nan")]),
    st.floats(),
    tricky_text,
    st.text(max_size=8),
    st.binary(max_size=4),
)
hashable = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), tricky_text, st.binary(max_size=2))
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(hashable, children, max_size=3),
    max_leaves=8,
)
calls = st.tuples(
    st.lists(values, max_size=3).map(tuple),
    st.dictionaries(tricky_text, values, max_size=2),
)


def canonical(value: Any) -> Any:
    """A form that tells apart exactly the values that must get distinct keys."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", repr(value))  # -0.0 and 0.0 differ, nan equals nan
    if isinstance(value, (str, bytes)):
        return (type(value).__name__, value)
    if isinstance(value, (list, tuple)):  # a tuple and a list are the same argument
        return ("list", tuple(canonical(v) for v in value))
    assert isinstance(value, dict)
    return ("dict", frozenset((canonical(k), canonical(v)) for k, v in value.items()))


def canonical_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return canonical(list(args)), canonical(kwargs)


def reorder(value: Any) -> Any:
    """The same value with every dict's insertion order reversed."""
    if isinstance(value, (list, tuple)):
        return type(value)(reorder(v) for v in value)
    if isinstance(value, dict):
        return {k: reorder(value[k]) for k in reversed(value)}
    return value


@property_settings
@given(batch=st.lists(calls, min_size=2, max_size=6))
def test_distinct_arguments_give_distinct_keys(core: ModuleType, batch: list[Any]) -> None:
    seen: dict[bytes, Any] = {}
    for args, kwargs in batch:
        built = core.build_key(PREFIX, "J", args, kwargs)
        canon = canonical_call(args, kwargs)
        assert seen.setdefault(built, canon) == canon, f"{built!r} collides"


@property_settings
@given(one_call=calls)
def test_key_is_deterministic_bounded_and_tag_free(core: ModuleType, one_call: Any) -> None:
    args, kwargs = one_call
    built = core.build_key(PREFIX, "J", args, kwargs)
    assert built == core.build_key(PREFIX, "J", reorder(args), reorder(kwargs))
    assert len(built) <= len(b"joblock:J:") + 200
    assert not re.search(rb"[{}\x00-\x1f\x7f]", built)
