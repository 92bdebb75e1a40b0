"""Names bound in the user's modules, replaced for a block of runs again and put back after.

A hook that bound a clock or a source of entropy by name (``from time import perf_counter``, ``from os import
urandom``) reads it from its module's namespace, not from :mod:`time` or :mod:`os`: :mod:`.clock` and :mod:`.draws`
replace such bindings for their blocks with :func:`rebound`.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

__all__ = ["ModuleIndex", "rebound"]


@contextmanager
def rebound(namespaces: Iterable[tuple[dict[str, Any], Any]],
            replacing: Callable[[Any, Any], Any],
            on_put_back: Optional[Callable[[Any, Any], None]] = None) -> Iterator[None]:
    """Inside: in each namespace (a module's dict, taken once by identity, with a tag handed to ``replacing``), every
    value for which ``replacing(value, tag)`` returns a replacement is bound to that replacement; each is put back
    however the block ends, unless the name was bound to something else meanwhile (``on_put_back(value,
    replacement)`` called first: a stand-in's state handed to the original)."""
    swapped: list[tuple[dict[str, Any], str, Any, Any]] = []  # (namespace, name, its value, the replacement)
    try:
        seen: set[int] = set()
        for names, tag in namespaces:
            if id(names) in seen:
                continue
            seen.add(id(names))
            for key, value in list(names.items()):
                ours = replacing(value, tag)
                if ours is not None:
                    swapped.append((names, key, value, ours))
                    names[key] = ours
        yield
    finally:
        for names, key, value, ours in swapped:
            if names.get(key) is ours:
                if on_put_back is not None:
                    on_put_back(value, ours)
                names[key] = value


class ModuleIndex:
    """The loaded modules whose dict ``select(name, namespace, filename)`` keeps (it returns what to keep, or
    ``None``), scanned once per module object: :meth:`entries` brings the index up to date only when
    :data:`sys.modules` changed size (a few milliseconds for a thousand new modules; nothing otherwise). Used by
    :mod:`.clock` and :mod:`.draws` to find the user's modules binding a clock or a source of entropy by name."""

    def __init__(self, select: Callable[[str, dict[str, Any], str], Any]) -> None:
        self._select = select
        self._index: dict[str, Any] = {}  # module name → what select kept
        self._scanned: dict[str, int] = {}  # module name → id() of the module object scanned
        self._size = -1  # len(sys.modules) at the last scan

    def entries(self) -> list[Any]:
        """What ``select`` kept, for the modules loaded now."""
        if len(sys.modules) != self._size:
            for name, module in list(sys.modules.items()):
                if self._scanned.get(name) == id(module):
                    continue
                self._scanned[name] = id(module)
                self._index.pop(name, None)
                names = getattr(module, "__dict__", None)
                filename = getattr(module, "__file__", None) or ("<main>" if name == "__main__" else "")
                if isinstance(names, dict) and isinstance(filename, str):
                    kept = self._select(name, names, filename)
                    if kept is not None:
                        self._index[name] = kept
            self._size = len(sys.modules)
        return list(self._index.values())
