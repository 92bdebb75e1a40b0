"""Objects told apart by identity across time, not by ``id`` alone.

``id(obj)`` is an address: once ``obj`` is freed the next object of its size may take it (CPython hands freed memory
to the next allocation of the same size at once). A map keyed by ``id`` that outlives its objects, or a token that
holds an ``id`` and is compared later, then judges a new object as the freed one: a false refusal, or a missed check
(a dataset's running mean rebound at every read came back at its baseline's address and was taken as unchanged).

* :class:`Same` holds an object in a token and compares by ``is``: the object lives as long as the token, so no other
  object can take its ``id`` meanwhile.
* :class:`IdentityMap` maps objects by identity for as long as the map lives; an entry holds a weak reference to its
  object (dropped when the object is freed), or the object itself when it takes none (a ``dict``, a ``list``).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Generic, Optional, TypeVar

V = TypeVar("V")


class Same:
    """An object in a token, compared by identity and *held*: an attribute rebound to a new object at each step is
    seen even when the old object is freed, since the token that saw it keeps it alive until it is compared: a new
    object never takes its id."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"Same({type(self.obj).__name__} at {id(self.obj):#x})"


class IdentityMap(Generic[V]):
    """A dict keyed by the identity of its keys (any object, hashable or not), whose entry for a freed object is gone
    before another object can take its ``id``."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[Callable[[], Any], V]] = {}

    def _held(self, obj: Any) -> Optional[tuple[Callable[[], Any], V]]:
        held = self._items.get(id(obj))
        return held if held is not None and held[0]() is obj else None

    def get(self, obj: Any, default: Any = None) -> Any:
        """The value of ``obj`` (this very object), or ``default``."""
        held = self._held(obj)
        return default if held is None else held[1]

    def __contains__(self, obj: Any) -> bool:
        return self._held(obj) is not None

    def __setitem__(self, obj: Any, value: V) -> None:
        key = id(obj)

        def gone(ref: Any) -> None:
            entry = self._items.get(key)
            if entry is not None and entry[0] is ref:
                del self._items[key]

        try:
            ref: Callable[[], Any] = weakref.ref(obj, gone)
        except TypeError:  # takes no weak reference: held alive instead, as long as the map
            ref = (lambda kept: lambda: kept)(obj)
        self._items[key] = (ref, value)

    def setdefault(self, obj: Any, default: V) -> V:
        """The value of ``obj``, set to ``default`` first when it has none."""
        held = self._held(obj)
        if held is None:
            self[obj] = default
            return default
        return held[1]
