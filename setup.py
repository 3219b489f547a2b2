"""Builds joblock's compiled core, falling back to the pure twin when it cannot.

The core is cythonized when Cython is present and compiled from the C file shipped in
the sdist otherwise. When the C compiler fails, joblock installs without the compiled
core and says so in one line, except under cibuildwheel (CIBUILDWHEEL=1), where a wheel
without its core must never be made. JOBLOCK_NO_EXTENSIONS=1 skips the build.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


class BuildFailed(Exception):
    pass


class optional_build_ext(build_ext):
    """Turns a compiler failure into BuildFailed, so setup can go on without the core."""

    def run(self) -> None:
        try:
            super().run()
        except PlatformError as e:
            raise BuildFailed() from e

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError, OSError) as e:
            raise BuildFailed() from e


def _extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        # An sdist installed without Cython compiles the C file the sdist carries.
        return [Extension("joblock._core_c", ["src/joblock/_core_c.c"])]
    return cythonize(
        [Extension("joblock._core_c", ["src/joblock/_core_c.pyx"])],
        compiler_directives={"language_level": 3},
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
    except BuildFailed:
        if _flag("CIBUILDWHEEL"):
            raise
        print(
            "joblock: the compiled core could not be built; installing the pure-Python core", file=sys.stderr
        )
        run_setup(False)
