"""Chooses joblock's build: compiled where it is built and allowed, else pure Python.

The one place that decides: ``JOBLOCK_NO_EXTENSIONS=1`` forces the pure build, as does
any interpreter but CPython. Two kinds of module are compiled:

- the core (``_core_c.pyx``), whose pure twin ``_core_py`` is a module of its own: the
  clients take whichever ``core`` is (tests pass either twin to a client);
- the hot path above it (the engine's requests, operations, wire and drivers, and the
  clients' single-lock calls), compiled by Cython from the very ``.py`` sources the pure
  build runs, each with a ``.pxd`` beside it (its C declarations; Cython's pure-Python
  mode). A compiled module sits next to its source and Python prefers it, so where
  compiled modules are not allowed, ``Sources`` makes joblock's modules load from their
  sources.

Tests, benchmarks and scripts ask ``compiled()`` rather than repeat the test. Type
checkers see the pure twin.
"""

import importlib
import importlib.machinery
import os
import platform
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from . import _core_py


def extensions_allowed() -> bool:
    """Whether compiled modules may be used here (the core's and the hot path's)."""
    return (
        os.environ.get("JOBLOCK_NO_EXTENSIONS", "") in ("", "0")
        and platform.python_implementation() == "CPython"
    )


class Sources:
    """Finds joblock's modules among their sources only, passing over compiled ones."""

    _loaders = (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES)

    @classmethod
    def find_spec(
        cls, name: str, path: Sequence[str] | None = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is None or not name.startswith(__package__ + "."):
            return None
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, cls._loaders).find_spec(name)
            if spec is not None:
                return spec
        return None  # no source (the core's compiled twin): the usual finders look


def compiled() -> ModuleType | None:
    """The compiled twin where it is built and allowed here; None otherwise."""
    if not extensions_allowed():
        return None
    try:
        return importlib.import_module("joblock._core_c")
    except ImportError:
        return None


def name_of(module: ModuleType) -> str:
    """``"c"`` for the compiled twin, ``"python"`` for the pure one."""
    return "c" if module.__name__.endswith("_core_c") else "python"


if not extensions_allowed():
    sys.meta_path.insert(0, Sources)  # before joblock imports any module that may be compiled

core = _core_py if TYPE_CHECKING else compiled() or _core_py
implementation = name_of(core)

__all__ = ["Sources", "compiled", "core", "extensions_allowed", "implementation", "name_of"]
