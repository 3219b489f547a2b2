"""Builds joblock's compiled core, falling back to the pure twin when it cannot.

The core is cythonized when Cython is present and compiled from the C file shipped in
the sdist otherwise. When the C compiler fails, joblock installs without the compiled
core and says so in one line, with the compiler's first error lines, except under
cibuildwheel (CIBUILDWHEEL=1), where a wheel without its core must never be made.
JOBLOCK_NO_EXTENSIONS=1 skips the build.
"""

import os
import re
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


class BuildFailed(Exception):
    """The core could not be compiled; the message says why (the compiler's errors)."""


# A compiler's error lines: gcc's and clang's "error:", "fatal error:"; MSVC's "error C1083:".
_ERROR = re.compile(r"\berror( C\d+)?:", re.IGNORECASE)


def _why(e: BaseException, output: str = "") -> str:
    """What the notice shows: the compiler's first error lines, else the exception."""
    errors = [line.strip() for line in output.splitlines() if _ERROR.search(line)]
    return "; ".join(errors[:3]) or f"{type(e).__name__}: {e}"


class optional_build_ext(build_ext):
    """Turns a compiler failure into BuildFailed, so setup can go on without the core;
    compiles the modules in parallel, one per CPU (they are independent)."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.parallel = os.cpu_count() or 1  # (``-j N`` still overrides it)

    def run(self) -> None:
        try:
            super().run()
        except PlatformError as e:
            raise BuildFailed(_why(e)) from e

    def build_extensions(self) -> None:
        # The compiler writes its errors to the stderr it inherits (file descriptor 2),
        # not to Python's: captured around the builds so the notice can quote them.
        with _CapturedStderr() as stderr:
            try:
                super().build_extensions()
                return
            except (CCompilerError, ExecError, PlatformError, OSError) as e:
                failure = e
        raise BuildFailed(_why(failure, stderr.text)) from failure


class _CapturedStderr:
    """File descriptor 2 goes to a file while inside; on exit it is written on to the real
    stderr (nothing is lost) and kept in ``text``."""

    text = ""

    def __enter__(self) -> "_CapturedStderr":
        sys.stderr.flush()
        self._saved = os.dup(2)
        self._file = tempfile.TemporaryFile()
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        with self._file:
            self._file.seek(0)
            data = self._file.read()
        with os.fdopen(os.dup(2), "wb") as stderr:
            stderr.write(data)
        self.text = data.decode(errors="replace")


# The hot path above the core: every module with a .pxd beside it, compiled from the
# very source the pure build runs (Cython's pure-Python mode; see src/joblock/_core.py).
HOT_PATH = sorted(path.with_suffix("") for path in Path("src").glob("joblock/**/*.pxd"))


def _extensions() -> list[Extension]:
    modules = [(".".join(path.parts[1:]), str(path)) for path in HOT_PATH]
    try:
        from Cython.Build import cythonize
    except ImportError:
        # An sdist installed without Cython compiles the C files the sdist carries.
        return [Extension("joblock._core_c", ["src/joblock/_core_c.c"])] + [
            Extension(name, [f"{path}.c"]) for name, path in modules
        ]
    return cythonize(
        [Extension("joblock._core_c", ["src/joblock/_core_c.pyx"])]
        + [Extension(name, [f"{path}.py"]) for name, path in modules],
        # The .py files' annotations are for type checkers: the .pxd files say what is C.
        compiler_directives={"language_level": 3, "annotation_typing": False},
    )


def run_setup(with_core: bool) -> None:
    if with_core:
        setup(ext_modules=_extensions(), cmdclass={"build_ext": optional_build_ext})
    else:
        setup()


if _flag("JOBLOCK_NO_EXTENSIONS"):
    run_setup(False)
else:
    try:
        run_setup(True)
    except BuildFailed as e:
        if _flag("CIBUILDWHEEL"):
            raise
        # One line (scripts/check-dist.sh looks for it), whatever the compiler said.
        why = " ".join(str(e).split())
        print(
            f"joblock: the compiled core could not be built ({why}); installing the pure-Python core",
            file=sys.stderr,
        )
        run_setup(False)
