"""Reply parsing alone: why the compiled core scans replies itself instead of using hiredis.

A window of 1000 acquire replies (``+OK`` and nil mixed) parsed by the compiled
core's C scanner, by ``hiredis.Reader`` (what the pure twin uses), and by the pure
twin's own parser (used when hiredis is missing). No server involved.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from joblock import _core_py
from joblock._core import compiled

WINDOW = b"+OK\r\n$-1\r\n" * 500


def _compiled() -> ModuleType:
    found = compiled()
    if found is None:
        pytest.skip("the compiled core is not built, or disabled here")
    return found


PARSERS = {
    "compiled core's C scanner": lambda: (_compiled().Reader, _compiled().take),
    "hiredis.Reader (pure twin)": lambda: (_core_py._hiredis_reader, _core_py.take),
    "pure twin's own parser": lambda: (_core_py.PyReader, _core_py.take),
}


@pytest.mark.benchmark(group="parse a window of 1000 replies")
@pytest.mark.parametrize("parser", list(PARSERS))
def test_parse(benchmark: Any, parser: str) -> None:
    make_reader, take = PARSERS[parser]()

    def parse() -> list[Any]:
        reader = make_reader()
        reader.feed(WINDOW)
        out: list[Any] = []
        take(reader, out, 1000)
        return out

    replies = benchmark(parse)
    assert replies == [b"OK", None] * 500
