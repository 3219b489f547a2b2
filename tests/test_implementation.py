"""Which core is active, and that the compiled one really loaded wherever it was built."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import joblock
import joblock._core
from conftest import TWINS
from joblock import _core_py

PACKAGE_DIR = Path(joblock.__file__).parent


def flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def compiled_files() -> list[Path]:
    """The compiled twins in the package directory that this interpreter can load."""
    return [PACKAGE_DIR / f"_core_c{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES
            if (PACKAGE_DIR / f"_core_c{suffix}").exists()]  # fmt: skip


def printed(code: str, **env: str) -> str:
    """What ``code`` prints in a fresh interpreter with ``env`` (and this one's sys.path)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env}
    done = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def active_core(**env: str) -> str:
    """``implementation`` and the core module's name in a fresh interpreter with ``env``."""
    code = "import joblock, joblock._core as d; print(joblock.implementation, d.core.__name__)"
    return printed(code, **env)


def test_implementation_names_the_active_core() -> None:
    assert joblock.implementation in ("c", "python")
    assert joblock.implementation == joblock._core.implementation
    expected = "joblock._core_c" if joblock.implementation == "c" else "joblock._core_py"
    assert joblock._core.core.__name__ == expected


def test_compiled_core_is_active_wherever_it_was_built() -> None:
    expect_c = bool(compiled_files()) and not flag("JOBLOCK_NO_EXTENSIONS")
    no_extensions = os.environ.get("JOBLOCK_NO_EXTENSIONS")
    assert joblock.implementation == ("c" if expect_c else "python"), (
        f"compiled files: {compiled_files()}, JOBLOCK_NO_EXTENSIONS={no_extensions!r}"
    )
    if expect_c:
        from joblock import _core_c

        assert joblock._core.core is _core_c
        assert TWINS["c"] is _core_c


def test_compiled_core_is_present_when_required() -> None:
    # CI sets JOBLOCK_REQUIRE_C=1 where it built the extension: a silent fallback to
    # the pure twin there would leave the compiled core untested.
    if not flag("JOBLOCK_REQUIRE_C"):
        return
    assert compiled_files(), f"JOBLOCK_REQUIRE_C is set but {PACKAGE_DIR} holds no compiled _core_c"
    assert not flag("JOBLOCK_NO_EXTENSIONS"), "JOBLOCK_REQUIRE_C and JOBLOCK_NO_EXTENSIONS are both set"
    assert joblock.implementation == "c"
    assert "c" in TWINS


@pytest.mark.parametrize("value", ["1", "yes"])
def test_no_extensions_forces_the_pure_core(value: str) -> None:
    assert active_core(JOBLOCK_NO_EXTENSIONS=value) == "python joblock._core_py"


@pytest.mark.parametrize("value", ["", "0"])
def test_no_extensions_off_picks_the_compiled_core_when_built(value: str) -> None:
    expected = "c joblock._core_c" if compiled_files() else "python joblock._core_py"
    assert active_core(JOBLOCK_NO_EXTENSIONS=value) == expected


def test_pure_core_reads_replies_with_hiredis_when_importable() -> None:
    if importlib.util.find_spec("hiredis") is None:
        assert _core_py.Reader is _core_py.PyReader
        return
    import hiredis

    assert type(_core_py.Reader()) is hiredis.Reader


def test_pure_core_without_hiredis_reads_replies_with_pyreader() -> None:
    twin = TWINS["python-nohiredis"]
    assert twin.Reader is twin.PyReader
    assert type(twin.Reader()) is twin.PyReader


def test_compiled_core_has_its_own_reader() -> None:
    compiled = TWINS.get("c")
    assert compiled is None or type(compiled.Reader()).__module__ == "joblock._core_c"


# -- the hot path: compiled from its own sources, by the same switch -----------------------

# The sources' tree (a checkout or an sdist): the wheel installed from it carries no .pxd.
SOURCES = Path(__file__).resolve().parents[1] / "src"


def hot_path_modules() -> list[str]:
    """The modules setup.py compiles from their .py: those with a .pxd beside them."""
    names = sorted(
        ".".join(p.with_suffix("").relative_to(SOURCES).parts) for p in SOURCES.glob("joblock/**/*.pxd")
    )
    assert names, f"no .pxd under {SOURCES}"
    return names


def loaded_from(module_name: str, **env: str) -> str:
    """The file a fresh interpreter with ``env`` loads ``module_name`` from."""
    return printed(f"import joblock, {module_name} as m; print(m.__file__)", **env)


def is_extension(path: str | None) -> bool:
    return (path or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_the_hot_path_runs_compiled_exactly_when_the_core_does() -> None:
    # (JOBLOCK_REQUIRE_C=1 makes the core's compiled twin required: the hot path's too, then.)
    for name in hot_path_modules():
        module = importlib.import_module(name)
        assert is_extension(module.__file__) == (joblock.implementation == "c"), (
            f"{name} is loaded from {module.__file__}, implementation {joblock.implementation}"
        )


def test_no_extensions_loads_the_hot_path_from_its_sources() -> None:
    for name in hot_path_modules():
        where = loaded_from(name, JOBLOCK_NO_EXTENSIONS="1")
        assert where.endswith(name.rpartition(".")[2] + ".py"), where
