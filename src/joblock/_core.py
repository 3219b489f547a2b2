"""Chooses joblock's core: the compiled twin where it is built and allowed, else the pure one.

The one place that decides: ``JOBLOCK_NO_EXTENSIONS=1`` forces the pure twin, as does
any interpreter but CPython. Tests, benchmarks and scripts ask ``compiled()`` rather
than repeat the test. Type checkers see the pure twin.
"""

import importlib
import os
import platform
from types import ModuleType
from typing import TYPE_CHECKING

from . import _core_py


def compiled() -> ModuleType | None:
    """The compiled twin where it is built and allowed here; None otherwise."""
    if (
        os.environ.get("JOBLOCK_NO_EXTENSIONS", "") not in ("", "0")
        or platform.python_implementation() != "CPython"
    ):
        return None
    try:
        return importlib.import_module("joblock._core_c")
    except ImportError:
        return None


def name_of(module: ModuleType) -> str:
    """``"c"`` for the compiled twin, ``"python"`` for the pure one."""
    return "c" if module.__name__.endswith("_core_c") else "python"


core = _core_py if TYPE_CHECKING else compiled() or _core_py
implementation = name_of(core)

__all__ = ["compiled", "core", "implementation", "name_of"]
