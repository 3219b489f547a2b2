"""The signal storm (scripts/signal_storm.py) on every twin, bounded: a SIGALRM handler
raising every 0.7 ms in the main thread while 31 threads share its client, for 2 s.

What it asserts is what must never happen, however loaded the machine: a thread hung,
a reply given to another caller (a fresh key found taken, a live lease's release
answered False), an error raised in another thread. How long the other threads' calls
took is the script's to report, not a test's. The driver under test is the build's: the
compiled one here, the pure one in the suite's run with ``JOBLOCK_NO_EXTENSIONS=1``
(both clean: see the CHANGELOG for the windows the pure one had).
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from types import ModuleType

from conftest import locks_class


def _load_script() -> ModuleType:
    path = Path(__file__).parent.parent / "scripts" / "signal_storm.py"
    spec = importlib.util.spec_from_file_location("signal_storm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


signal_storm = _load_script()


def test_a_raising_signal_handler_never_hangs_nor_misleads_the_other_threads(core, redis_server):
    assert threading.current_thread() is threading.main_thread()  # where handlers run
    locks = locks_class(core)(redis_server.url, prefix=f"storm-{core.__name__}")
    got = signal_storm.storm(locks, seconds=2.0, threads=31, interval=0.0007)
    assert (got["hung"], got["wrong"], got["errors"]) == (0, 0, 0), got
    assert got["interrupted"] > 100  # the handler did raise inside the calls, again and again
