"""Import Opacus without letting it reconfigure the root logger.

Opacus calls ``logging.basicConfig(format="%(asctime)s:%(levelname)s:%(message)s")`` when
it is imported (``opacus/utils/module_utils.py``). With an unconfigured root logger that
gives the root a handler, and from then on every record that reaches the root — and all of
Lightning's, when Lightning is imported afterwards (it adds its own handler only while the
root has none) — is printed with Opacus' timestamp format. :func:`import_opacus` imports
with a placeholder handler on the root, so ``basicConfig`` finds the root configured and does
nothing; a root logger the user configured is left as it is. Every Opacus import of this
package goes through it.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType


def import_opacus(name: str = "opacus") -> ModuleType:
    """``importlib.import_module(name)`` for an Opacus module, keeping the root logger as it was.

    Example:
        >>> PRVAccountant = import_opacus("opacus.accountants").PRVAccountant  # doctest: +SKIP
    """
    if not (name == "opacus" or name.startswith("opacus.")):
        raise ValueError(f"import_opacus imports Opacus modules only, got {name!r}")
    if name in sys.modules:
        return sys.modules[name]
    root = logging.getLogger()
    if root.handlers:  # configured (by the user or anyone): basicConfig would do nothing anyway
        return importlib.import_module(name)
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)
    try:
        return importlib.import_module(name)
    finally:
        root.removeHandler(placeholder)


__all__ = ["import_opacus"]
