"""The user's helper modules: the Python modules of the user's own code that the training script reaches by import.

The fingerprint reads the module-level globals of the modules that define the user's LightningModule and callbacks
(:func:`~lightning_dp.fingerprints.state_walker.user_modules`). A step can as well write to the globals of a module
those import (``import utils`` then ``utils.MEMORY.append(x)``, or a function ``utils.remember(x)`` that writes its
own module's globals): the data would be kept outside the release where no check looks. :func:`helper_modules`
finds them — the modules a user module holds as a global (``import utils``), or whose functions and classes it holds
(``from utils import remember``), followed :data:`MAX_HOPS` imports deep — when they are the user's code: a module
whose file lies outside the interpreter's standard library and installed packages (``site-packages``), and whose
top-level name is not a known library's. Modules of installed packages are libraries: their globals are their own
caches, not the user's state.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import types
from typing import Iterable, Optional

from lightning_dp.records.library_code import defining_modules
from lightning_dp.records.library_objects import LIBRARY_PREFIXES

MAX_HOPS = 3
"""Imports followed from the modules defining the user's classes (a helper of a helper of a helper)."""

MAX_MODULES = 64
"""Helper modules read at most (the walk stops there: a project's code, not a package tree)."""


def _installed_roots() -> tuple[str, ...]:
    """Where the standard library and installed packages live (their modules are not the user's code)."""
    paths = sysconfig.get_paths()
    roots = {paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        roots.update(site.getsitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    roots.add(site.getusersitepackages())
    return tuple(os.path.realpath(root) + os.sep for root in roots if root)


_ROOTS: Optional[tuple[str, ...]] = None
_USER_CODE: dict[str, bool] = {}  # a module's name → whether it is the user's code (its file does not move)


def is_user_code(module: types.ModuleType) -> bool:
    """Whether ``module`` is the user's own code: a file outside the standard library and installed packages, its
    top-level name not a known library's (``__main__`` of a script counts; a built-in module does not)."""
    global _ROOTS
    name = getattr(module, "__name__", "") or ""
    known = _USER_CODE.get(name)
    if known is None:
        path = getattr(module, "__file__", None)
        if _ROOTS is None:
            _ROOTS = _installed_roots()
        known = bool(path) and name.split(".")[0] not in LIBRARY_PREFIXES \
            and not os.path.realpath(path).startswith(_ROOTS)
        _USER_CODE[name] = known
    return known


def _reached(module: types.ModuleType) -> Iterable[types.ModuleType]:
    """The modules ``module``'s globals hold, or define the functions and classes its globals hold."""
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType):
            yield value
        elif isinstance(value, (types.FunctionType, type)):
            for name in defining_modules(value):  # where its code lies, not only the `__module__` it claims
                owner = sys.modules.get(name)
                if owner is not None:
                    yield owner


def helper_modules(modules: Iterable[types.ModuleType]) -> list[types.ModuleType]:
    """The user's code reached from ``modules`` by import (:data:`MAX_HOPS` deep, :data:`MAX_MODULES` at most), those
    given left out, in the order found."""
    seen = {id(m) for m in modules}
    frontier, found = list(modules), []
    for _ in range(MAX_HOPS):
        following = []
        for module in frontier:
            for reached in _reached(module):
                if id(reached) in seen or not is_user_code(reached):
                    continue
                seen.add(id(reached))
                found.append(reached)
                following.append(reached)
                if len(found) >= MAX_MODULES:
                    return found
        frontier = following
    return found
