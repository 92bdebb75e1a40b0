"""The copies of logged values held in memory, walked from an object's attributes, moved and put back.

From each attribute of an object (a logger, its experiment) :class:`Walk` looks :data:`DEPTH` levels deep through
dicts (and their subclasses), lists, tuples, namedtuples, deques, sets, the attributes of plain objects and
dataclasses (not a library's objects, modules or optimizers; not pandas frames), NumPy arrays and tensors, at most
:data:`NODES` of them, each of at most :data:`ITEMS` items (a larger one is not walked); strings (up to
:data:`TEXT` characters) as text (:func:`.text_files.rewrite_text`). A number there is a logged value's copy when a
logged name keys it (a dict's key, an attribute; also a list or an array of numbers under it), stands beside it
in a short row (``(step, "train_loss", 0.64)``, ``{"name": "train_loss", "value": 0.64}``) or by its value
(:class:`.logged_values.LoggedValues`). The copies of a name along a container move alternately (a history).

The attributes' top containers (a list, dict, deque or set) are changed in place (whoever else holds them reads the
moved values too); the containers and objects inside them are replaced by moved copies (never written). Every
mutable container walked and every attribute changed is put back after (:meth:`Walk.put_back`): its contents and
bindings as they were, what was added meanwhile dropped.
"""

from __future__ import annotations

import collections
import copy
import os
import types
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from lightning_dp.containers import held_items, put_back
from lightning_dp.records.library_objects import is_library
from lightning_dp.records.library_code import library_named
from lightning_dp.value_copies.logged_values import LoggedValues, as_float
from lightning_dp.value_copies.text_files import rewrite_text

__all__ = ["DEPTH", "ITEMS", "NODES", "SAME", "TEXT", "Walk"]

DEPTH, NODES, ITEMS, TEXT = 6, 20_000, 10_000, 1 << 16
"""How deep a walk goes, how many containers and numbers it looks at, how many items a container it walks holds at
most, and how long a string it reads."""
SAME = object()
"""Nothing moved."""
_ROW = 8  # a container of at most this many items naming a logged name is a row: its floats are that name's
_SERVICES = ("fsspec", "wandb", "mlflow", "neptune", "comet_ml", "tensorboardX", "pandas")
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType, nn.Module, torch.optim.Optimizer)
_MUTABLE = (list, dict, collections.deque, set)
Offset = Callable[[str], int]
Result = tuple[Any, set]


def _zero(name: str) -> int:
    return 0


class Walk:
    """One walk over the copies of ``logged`` values: what it moved, and what it puts back."""

    def __init__(self, logged: LoggedValues) -> None:
        self.logged = logged
        self.nodes = 0
        self._memo: dict[int, Result] = {}
        self._kept: list[Any] = []  # what was walked stays alive while its id is a memo's key
        self._containers: list[tuple[Any, Any]] = []
        self._bindings: list[tuple[Any, dict]] = []

    def in_place(self, holder: Any) -> None:
        """``holder``'s attributes with the copies in them moved: top containers in place, other values rebound."""
        attributes = dict(vars(holder))
        self._bindings.append((holder, attributes))
        self._memo[id(holder)] = (SAME, set())
        self._kept.append(holder)
        for key, value in attributes.items():
            new, _ = self.copy(value, DEPTH, _zero, self.logged.named(key))
            if new is SAME:
                continue
            if isinstance(value, _MUTABLE) and isinstance(new, _MUTABLE):
                _fill(value, new)
            else:
                _bind(holder, key, new)

    def put_back(self) -> None:
        """Every container walked holds what it held, every attribute changed is bound as it was."""
        for container, saved in reversed(self._containers):
            if not _alike(container, saved):
                _fill(container, saved)
        for holder, attributes in reversed(self._bindings):
            now = vars(holder)
            for key, value in attributes.items():
                if now.get(key, SAME) is not value:
                    _bind(holder, key, value)

    def copy(self, value: Any, depth: int, offset: Offset = _zero, context: Optional[str] = None,
             hint: Optional[str] = None) -> Result:
        """``value`` with the copies in it moved (:data:`SAME` if none) and the names moved; ``context``: the logged
        name keying it, ``hint``: the one its row names; the ``n``-th copy of a name moves at ``offset(name) + n``."""
        leaf = self._leaf(value, offset, context, hint)
        if leaf is not None:
            return leaf
        if depth <= 0 or self.nodes >= NODES:
            return SAME, set()
        if id(value) in self._memo:
            return self._memo[id(value)]
        self._memo[id(value)] = (SAME, set())  # a cycle reads it unmoved
        self._kept.append(value)
        self.nodes += 1
        result = self._container(value, depth - 1, offset, context)
        self._memo[id(value)] = result
        return result

    def _leaf(self, value: Any, offset: Offset, context: Optional[str], hint: Optional[str]) -> Optional[Result]:
        """A number, a string, an array or a tensor moved; ``None`` for a container."""
        if value is None or isinstance(value, (bool, bytes)):
            return SAME, set()
        if isinstance(value, str):
            if len(value) > TEXT or (os.sep in value and " " not in value):  # a path, not a line of text
                return SAME, set()
            text, names = rewrite_text(value, self.logged, offset)
            return (text if names else SAME), names
        array = isinstance(value, torch.Tensor) or (type(value).__module__ == "numpy" and hasattr(value, "dtype"))
        if array and getattr(value, "ndim", 0) > 0:
            return self._array(value, offset, context)
        if not (array or isinstance(value, (int, float))):
            return None
        self.nodes += 1
        x = as_float(value)
        if isinstance(value, torch.Tensor):
            floating = value.is_floating_point()
        else:
            floating = value.dtype.kind == "f" if array else isinstance(value, float)
        name = context if x is not None else None
        if floating and name is None:
            name = hint or self.logged.of(x)
        if name is None:
            return SAME, set()
        moved = self.logged.move(value if isinstance(value, (int, float, torch.Tensor)) else x, offset(name))
        return (value.dtype.type(moved) if array and not isinstance(value, torch.Tensor) else moved), {name}

    def _array(self, value: Any, offset: Offset, context: Optional[str]) -> Result:
        """A NumPy array or tensor with the floats in it that are copies moved (all of them under a logged name)."""
        tensor = isinstance(value, torch.Tensor)
        size = value.numel() if tensor else value.size
        if size > ITEMS or not (value.is_floating_point() if tensor else value.dtype.kind == "f"):
            return SAME, set()
        self.nodes += 1
        flat = value.detach().float().cpu().reshape(-1).tolist() if tensor else value.reshape(-1).tolist()
        counts: dict[str, int] = {}
        changed: dict[int, float] = {}
        for i, x in enumerate(flat):
            name = context or self.logged.of(x)
            if name is not None:
                changed[i] = float(self.logged.move(x, offset(name) + counts.get(name, 0)))
                counts[name] = counts.get(name, 0) + 1
        if not changed:
            return SAME, set()
        if tensor:
            out = value.detach().clone().contiguous()
            out.view(-1)[torch.tensor(list(changed), device=out.device)] = torch.tensor(
                list(changed.values()), dtype=out.dtype, device=out.device)
        else:
            out = value.copy()
            for i, x in changed.items():
                out.flat[i] = x
        return out, set(counts)

    def _container(self, value: Any, depth: int, offset: Offset, context: Optional[str]) -> Result:
        """A container (or an object's attributes) with the copies in it moved."""
        if isinstance(value, dict):
            if len(value) > ITEMS:
                return SAME, set()
            self._containers.append((value, dict(dict.items(value))))
            return self._mapping(value, list(dict.items(value)), depth, offset, _shallow)
        if isinstance(value, (list, tuple, collections.deque, set, frozenset)):
            return self._sequence(value, depth, offset, context)
        if hasattr(value, "__dict__") and not isinstance(value, _NOT_WALKED) and not is_library(value) \
                and not library_named(type(value), _SERVICES) and len(vars(value)) <= ITEMS:
            self._bindings.append((value, dict(vars(value))))
            return self._mapping(value, list(vars(value).items()), depth, offset, _clone)
        return SAME, set()

    def _mapping(self, value: Any, items: list, depth: int, offset: Offset, rebuilt: Callable[[Any, dict], Any]
                 ) -> Result:
        """A dict or an object whose ``items`` (keys or attribute names, values) hold copies, rebuilt."""
        hint = self._hint(v for _, v in items) if len(items) <= _ROW else None
        changed: dict[Any, Any] = {}
        names: set[str] = set()
        for key, item in items:
            new, moved = self.copy(item, depth, offset, self.logged.named(key), hint)
            if new is not SAME:
                changed[key] = new
                names |= moved
        if not changed:
            return SAME, set()
        out = rebuilt(value, changed)
        return (SAME, set()) if out is SAME else (out, names)

    def _sequence(self, value: Any, depth: int, offset: Offset, context: Optional[str]) -> Result:
        """A list, tuple, deque or set whose items hold copies, rebuilt; a name's copies along it move alternately."""
        items = list(value)
        if len(items) > ITEMS:
            return SAME, set()
        if isinstance(value, (list, collections.deque, set)):
            self._containers.append((value, list(value)))
        hint = self._hint(items) if len(items) <= _ROW else None
        counts: dict[str, int] = {}
        out: list[Any] = []
        names: set[str] = set()
        for item in items:
            before = dict(counts)

            def shifted(name: str, before: dict = before) -> int:
                return offset(name) + before.get(name, 0)

            leaf = self._leaf(item, shifted, context, hint)
            new, moved = leaf if leaf is not None else self.copy(item, depth, shifted)
            for name in moved:
                counts[name] = counts.get(name, 0) + 1
            out.append(item if new is SAME else new)
            names |= moved
        return (_rebuilt(value, out), names) if names else (SAME, set())

    def _hint(self, values: Iterable[Any]) -> Optional[str]:
        """The logged name a short row holds as a value (``(step, "train_loss", 0.64)``), if any."""
        return next((v for v in values if isinstance(v, str) and self.logged.named(v)), None)


def _shallow(value: dict, changed: dict) -> dict:
    """A shallow copy of the dict ``value`` (of its type where it copies itself: a ``defaultdict``) with ``changed``."""
    try:
        out = value.copy()
    except Exception:  # noqa: BLE001  (a dict subclass whose copy fails: a plain dict stands in)
        out = dict(value)
    out.update(changed)
    return out


def _clone(value: Any, changed: dict) -> Any:
    """A shallow copy of the object ``value`` with the attributes ``changed`` (:data:`SAME` if it does not copy)."""
    try:
        out = copy.copy(value)
        for key, new in changed.items():
            object.__setattr__(out, key, new)
    except Exception:  # noqa: BLE001  (an object that does not copy: left as it is)
        return SAME
    return out if out is not value else SAME


def _rebuilt(value: Any, items: list[Any]) -> Any:
    """A container of ``value``'s type holding ``items``."""
    if isinstance(value, list):
        out = list.__new__(type(value)) if type(value) is not list else []
        out.extend(items)
        return out
    if isinstance(value, collections.deque):
        return collections.deque(items, maxlen=value.maxlen)
    if hasattr(value, "_fields"):
        return type(value)._make(items)
    try:
        return type(value)(items)
    except Exception:  # noqa: BLE001  (a subclass built otherwise)
        return (set if isinstance(value, (set, frozenset)) else tuple)(items)


def _fill(container: Any, items: Any) -> None:
    """``container`` (a list, deque, set or dict) holds ``items`` (a list of them, or a dict) in place."""
    put_back(container, held_items(items))


def _alike(container: Any, saved: Any) -> bool:
    """Whether ``container`` holds what was ``saved`` of it (the same objects)."""
    if isinstance(container, dict):
        return dict.keys(container) == saved.keys() and all(dict.__getitem__(container, k) is v
                                                              for k, v in saved.items())
    now = list(container)
    return len(now) == len(saved) and all(a is b for a, b in zip(now, saved))


def _bind(holder: Any, key: str, value: Any) -> None:
    """``holder.key = value`` (also on an object that refuses ``setattr``: a frozen dataclass)."""
    try:
        setattr(holder, key, value)
    except Exception:  # noqa: BLE001
        object.__setattr__(holder, key, value)
