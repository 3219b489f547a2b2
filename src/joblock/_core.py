"""Chooses joblock's core: the compiled twin when it is built, the pure one otherwise.

``JOBLOCK_NO_EXTENSIONS=1`` forces the pure twin. Type checkers see the pure twin.
"""

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING or os.environ.get("JOBLOCK_NO_EXTENSIONS", "") not in ("", "0"):
    from . import _core_py as core
else:
    try:
        from . import _core_c as core  # type: ignore[no-redef]
    except ImportError:
        from . import _core_py as core  # type: ignore[no-redef]

implementation = "c" if core.__name__.endswith("_core_c") else "python"

__all__ = ["core", "implementation"]
