"""Names bound in the user's modules, replaced for a block of runs again and put back after.

A hook that bound a clock or a source of entropy by name (``from time import perf_counter``, ``from os import
urandom``) reads it from its module's namespace, not from :mod:`time` or :mod:`os`: :mod:`.clock` and :mod:`.draws`
replace such bindings for their blocks with :func:`rebound`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

__all__ = ["rebound"]


@contextmanager
def rebound(namespaces: Iterable[tuple[dict[str, Any], Any]],
            replacing: Callable[[Any, Any], Any]) -> Iterator[None]:
    """Inside: in each namespace (a module's dict, taken once by identity, with a tag handed to ``replacing``), every
    value for which ``replacing(value, tag)`` returns a replacement is bound to that replacement; each is put back
    however the block ends, unless the name was bound to something else meanwhile."""
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
                names[key] = value
