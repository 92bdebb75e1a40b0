"""Imports of optional dependencies, failing with the install command that provides them."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """``import module``, or an ``ImportError`` naming ``pip install "lightning_dp[<extra>]"``.

    Args:
        module: the module to import (e.g. ``"sklearn.datasets"``).
        extra: the setup.cfg extra that installs it (``"data"``, ``"report"``, ``"cli"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{module} is needed here and is not installed: pip install \"lightning_dp[{extra}]\" "
                          f"(or the [all] extra, which `make demo` installs).") from err
