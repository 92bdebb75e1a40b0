"""Lazy package exports (PEP 562): ``from lightning_dp import DPStrategy`` imports the strategy (and
Lightning) only when the name is first used, so ``import lightning_dp.privacy`` stays torch-only
and ``lightning-dp --help`` starts fast."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Callable, Optional


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


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``callback`` right after module ``name`` has been imported (see :func:`after_import`)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback
        self._loader: Optional[importlib.abc.Loader] = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[ModuleSpec]:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one use; the other finders locate the real module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: ModuleSpec) -> Any:
        assert self._loader is not None
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        assert self._loader is not None
        module.__spec__.loader = self._loader  # type: ignore[union-attr]
        self._loader.exec_module(module)
        self.callback()


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` once module ``name`` is imported: now if it already is, else right after its
    import (whichever order the user imports packages in). Used to register ``strategy="dp"`` in
    Lightning's registry without importing Lightning with ``lightning_dp``."""
    if name in sys.modules:
        callback()
    elif importlib.util.find_spec(name.partition(".")[0]) is not None:
        sys.meta_path.insert(0, _AfterImport(name, callback))
