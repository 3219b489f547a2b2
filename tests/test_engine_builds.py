"""The engine's two builds, fed the same replies, do the same: the compiled modules and
their very sources, side by side in one process.

The compiled build of the hot path is Cython's translation of the .py files the pure
build runs; C fields and calls could still make it differ (an integer's width, a type
test, an attribute read). Here a wire of each build gets the same requests in flight
and the same reply bytes, cut at the same places: what each hands its operations, what
each writes (script loads, redos, probes) and how each stops must be the same.

Where the compiled build is not there (JOBLOCK_NO_EXTENSIONS=1), ``joblock._engine`` is
the pure one too, and the test holds the sources to themselves.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import joblock._engine
from joblock import _core_py
from joblock._core import Sources, compiled
from joblock.errors import ReplyError
from joblock.settings import parse_url

ENGINE_DIR = Path(joblock._engine.__file__).parent
PURE = "joblock._engine_from_sources"
CORE = compiled() or _core_py
SETTINGS = parse_url("redis://127.0.0.1:6379/0")


def engine_from_sources() -> ModuleType:
    """The engine package loaded again, as ``PURE``, with every module from its source."""
    if PURE in sys.modules:
        return sys.modules[PURE]
    spec = importlib.util.spec_from_file_location(
        PURE, ENGINE_DIR / "__init__.py", submodule_search_locations=[str(ENGINE_DIR)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[PURE] = package
    spec.loader.exec_module(package)
    added = Sources not in sys.meta_path
    if added:
        sys.meta_path.insert(0, Sources)
    try:
        for name in ("requests", "ops", "wire"):
            importlib.import_module(f"{PURE}.{name}")
    finally:
        if added:
            sys.meta_path.remove(Sources)
    return package


def build(package: str) -> tuple[ModuleType, ModuleType, ModuleType]:
    return tuple(importlib.import_module(f"{package}.{name}") for name in ("requests", "ops", "wire"))  # type: ignore[return-value]


def test_the_two_builds_are_two() -> None:
    engine_from_sources()
    for module in build(PURE):
        assert (module.__file__ or "").endswith(".py"), module.__file__
    if compiled() is not None:  # the compiled build is the one joblock runs
        for module in build("joblock._engine"):
            assert not (module.__file__ or "").endswith(".py"), module.__file__


def plain(value: Any) -> Any:
    if isinstance(value, ReplyError):
        return ("error", value.message)
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def transcript(package: str, kinds: list[tuple[str, int]], pieces: list[bytes]) -> list[Any]:
    """What a wire of ``package``'s build does with requests of ``kinds`` in flight,
    fed ``pieces``: the replies each operation gets, the bytes written, how it stops."""
    requests, ops, wire_module = build(package)
    events: list[Any] = []

    class Recorded(ops.Operation):  # type: ignore[misc, name-defined]
        __slots__ = ("tag",)

        def __init__(self, tag: int) -> None:
            super().__init__(0)
            self.tag = tag

        def answer(self, request: Any, replies: list[Any]) -> None:
            events.append(("answer", self.tag, type(request).__name__, plain(replies)))

        def fail(self, error: BaseException) -> None:
            events.append(("fail", self.tag, type(error).__name__, str(error)))

    wire = wire_module.Wire(CORE, SETTINGS, set())
    wire.connected()
    for tag, (kind, n) in enumerate(kinds):
        op = Recorded(tag)
        if kind == "commands":
            wire.submit(requests.Request(op, None, b"", n))
        else:  # a plain or a fenced single acquire: merged, probed, reloaded, redone
            fenced = kind == "fenced"
            payload = CORE.encode_acquire([b"k%d" % tag], [b"v%d" % tag], 1000, None)
            wire.submit(requests.SingleAcquire(op, None, payload, fenced, b"k%d" % tag, b"v%d" % tag))
    wire.output()
    try:
        for piece in pieces:
            wire.feed(piece)
            events.append(("wrote", wire.output()))
    except Exception as e:
        events.append(("stopped", type(e).__name__, str(e)))
    events.append(("busy", wire.busy(), wire.outstanding()))
    return events


# Replies of every kind the wire treats apart: grants, the holder's value and another's,
# nil, a fencing number, NOSCRIPT, WRONGTYPE, LOADING, READONLY, the refusal of SET NX
# GET by Redis < 7.0, arrays, and bytes that are no RESP at all.
REPLY = st.sampled_from(
    [
        b"+OK\r\n", b"$-1\r\n", b"$2\r\nv0\r\n", b"$2\r\nv1\r\n", b"$5\r\nother\r\n", b":7\r\n",
        b"-NOSCRIPT No matching script\r\n", b"-WRONGTYPE Operation against a key\r\n",
        b"-LOADING Redis is loading\r\n", b"-READONLY You can't write\r\n", b"-ERR syntax error\r\n",
        b"*2\r\n:1\r\n$1\r\nx\r\n", b"*-1\r\n", b"+\r\n", b"?junk\r\n",
    ]
)  # fmt: skip
KIND = st.tuples(st.sampled_from(["commands", "acquire", "fenced"]), st.integers(1, 3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(KIND, min_size=1, max_size=5), st.lists(REPLY, max_size=14), st.lists(st.integers(0, 400)))
def test_the_builds_do_the_same_with_the_same_replies(
    kinds: list[tuple[str, int]], replies: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(replies)
    bounds = [0, *sorted(c % (len(stream) + 1) for c in cuts), len(stream)]
    pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    assert transcript("joblock._engine", kinds, pieces) == transcript(PURE, kinds, pieces)


def setup_module() -> None:
    engine_from_sources()
