"""What a dataset's reads write besides its records: state derived from all of them, recomputed for every read.

A ``__getitem__`` that computes the whole tensor's mean and standard deviation on its first read and keeps them on the
dataset (``if self._stats is None: self._stats = (self.x.mean(0), self.x.std(0))``; a ``functools.cached_property``;
a ``functools.lru_cache`` method; a global set on first use) makes every record depend on every row, like the same
normalisation computed on every read. But the first read fills the cache from the real data, and reading a record
again with rows exchanged (:mod:`.shared_records`) finds the statistics already computed: the dependence does not
show. :class:`ReadWrites` makes that exchange faithful:

* before any read it notes the state a read could write: the attributes of the datasets, of the objects of the
  user's classes they hold (a transform fitted on first use) and of the datasets' own classes, the module-level
  globals of those classes' modules — each value by identity, the items of a list, dict or set of at most
  :data:`MAX_ITEMS` by identity —, and the sizes of the ``functools.lru_cache`` functions among them;
* after the first reads (:meth:`settle`) it knows what they wrote;
* before every exchanged read it puts that back as it was (:meth:`reset`), so the read computes it again from the data
  as exchanged;
* after the check it puts back everything the exchanged reads changed as the first reads left it (:meth:`restore`):
  the dataset is left as the plain reads of the checks leave it, its caches computed from the data as it is (an
  ``lru_cache`` the reads fill is emptied).

A dataset whose reads write its tensors or NumPy arrays in place (a decode cache filled on the first read, behind a
flag) is left alone — nothing is put back: with its flags put back, an exchanged read would write exchanged values into
its data. Nor are writes put back that the first reads did not make, nor items of larger containers. Cost: one pass
over the attributes and globals before the reads, one after; then, per read, the few attributes the reads write.
"""

from __future__ import annotations

import hashlib
import types
from typing import Any, Iterable, Optional

import numpy as np
from torch import Tensor

from lightning_dp.containers import held_items, put_back
from lightning_dp.fingerprints.dataset_tokens import dataset_parts
from lightning_dp.fingerprints.state_walker import user_modules
from lightning_dp.records.library_code import library_type

MAX_ITEMS = 65_536
"""Containers of more items are compared by identity only (their items are not put back)."""

SAMPLED_BYTES = 1 << 24
"""NumPy arrays of more bytes are compared (for a write in place) on a strided sample of this many bytes."""

_ABSENT = object()


class ReadWrites:
    """The state ``dataset``'s reads may write (module docstring), noted now: before the dataset is first read."""

    def __init__(self, dataset: Any) -> None:
        datasets, tensors = dataset_parts(dataset)
        self._owners = _owners(datasets)
        self._before = {id(o): _note(o) for o in self._owners}
        self._caches = {id(f): (f, f.cache_info().currsize) for o in self._owners for f in _lru_caches(o)}
        self._arrays = _arrays(self._owners, [t for _, t in tensors])
        self._written: list[tuple[Any, str]] = []
        self._after: dict[int, dict[str, tuple[Any, Any]]] = {}
        self._cleared: list[Any] = []
        self.active = False

    def settle(self, exchanged: Iterable[Any] = ()) -> None:
        """After the first reads: note what they wrote; the reset is active unless they wrote data in place, or a
        list the exchange writes (``exchanged``: its items are the exchange's, never put back)."""
        written_in_place = any(_array_token(a) != token for a, token in self._arrays)
        self._written = [(o, key) for o in self._owners for key in _changed(o, self._before[id(o)])]
        self._after = {id(o): _note(o) for o in self._owners}
        self._cleared = [f for f, size in self._caches.values() if f.cache_info().currsize != size]
        touched = {id(_value(o, key)) for o, key in self._written} | {
            id(self._before[id(o)].get(key, (_ABSENT,))[0]) for o, key in self._written}
        self.active = bool(self._written or self._cleared) and not written_in_place \
            and not touched & {id(a) for a in exchanged}

    @property
    def written(self) -> list[str]:
        """What the first reads wrote, by name (``Class.attribute``, ``module.global``)."""
        return [f"{_label(o)}.{key}" for o, key in self._written] + [getattr(f, "__qualname__", "?")
                                                                    for f in self._cleared]

    def reset(self) -> None:
        """Before an exchanged read: what the first reads wrote, put back as it was before them."""
        if not self.active:
            return
        for owner, key in self._written:
            _put_back(owner, key, self._before[id(owner)].get(key))
        for function in self._cleared:
            function.cache_clear()

    def restore(self) -> None:
        """After the check: everything the exchanged reads changed put back as the first reads left it (computed
        from the data as it is); the ``lru_cache`` functions they filled emptied."""
        if not self.active:
            return
        for owner in self._owners:
            after = self._after[id(owner)]
            for key in _changed(owner, after):
                _put_back(owner, key, after.get(key))
        for function in self._cleared:
            function.cache_clear()


def _owners(datasets: list[Any]) -> list[Any]:
    """The datasets, the objects of the user's classes they hold, their classes of the user's code and those
    classes' modules."""
    owners: list[Any] = []
    seen: set[int] = set()

    def add(owner: Any) -> None:
        if id(owner) not in seen:
            seen.add(id(owner))
            owners.append(owner)

    for d in datasets:
        add(d)
        for value in list(_namespace(d).values()):
            if _user_object(value):
                add(value)
    classes = {cls for o in list(owners) for cls in type(o).__mro__ if _users(cls)}
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        add(cls)
    for module in user_modules(type(d) for d in datasets):
        add(module)
    return owners


def _users(cls: type) -> bool:
    return not library_type(cls)


def _user_object(value: Any) -> bool:
    """An instance of a class of the user's code (not a class, module or function; not a tensor or array)."""
    return (hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType, types.FunctionType,
                                                                  types.MethodType, Tensor, np.ndarray))
            and _users(type(value)))


def _namespace(owner: Any) -> dict[str, Any]:
    try:
        names = vars(owner)
    except TypeError:
        return {}
    return {k: v for k, v in names.items() if not (k.startswith("__") and k.endswith("__"))}


def _label(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    return owner.__qualname__ if isinstance(owner, type) else type(owner).__name__


def _items(value: Any) -> Any:
    """A shallow copy of a list's, dict's or set's items (``None``: not one, or larger than :data:`MAX_ITEMS`)."""
    if isinstance(value, (list, dict, set)) and len(value) <= MAX_ITEMS:
        return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else set(value)
    return None


def _note(owner: Any) -> dict[str, tuple[Any, Any]]:
    """Each name of ``owner``: (value, its items)."""
    return {key: (value, _items(value)) for key, value in _namespace(owner).items()}


def _same_items(value: Any, items: Any) -> bool:
    if items is None:
        return True
    if len(value) != len(items):
        return False
    if isinstance(value, dict):
        return all(k in items and items[k] is v for k, v in value.items())
    if isinstance(value, list):
        return all(a is b for a, b in zip(value, items))
    return value == items


def _changed(owner: Any, before: dict[str, tuple[Any, Any]]) -> list[str]:
    now = _namespace(owner)
    changed = [key for key in before if key not in now or now[key] is not before[key][0]
               or not _same_items(now[key], before[key][1])]
    return changed + [key for key in now if key not in before]


def _value(owner: Any, key: str) -> Any:
    return _namespace(owner).get(key, _ABSENT)


def _put_back(owner: Any, key: str, before: Optional[tuple[Any, Any]]) -> None:
    """``owner.key`` as noted (``before``: value and items; ``None``: it did not exist)."""
    if before is None:
        if key in _namespace(owner):
            if isinstance(owner, (type, types.ModuleType)):
                delattr(owner, key)
            else:
                del vars(owner)[key]
        return
    value, items = before
    if items is not None and not _same_items(value, items):
        put_back(value, held_items(items))  # (the copy's items: a dict's pairs)
    if _value(owner, key) is not value:
        if isinstance(owner, (type, types.ModuleType)):
            setattr(owner, key, value)
        else:
            vars(owner)[key] = value  # past a __setattr__ of the user's


def _lru_caches(owner: Any) -> list[Any]:
    return [v for v in _namespace(owner).values() if callable(getattr(v, "cache_clear", None))
            and callable(getattr(v, "cache_info", None))]


def _arrays(owners: list[Any], tensors: list[Tensor]) -> list[tuple[Any, Any]]:
    """The tensors and NumPy arrays the datasets and the owners hold, with what shows a write in place."""
    found: dict[int, Any] = {id(t): t for t in tensors}
    for owner in owners:
        for value in _namespace(owner).values():
            if isinstance(value, (Tensor, np.ndarray)):
                found.setdefault(id(value), value)
    return [(a, _array_token(a)) for a in found.values()]


def _array_token(array: Any) -> Any:
    """A tensor's version counter; a NumPy array's digest (of a strided sample when large)."""
    if isinstance(array, Tensor):
        return array._version
    if array.dtype.hasobject or array.size == 0:
        return None
    flat = array.reshape(-1)
    step = max(1, flat.nbytes // SAMPLED_BYTES)
    return hashlib.blake2b(np.ascontiguousarray(flat[::step]).view(np.uint8), digest_size=16).digest()
