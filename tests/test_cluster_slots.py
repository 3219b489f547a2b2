"""Redis Cluster hash slots: CRC16-XMODEM with hash tags, the same in both twins and in Redis."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TWINS
from joblock._tools.admin import Node
from joblock._tools.servers import RedisServer, cluster_port
from joblock.settings import Settings
from test_differential import assert_twins_agree

differential = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def cluster_node() -> Iterator[Node]:
    """One cluster-enabled server: it answers CLUSTER KEYSLOT with no slots assigned."""
    # Cluster mode needs the bus port (+10000) to fit too: a port from cluster_port.
    port = cluster_port(set())
    with RedisServer("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", port=port) as server:
        node = Node(Settings(path=server.unixsocket))
        yield node
        node.close()


def test_crc16_known_vector(core: ModuleType) -> None:
    assert core.crc16(b"123456789") == 0x31C3
    assert core.crc16(b"") == 0


@pytest.mark.parametrize(
    ("key", "slot"),
    [
        (b"foo", 12182),
        (b"bar", 5061),
        (b"hello", 866),
        (b"123456789", 0x31C3 & 16383),
        (b"{user1000}.following", 3443),
        (b"{user1000}.followers", 3443),
        (b"", 0),
    ],
)
def test_known_slots(core: ModuleType, key: bytes, slot: int) -> None:
    assert core.key_slot(key) == slot


def test_hash_tags(core: ModuleType) -> None:
    slot = core.key_slot
    assert slot(b"{user1000}.following") == slot(b"{user1000}.followers") == slot(b"user1000")
    # "{}" is no tag: the whole key is hashed.
    assert slot(b"foo{}{bar}") == core.crc16(b"foo{}{bar}") % 16384
    assert slot(b"{}") == core.crc16(b"{}") % 16384
    # Only the first "{" counts, up to the first "}" after it.
    assert slot(b"foo{{bar}}zap") == slot(b"{bar")
    assert slot(b"foo{bar}{zap}") == slot(b"bar")
    # No closing brace: the whole key.
    assert slot(b"foo{bar") == core.crc16(b"foo{bar") % 16384


def test_key_slots_in_order(core: ModuleType) -> None:
    keys = [b"foo", b"bar", b"{user1000}.x", b""]
    assert core.key_slots(keys) == [core.key_slot(k) for k in keys]


@pytest.mark.parametrize("bad", ["foo", None, 5, bytearray(b"foo"), memoryview(b"foo")])
def test_key_slot_wants_bytes(bad: Any) -> None:
    for core in TWINS.values():
        with pytest.raises(TypeError, match="key must be bytes"):
            core.key_slot(bad)
        with pytest.raises(TypeError, match="data must be bytes"):
            core.crc16(bad)
        with pytest.raises(TypeError, match="key must be bytes"):
            core.key_slots([b"a", bad])
    assert_twins_agree(lambda core: core.key_slots((b"a",)))


class Sub(bytes):
    pass


braced = st.lists(st.sampled_from([b"{", b"}", b"a", b"user", b"\x00", b"\xff", b"}{"]), max_size=6).map(
    b"".join
)
slot_keys = st.binary(max_size=40) | braced | st.binary(max_size=4).map(Sub)
slot_inputs = slot_keys | st.sampled_from(["{a}", None, 1, bytearray(b"x")])


@differential
@given(key=slot_inputs)
def test_twins_agree_on_slots(key: Any) -> None:
    assert_twins_agree(lambda core: core.key_slot(key))
    assert_twins_agree(lambda core: core.crc16(key))


@differential
@given(keys=st.lists(slot_inputs, max_size=5))
def test_twins_agree_on_slot_lists(keys: list[Any]) -> None:
    assert_twins_agree(lambda core: core.key_slots(keys))


@differential
@given(key=slot_keys.filter(bool))
def test_slots_match_redis(cluster_node: Node, key: bytes) -> None:
    expected = cluster_node.call("CLUSTER", "KEYSLOT", bytes(key))
    for core in TWINS.values():
        assert core.key_slot(key) == expected


@differential
@given(key=slot_keys.filter(lambda k: bool(k) and b"}" not in k))
def test_fence_counter_shares_the_lock_slot(key: bytes) -> None:
    for core in TWINS.values():
        assert core.key_slot(core.fence_key(bytes(key))) == core.key_slot(bytes(key))


def test_known_slots_match_redis(cluster_node: Node) -> None:
    for key in (b"foo", b"{user1000}.following", b"foo{}{bar}", b"foo{{bar}}zap", b"{}"):
        assert cluster_node.call("CLUSTER", "KEYSLOT", key) == TWINS["python"].key_slot(key)
