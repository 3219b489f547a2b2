"""Mutual exclusion under load: processes times threads contending on a few keys.

Three processes of four threads each take the locks of three keys 4,800 times in all,
with every way of taking a lock (waiting, polling, the context manager, batches,
fenced or not). Inside each critical section two witnesses, one in shared memory and
one in Redis, must count exactly one holder, and fencing numbers must only grow. At the
end no lock is left behind. Runs once per twin of the core.
"""

from __future__ import annotations

import fcntl
import multiprocessing
from collections.abc import Iterator

import pytest

from helpers import contend, stored, twin_name

PROCESSES = 3
THREADS = 4
KEYS = 3


@pytest.fixture(autouse=True)
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One of these tests at a time, whatever xdist worker runs it (a lock file in the
    run's temporary directory, which the workers share): each keeps both cores busy with
    its 12 contending threads, and two or three at once slowed one another threefold (the
    polling grows with the contention), and every test that ran beside them."""
    with open(tmp_path_factory.getbasetemp().parent / "joblock-exclusion.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run(core, locks, url, rounds, ttl, limit=1, cluster=False):
    """Runs the contenders; returns (grants, busy attempts, violations, shared witnesses,
    the most holders of a key seen at once)."""
    keys = [f"{locks.prefix}:contended{k}" for k in range(KEYS)]
    context = multiprocessing.get_context("spawn")
    shared = (context.Array("i", KEYS), context.Array("q", KEYS))
    report = context.Queue()
    args = (twin_name(core), url, locks.prefix, keys, THREADS, rounds, ttl, shared, report, limit, cluster)
    processes = [context.Process(target=contend, args=args) for _ in range(PROCESSES)]
    for process in processes:
        process.start()
    results = [report.get(timeout=300) for _ in processes]
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    grants = sum(grants for grants, _, _, _ in results)
    busy = sum(busy for _, busy, _, _ in results)
    most = max(most for _, _, _, most in results)
    return grants, busy, [violation for _, _, found, _ in results for violation in found], shared, most


def test_at_most_one_holder_at_a_time(core, make_locks, raw, redis_server):
    locks = make_locks()  # for its prefix, and to look at what is left
    rounds = 400  # per thread: 4,800 in all
    grants, busy, violations, (inside, fences), _ = run(core, locks, redis_server.url, rounds, ttl=30)
    assert violations == []
    assert grants == PROCESSES * THREADS * rounds
    assert busy > 0  # they did contend
    assert list(inside) == [0] * KEYS
    assert all(fence > 0 for fence in fences)
    # Nothing left behind: no lock, the Redis witnesses back at zero, the slot counters
    # at or past the last number handed out.
    left = {key: raw.get(key) for key in stored(raw, locks)}
    for k in range(KEYS):
        assert left.pop(f"{locks.prefix}:witness:{k}".encode()) == b"0"
        counter = locks._core.fence_key(f"{locks.prefix}:contended{k}".encode())
        assert int(raw.get(counter)) >= fences[k]
    assert left == {}


def test_the_witnesses_see_holders_that_outlive_their_lease(core, make_locks, redis_server):
    # With a 1 ms ttl the locks expire inside the critical sections: what a paused
    # process does to its lease. The same witnesses must see it, or the test above
    # would prove nothing.
    locks = make_locks()
    _, _, violations, _, _ = run(core, locks, redis_server.url, rounds=40, ttl=0.001)
    assert violations


# -- counting locks: at most N holders ---------------------------------------------------------

LIMIT = 2


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_at_most_limit_holders_at_a_time(core, make_locks, raw, redis_server, cluster, cluster_raw, where):
    # 3 processes x 4 threads x 850 rounds: 10,200 contended grants of counting locks
    # of limit 2 on 3 keys, every way of taking them; the witnesses must never count more
    # than 2 holders of a key, and must have seen 2 (or the test would not show the limit).
    locks = make_locks()
    url = redis_server.url if where == "server" else cluster.url
    look = raw if where == "server" else cluster_raw
    rounds = 850
    grants, busy, violations, (inside, _), most = run(
        core, locks, url, rounds, ttl=30, limit=LIMIT, cluster=where == "cluster"
    )
    assert violations == []
    assert grants == PROCESSES * THREADS * rounds
    assert busy > 0
    assert most == LIMIT
    assert list(inside) == [0] * KEYS
    left = [key for key in look.scan_iter(match=f"{locks.prefix}:*") if b"witness" not in key]
    assert left == []  # every holder released: no counting lock left behind
    assert [int(look.get(f"{locks.prefix}:witness:{k}")) for k in range(KEYS)] == [0] * KEYS


def test_the_witnesses_see_more_than_limit_holders_when_slots_expire(core, make_locks, redis_server):
    # As above for plain locks: with a 1 ms ttl holders outlive their slots, and the
    # witnesses must catch a third holder of a key.
    locks = make_locks()
    _, _, violations, _, _ = run(core, locks, redis_server.url, rounds=60, ttl=0.001, limit=LIMIT)
    assert any("3 holders" in violation or "4 holders" in violation for violation in violations)
