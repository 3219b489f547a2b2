"""Writes src/joblock/_slot_tags.py: for every Redis Cluster hash slot, a hash tag that
hashes to it, so that one fencing counter per slot can live in the slot of the keys it
serves (docs/keys.md). Run from the repository root: python scripts/slot_tags.py

Each tag is the first three characters (digits, then lower, then upper case letters,
in that order, the leftmost varying slowest) whose CRC16 falls in the slot: every slot
has one, so the table is one string of 3 x 16,384 characters, slot s at [3s, 3s + 3).
"""

from __future__ import annotations

import itertools
import string
from pathlib import Path

from joblock._core_py import SLOTS, crc16

ALPHABET = string.digits + string.ascii_lowercase + string.ascii_uppercase
WIDTH = 3
OUT = Path(__file__).resolve().parent.parent / "src" / "joblock" / "_slot_tags.py"

HEADER = '''\
"""For every Redis Cluster hash slot s, TAGS[3s:3s + 3] is a hash tag in slot s: the
fencing counter of the keys in slot s is COUNTER % that tag (docs/keys.md), which both
cores' fence_key name. Made by scripts/slot_tags.py; do not edit."""

# Not under a client's prefix: every client that fences a key must count in the same place.
COUNTER = b"joblock:fences:{%s}"
# fmt: off
TAGS = (
'''


def tags() -> str:
    found: dict[int, str] = {}
    for chars in itertools.product(ALPHABET, repeat=WIDTH):
        tag = "".join(chars)
        found.setdefault(crc16(tag.encode()) & (SLOTS - 1), tag)
        if len(found) == SLOTS:
            return "".join(found[slot] for slot in range(SLOTS))
    raise SystemExit(f"{WIDTH} characters of {ALPHABET!r} do not reach every slot")


def main() -> None:
    table = tags()
    lines = [f'    b"{table[i : i + 96]}"\n' for i in range(0, len(table), 96)]
    OUT.write_text(HEADER + "".join(lines) + ")\n# fmt: on\n")
    print(f"wrote {OUT} ({SLOTS} tags)")


if __name__ == "__main__":
    main()
