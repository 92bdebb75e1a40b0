"""The attribute names a library's object held when the release boundary first saw it (:class:`FirstFields`).

Objects of other libraries (torch's, Lightning's: a ``DataLoader``, a sampler, a ``Trainer``, an optimizer) are not
walked into: what they hold is the library's, it changes as the library runs (a loader's iterator, a trainer's
timers), and reading it all would cost every fingerprint. What a step *adds* to one (``loader.center =
batch[0].mean(0)`` on the training loader held as a global) is the user's state all the same, read back by the next
forward: the walk reads those names (:func:`~lightning_dp.fingerprints.state_walker.added_attributes`), told apart
by this record of the names each object had when first seen.

Objects are told by identity, not by ``id`` alone: a new object at a freed one's address is seen anew (its own
fields are not added state). An entry is dropped when its object is collected; one that takes no weak reference
is held alive instead (rare: such objects have no ``__dict__`` as a rule)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional


class FirstFields:
    """Per object, the names in its ``__dict__`` when :meth:`known` was first asked about it."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[Callable[[], Any], frozenset[str]]] = {}

    def known(self, obj: Any, fields: dict[str, Any]) -> frozenset[str]:
        """The names ``obj`` held when first seen; ``fields`` (its ``__dict__`` now) the first time."""
        key = id(obj)
        held = self._held.get(key)
        if held is not None and held[0]() is obj:
            return held[1]
        try:
            ref: Callable[[], Any] = weakref.ref(obj, lambda dead, k=key: self._drop(k, dead))
        except TypeError:  # takes no weak reference: held alive instead
            ref = (lambda kept: lambda: kept)(obj)
        names = frozenset(fields)
        self._held[key] = (ref, names)
        return names

    def seen(self, obj: Any) -> Optional[frozenset[str]]:
        """The names ``obj`` held when first seen, ``None`` when it was not yet (recording nothing)."""
        held = self._held.get(id(obj))
        return held[1] if held is not None and held[0]() is obj else None

    def _drop(self, key: int, dead: Any) -> None:
        held = self._held.get(key)
        if held is not None and held[0] is dead:  # (not a newer object's entry at the same address)
            del self._held[key]

    def __len__(self) -> int:
        return len(self._held)


FIRST_SEEN = FirstFields()
"""The record the release boundary's fingerprints share (an object first seen by one fit's is known to the next's:
what a first fit added to a loader the user keeps is added state in the second too), and the snapshots that put
the passes' writes back read (:mod:`~lightning_dp.validators.snapshot`)."""
