"""The fault proxy of the tests and the chaos run (rig.faults.FaultProxy), on real
sockets to a real redis-server: latency with jitter keeps every byte in order, a stall
holds traffic (nothing lost) until it ends, a reset breaks a connection inside a reply, a
server that is down refuses through it. Its cuts are used by the tests of lost replies
(test_faults, test_batches, test_aio, ...).

And the chaos run's count of silent losses (rig.chaos.silent_losses), on
made-up leases that show each case it counts and each it must not.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from helpers import name
from joblock._tools.servers import free_port
from rig.chaos import silent_losses
from rig.chaos_work import LeaseRecord
from rig.faults import FaultProxy


@pytest.fixture
def proxy(redis_server) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port, seed=1) as made:
        yield made


def command(*words: str) -> bytes:
    return b"".join([b"*%d\r\n" % len(words), *(b"$%d\r\n%s\r\n" % (len(w), w.encode()) for w in words)])


def connect(proxy: FaultProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    sock.sendall(command("PING"))
    assert sock.recv(100) == b"+PONG\r\n"  # the proxy has its connection upstream
    return sock


def read(sock: socket.socket, size: int) -> bytes:
    got = b""
    while len(got) < size and (chunk := sock.recv(65536)):
        got += chunk
    return got


def test_latency_with_jitter_keeps_every_chunk_in_order(proxy):
    proxy.delay(0.004, 0.004)  # a chunk waits 0 to 8 ms: a later one could overtake
    sock = connect(proxy)
    echoes = [f"chunk-{i:03d}" for i in range(100)]
    for echo in echoes:
        sock.sendall(command("ECHO", echo))  # a chunk each, most of them
    expected = b"".join(b"$9\r\n%s\r\n" % echo.encode() for echo in echoes)
    assert read(sock, len(expected)) == expected
    assert proxy.injected["latency"] == 1
    sock.close()


def test_a_stall_holds_traffic_both_ways_until_it_heals(proxy, raw):
    key = "fault-proxy:stalled"
    sock = connect(proxy)
    proxy.stall(60)
    sock.sendall(command("SET", key, "v"))
    sock.settimeout(0.5)
    with pytest.raises(TimeoutError):
        sock.recv(100)
    assert raw.get(key) is None  # held in the proxy: Redis has not seen it
    proxy.heal()
    sock.settimeout(10)
    assert sock.recv(100) == b"+OK\r\n"  # nothing was lost
    assert raw.get(key) == b"v"
    assert proxy.injected["stall"] == 1
    sock.close()
    raw.delete(key)


def test_a_reset_breaks_the_connection_inside_a_reply(proxy, raw):
    key = "fault-proxy:big"
    raw.set(key, b"x" * 200_000)
    sock = connect(proxy)
    assert proxy.reset(1) == 1
    sock.sendall(command("GET", key))
    received = b""
    with pytest.raises(ConnectionResetError):  # a RST, not an orderly close
        while chunk := sock.recv(65536):
            received += chunk
    assert len(received) < 200_000
    assert proxy.injected["reset"] == 1
    sock.close()
    raw.delete(key)


def test_a_lease_call_whose_reply_is_reset_is_retried(make_locks, proxy):
    locks = make_locks(proxy.url)
    lease = locks.acquire(name(locks, "reset"), 30, fence=True)
    assert proxy.reset(1) == 1
    assert lease.extend(30) is True  # its reply was reset: sent again on a new connection
    assert proxy.injected["reset"] == 1
    assert proxy.connections == 2
    assert lease.release() is True


def test_a_server_that_is_down_refuses_through_the_proxy():
    with FaultProxy(free_port()) as proxy, contextlib.ExitStack() as closing:  # nothing listens there
        with pytest.raises(ConnectionResetError):  # as a refused connect shows to a client
            # (the reset may come before the connect returns, or before the PING is written)
            sock = closing.enter_context(socket.create_connection(("127.0.0.1", proxy.port), timeout=10))
            sock.sendall(command("PING"))
            sock.recv(100)
        assert proxy.injected["refused"] == 1


# -- the chaos run's silent losses ----------------------------------------------------------


def lease(n: int, granted: float, released: float | None, kept: bool = True, **more) -> LeaseRecord:
    fields = {
        "deployment": "d", "key": "k", "limit": 1, "fence": n, "lease": f"lease-{n}", "granted": granted,
        "confirmed": released if released is not None else granted, "released": released, "kept": kept,
        "stale": 0,
    }  # fmt: skip
    return LeaseRecord(**{**fields, **more})


def test_leases_that_took_turns_are_no_loss():
    assert silent_losses([lease(1, 0.0, 1.0), lease(2, 1.5, 2.0), lease(3, 2.1, None, kept=False)]) == []


def test_a_lease_kept_past_a_later_grant_is_a_loss():
    # Fence 2 was granted after fence 1 (fencing order) and known granted at 1.0, before
    # fence 1's release started at 2.0, which still found fence 1's lock: two holders.
    told = {"kept": False, "confirmed": 1.0}  # fence 2 never heard it held again
    assert silent_losses([lease(1, 0.0, 2.0), lease(2, 1.0, None, **told)]) == [
        "d k: lease-1 (fence 1) kept past a later grant"
    ]
    # Any higher fence counts, not only the next one.
    leases = [lease(1, 0.0, 2.0), lease(2, 2.5, None, kept=False), lease(3, 1.0, None, **told)]
    assert silent_losses(leases) == ["d k: lease-1 (fence 1) kept past a later grant"]


def test_two_leases_of_a_plain_lock_surely_held_at_once_are_a_loss():
    # Each said it held at both ends of its interval; the intervals overlap.
    found = silent_losses([lease(1, 0.0, 2.0), lease(2, 1.0, 3.0, kept=False)])
    assert "d k: 2 leases surely held at once (limit 1) at 1.000" in found


def test_fencing_order_is_not_trusted_on_a_key_whose_numbers_repeat():
    # A fencing number handed out twice (an exclusion violation, counted apart) says
    # nothing about the order of the grants.
    leases = [lease(1, 0.0, 2.0), lease(2, 1.0, None, kept=False), lease(2, 1.5, None, kept=False, lease="x")]
    assert silent_losses(leases) == []


def test_a_holder_that_was_told_lost_nothing_silently():
    # Its release said False (or an extend did, or a call failed): it was told.
    assert silent_losses([lease(1, 0.0, None, kept=False), lease(2, 1.0, 3.0)]) == []


def test_a_kept_lease_whose_write_was_refused_as_stale_is_a_loss():
    assert silent_losses([lease(1, 0.0, 1.0, stale=1), lease(2, 1.5, 2.0)]) == [
        "d k: lease-1 (fence 1) wrote stale"
    ]


def test_a_counting_lock_is_a_loss_only_beyond_its_limit():
    def counting(n: int, granted: float, confirmed: float) -> LeaseRecord:
        return lease(n, granted, confirmed, limit=2)

    assert silent_losses([counting(1, 0.0, 3.0), counting(2, 1.0, 4.0), counting(3, 3.5, 5.0)]) == []
    found = silent_losses([counting(1, 0.0, 3.0), counting(2, 1.0, 4.0), counting(3, 2.0, 5.0)])
    assert found == ["d k: 3 leases surely held at once (limit 2) at 2.000"]
