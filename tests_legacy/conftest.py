"""The arq and taskiq tests: run by scripts/legacy-redis.sh in a venv with redis-py < 6.

arq 0.28 and taskiq-redis 1.0 pin redis-py below 6, which the main venv (redis-py 8)
cannot hold, so these tests live outside the main run's ``testpaths``. They use the
suite's own fixtures and worker helpers from tests/.
"""

from __future__ import annotations

import importlib.util
import os
import sys

SUITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SUITE)

# tests/conftest.py under a name of its own: this file is "conftest" too.
_spec = importlib.util.spec_from_file_location("joblock_suite_conftest", os.path.join(SUITE, "conftest.py"))
assert _spec is not None and _spec.loader is not None
suite = importlib.util.module_from_spec(_spec)
sys.modules["joblock_suite_conftest"] = suite
_spec.loader.exec_module(suite)

TWINS = suite.TWINS
redis_server = suite.redis_server
pytest_report_header = suite.pytest_report_header
# In parallel, as the main suite runs: the tests mostly wait for arq's and taskiq's workers.
pytest_cmdline_main = suite.pytest_cmdline_main
