"""Processes taking turns at one key, and idle waiters: ``joblock bench --only contention``, once.

Not timed by pytest-benchmark: the group measures itself (worker processes, one start
time, their sections merged). This runs it briefly for joblock and checks its shape
only: a number, no two holders at once, the idle waiters counted, the keys removed.
"""

from __future__ import annotations

import dataclasses

import pytest

from joblock._tools import bench, contention

SETUP = contention.Setup(processes=2, seconds=0.5, idle_tasks=10, idle_seconds=0.5)


def test_contention_once(arena: bench.Arena) -> None:
    opts = bench.Options(repeat=1, contenders=("joblock-c",), contention=SETUP)
    rows = {row.contender: row for row in bench.measure_contention(arena, opts)}
    joblock, idle = rows["joblock-c"], rows[contention.IDLE]
    if joblock.status.startswith("not built"):
        pytest.skip(f"joblock: {joblock.status}")
    assert joblock.status == "ok", joblock.status
    assert len(joblock.samples) == 1 and joblock.samples[0] > 0
    assert joblock.n > 0
    assert joblock.extra["overlaps"] == 0
    assert joblock.extra["turns_fewest"] > 0  # both processes had the lock
    assert idle.status == "ok", idle.status
    assert isinstance(idle.extra["commands"], int) and idle.extra["commands"] >= 0
    assert {rows[c].status for c in contention.RACERS if c != "joblock-c"} == {"skipped"}
    cursor, left = arena.call("SCAN", 0, "MATCH", f"*{arena.namespace}*", "COUNT", 10000)
    assert left == [] and cursor == b"0"  # every round's keys purged

    # The table shows joblock's row with its figures, and its targets are judged.
    data = bench.report(list(rows.values()), opts)
    lines = contention.table(data["groups"]["contention"], dataclasses.asdict(SETUP))
    assert any(line.split()[:2] == ["joblock", f"{joblock.samples[0]:,.0f}"] for line in lines), lines
    judged = {t["what"]: t["met"] for t in data["targets"] if t["group"] == "contention"}
    assert judged["contention: joblock median hand-off, ms"] is not None


def test_the_bare_token_takes_turns_with_two_commands_a_section(arena: bench.Arena) -> None:
    """The floor beside joblock: a token list, BLPOP and RPUSH over bare sockets."""
    opts = bench.Options(repeat=1, contenders=("bare-token",), contention=SETUP)
    rows = {row.contender: row for row in bench.measure_contention(arena, opts)}
    bare = rows["bare-token"]
    assert bare.status == "ok", bare.status
    assert bare.n > 0 and bare.extra["overlaps"] == 0
    assert bare.extra["turns_fewest"] > 0  # the token went to both processes
    # BLPOP and RPUSH per section (and the first process's SET NX and RPUSH of the token).
    assert 2 <= bare.extra["commands_per_section"] < 2.5
    cursor, left = arena.call("SCAN", 0, "MATCH", f"*{arena.namespace}*", "COUNT", 10000)
    assert left == [] and cursor == b"0"
