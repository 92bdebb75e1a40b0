"""Lazy package exports (PEP 562): ``from lightning_dp import DPStrategy`` imports the strategy (and
Lightning) only when the name is first used, so ``import lightning_dp.mechanism`` stays torch-only
and ``lightning-dp --help`` starts fast."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving ``name`` to ``exports[name]``'s attribute of the same name.

    Args:
        package: the package's ``__name__`` (for the error message).
        exports: public name -> module that defines it.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
