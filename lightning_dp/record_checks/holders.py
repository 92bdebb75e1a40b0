"""Where copies of the training data may be kept: a bounded walk of what the model, the datamodule, the callbacks and
the user's globals hold (:func:`held_arrays`), for :func:`~lightning_dp.record_checks.outside_records.training_copies`.

The walk goes breadth first (the shallowest holdings first) through attributes of plain objects (a helper class, a
third-party estimator such as scikit-learn's), dicts, lists, tuples and deques of any nesting up to :data:`MAX_DEPTH`,
the state of callables (a ``functools.partial``'s arguments, a function's defaults and closure cells, a bound
method's object), the parameters and buffers of modules held outside the model (a callback's ``nn.Embedding``) and
the buffers that compiled extension types expose (a scikit-learn tree's data), the slots of a ``__slots__`` object, a
function's own attributes. It stops after :data:`MAX_VISITED` objects, and does not enter classes, imported modules,
nor the framework's own objects (torch, Lightning, lightning_dp, NumPy internals: the trainer, the strategy, a
sampler), whose copies of a batch are not the user's — except, for the exchange of the training data's copies, a
``DataLoader``'s dataset (``loaders``) and the optimizers and schedulers the judged code runs in, given as holders
(:func:`code_holders`: their attributes, rate functions and classes of the user's; not the released state).
A container whose items are records one each — ``{i: (x_i, y_i)}``, ``[(x_i, y_i), ...]`` — gives
:class:`RowItems`, one per component of its items, exchanged item by item.
"""

from __future__ import annotations

import collections
import functools
import itertools
import types
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_dp.records.library_objects import framework_keys
from lightning_dp.records.library_code import library_rooted, library_type

MAX_DEPTH = 8
"""Attribute or item levels below a holder that are walked."""

MAX_VISITED = 20000
"""Objects visited in one walk, all holders together (the walk runs at every batch check)."""

MAX_ROW_ITEMS = 1 << 17
"""Items of a container of per-record items beyond which it is not taken for records (nor exchanged)."""

WALKED_ITEMS = 64
"""Items of a container walked one by one (beside a :class:`RowItems` reading of all of them)."""

_OPAQUE = frozenset({"torch", "pytorch_lightning", "lightning", "lightning_fabric", "lightning_dp", "numpy",
                     "builtins", "typing", "abc", "logging", "threading", "_thread", "multiprocessing", "weakref"})
_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype, torch.device)


class RowItems:
    """Records stored one per item of a container: ``arrays`` holds one component of every item (a tensor or a
    NumPy array each, all of one shape and dtype), exchanged one by one."""

    def __init__(self, arrays: list[Any]) -> None:
        self.arrays = arrays
        self.flips: Optional[list[Any]] = None  # the exchange's in-place flips, made at the first

    def __len__(self) -> int:
        return len(self.arrays)

    def sample(self, count: int) -> Optional[Tensor]:
        """Up to ``count`` items spread over the container, stacked (rows along dimension 0); ``None`` if empty."""
        if not self.arrays:
            return None
        picked = np.linspace(0, len(self.arrays) - 1, min(len(self.arrays), count)).round().astype(np.int64)
        rows = [_plain(self.arrays[i]) for i in picked]
        return torch.stack(rows) if all(r is not None for r in rows) else None


def _plain(value: Any) -> Optional[Tensor]:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
        return torch.from_numpy(np.ascontiguousarray(value))
    return None


def held_arrays(holders: Iterable[tuple[str, Any]], loaders: bool = False) -> Iterator[tuple[str, Any]]:
    """(path, tensor or NumPy array or :class:`RowItems`) the holders keep (module docstring). A module holder's
    buffers and its modules' own attributes (not its parameters: weights, not records); a Python module's globals;
    another holder's attributes. ``loaders``: the dataset of a ``DataLoader`` reached is walked too (a second loader
    over a cloned training set kept as a global: for the exchange of the training data's copies, which takes only
    arrays holding training records — a held-out loader's data is not given other values)."""
    walk = _Walk(loaders)
    for label, owner in holders:
        if isinstance(owner, nn.Module):
            yield from walk.model(owner)
        elif isinstance(owner, types.ModuleType):
            walk.seen.add(id(owner))
            walk.attributes(f"the global {owner.__name__}.", owner, 1)
        else:
            walk.seen.add(id(owner))
            walk.attributes(f"{label}.", owner, 1)
    yield from walk.run()


class _Walk:
    """One breadth-first walk: a queue of (path, object, depth), the objects seen and the budget left."""

    def __init__(self, loaders: bool = False) -> None:
        self.queue: collections.deque[tuple[str, Any, int]] = collections.deque()
        self.seen: set[int] = set()
        self.budget = MAX_VISITED
        self.loaders = loaders

    def model(self, owner: nn.Module) -> Iterator[tuple[str, Any]]:
        """The model's buffers now, its modules' attributes queued; its modules and parameters never walked again."""
        for name, b in owner.named_buffers():
            self.seen.add(id(b))
            yield f"the model's buffer {name}", b
        self.seen.update(id(p) for p in owner.parameters())
        for prefix, m in owner.named_modules():
            self.seen.add(id(m))
            self.attributes(f"the model's attribute {prefix + '.' if prefix else ''}", m, 1, framework_keys())

    def attributes(self, prefix: str, owner: Any, depth: int, skip: frozenset[str] = frozenset()) -> None:
        """Queue ``owner``'s instance attributes (not dunder names, not ``skip``)."""
        try:
            items = list(vars(owner).items())
        except TypeError:
            return
        for key, value in items:
            if not (isinstance(key, str) and (key.startswith("__") or key in skip)):
                self.queue.append((f"{prefix}{key}", value, depth))

    def run(self) -> Iterator[tuple[str, Any]]:
        """Visit the queue until it or the budget runs out."""
        while self.queue and self.budget > 0:
            path, value, depth = self.queue.popleft()
            if id(value) in self.seen or isinstance(value, _SCALARS):
                continue
            self.seen.add(id(value))
            self.budget -= 1
            yield from self.visit(path, value, depth)

    def visit(self, path: str, value: Any, depth: int) -> Iterator[tuple[str, Any]]:
        """Yield ``value`` if it is an array; queue what it holds otherwise."""
        if isinstance(value, Tensor):
            if not isinstance(value, nn.Parameter):
                yield path, value
        elif isinstance(value, np.ndarray):
            yield path, value
        elif depth >= MAX_DEPTH or isinstance(value, (type, types.ModuleType)):
            return
        elif isinstance(value, (dict, list, tuple, collections.deque)):
            yield from self.container(path, value, depth)
        elif isinstance(value, nn.Module):
            yield from self.module(path, value, depth)
        elif self.loaders and isinstance(value, DataLoader):
            self.queue.append((f"{path}.dataset", value.dataset, depth + 1))
        else:
            yield from self.callable_or_object(path, value, depth)

    def container(self, path: str, value: Any, depth: int) -> Iterator[tuple[str, Any]]:
        """A container's per-record components (:func:`row_items`) and its first :data:`WALKED_ITEMS` items."""
        items = list(value.values()) if isinstance(value, dict) else value
        for label, rows in row_items(items):
            yield f"{path}[…]{label}", rows
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in itertools.islice(pairs, WALKED_ITEMS):
            self.queue.append((f"{path}[{_key(key)}]", item, depth + 1))

    def module(self, path: str, value: nn.Module, depth: int) -> Iterator[tuple[str, Any]]:
        """A module held outside the model: its parameters and buffers, and its modules' own attributes."""
        for name, tensor in [*value.named_parameters(), *value.named_buffers()]:
            if id(tensor) not in self.seen:
                self.seen.add(id(tensor))
                yield f"{path}.{name}", tensor
        for prefix, m in value.named_modules():
            self.seen.add(id(m))
            self.attributes(f"{path}.{prefix + '.' if prefix else ''}", m, depth + 1, framework_keys())

    def callable_or_object(self, path: str, value: Any, depth: int) -> Iterator[tuple[str, Any]]:
        """A callable's state, or a plain object's attributes and the buffers an extension type exposes."""
        if isinstance(value, functools.partial):
            self.queue.extend([(f"{path}.func", value.func, depth + 1), (f"{path}.args", value.args, depth + 1),
                               (f"{path}.keywords", value.keywords, depth + 1)])
        elif isinstance(value, types.FunctionType):
            self.function(path, value, depth)
        elif isinstance(value, types.MethodType):
            self.queue.extend([(f"{path}.__self__", value.__self__, depth + 1),
                               (f"{path}.__func__", value.__func__, depth + 1)])
        elif not _opaque(value):
            self.attributes(f"{path}.", value, depth + 1)
            yield from self.extension_buffers(path, value, depth)

    def function(self, path: str, value: types.FunctionType, depth: int) -> None:
        """A function's default arguments, closure cells and own attributes (``fn.ref = x``; not its globals: those
        of the user's modules are holders of their own)."""
        self.attributes(f"{path}.", value, depth + 1)
        for i, default in enumerate(value.__defaults__ or ()):
            self.queue.append((f"{path}.__defaults__[{i}]", default, depth + 1))
        for key, default in (value.__kwdefaults__ or {}).items():
            self.queue.append((f"{path}.__kwdefaults__[{key!r}]", default, depth + 1))
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
            try:
                self.queue.append((f"{path}.<closure {name}>", cell.cell_contents, depth + 1))
            except ValueError:  # an empty cell
                continue

    def extension_buffers(self, path: str, value: Any, depth: int) -> Iterator[tuple[str, Any]]:
        """The attributes a compiled class declares (slots, Cython's ``readonly`` members: a scikit-learn tree's
        ``data``): read through their descriptors, which run no Python code; memory views as NumPy arrays."""
        for cls in type(value).__mro__[:-1]:
            for key, descriptor in list(vars(cls).items())[:32]:
                if key.startswith("__") or not isinstance(descriptor, (types.GetSetDescriptorType,
                                                                       types.MemberDescriptorType)):
                    continue
                try:
                    item = getattr(value, key)
                except Exception:  # noqa: BLE001  (an unset slot, a getter that refuses)
                    continue
                if isinstance(item, memoryview) or type(item).__name__ == "_memoryviewslice":
                    array = _buffer_array(item)
                    if array is not None:
                        yield f"{path}.{key}", array
                else:
                    self.queue.append((f"{path}.{key}", item, depth + 1))


def _buffer_array(item: Any) -> Optional[np.ndarray]:
    try:
        array = np.asarray(item)
    except (TypeError, ValueError):
        return None
    return array if array.dtype.kind in "fiub" and array.size else None


def _opaque(value: Any) -> bool:
    """The framework's own objects (not walked): their type's top package is torch, Lightning, lightning_dp,
    NumPy or the standard library's machinery; a dataset is walked whatever its package."""
    return library_rooted(type(value), _OPAQUE) and not isinstance(value, Dataset)


def _key(key: Any) -> str:
    if isinstance(key, Tensor):  # (a parameter keying an optimizer's state: its repr prints its values)
        return f"<{type(key).__name__} {tuple(key.shape)}>"
    text = repr(key)
    return text if len(text) <= 40 else text[:37] + "…"


def row_items(items: Sequence[Any]) -> list[tuple[str, RowItems]]:
    """The components of a container's items that hold one record each: (label, :class:`RowItems`) for every
    position or key whose value, in a sample of the items spread over the container, is an array of one shape
    and dtype (at least one dimension) — the item itself, or one of its tuple's or dict's values."""
    if not 2 <= len(items) <= MAX_ROW_ITEMS:
        return []
    if isinstance(items, collections.deque):
        items = list(items)
    picked = [items[i] for i in np.linspace(0, len(items) - 1, min(len(items), 16)).round().astype(np.int64)]
    first = picked[0]
    if _array(first) is not None:
        keys: list[Any] = [None]
    elif isinstance(first, (tuple, list)) and 0 < len(first) <= 8:
        keys = list(range(len(first)))
    elif isinstance(first, dict) and 0 < len(first) <= 8:
        keys = list(first)
    else:
        return []
    found = []
    for key in keys:
        kind = _array(_component(first, key))
        if kind is not None and all(_array(_component(p, key)) == kind for p in picked):
            arrays = [c for c in (_component(item, key) for item in items) if _array(c) == kind]
            found.append(("" if key is None else f"[{_key(key)}]", RowItems(arrays)))
    return found


def _component(item: Any, key: Any) -> Any:
    if key is None:
        return item
    if isinstance(item, dict):
        return item.get(key)
    return item[key] if isinstance(item, (tuple, list)) and isinstance(key, int) and key < len(item) else None


def _array(value: Any) -> Optional[tuple[Any, ...]]:
    """(kind, shape, dtype) of a record-sized array (a tensor that is not a parameter, a NumPy array of numbers,
    at least one dimension), ``None`` otherwise."""
    if isinstance(value, Tensor) and not isinstance(value, nn.Parameter) and value.dim() >= 1:
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, np.ndarray) and value.ndim >= 1 and value.dtype.kind in "fiub":
        return ("array", value.shape, value.dtype)
    return None


def code_holders(optimizers: Iterable[Any], schedulers: Iterable[Any]) -> list[tuple[str, Any]]:
    """Holders for what the code judged after the release reaches (:mod:`lightning_dp.validators.judged_updates`,
    :mod:`~lightning_dp.validators.judged_schedules`): each optimizer and those it wraps (``_optimizer``,
    ``optimizer``), each scheduler and those it steps (``_schedulers``) — their own attributes, so a rate function in
    ``lr_lambdas`` with its closure cells and defaults —, and the bodies of their classes of the user's (methods with
    their closure cells, defaults and attributes; data in the class body). Torch's own classes are not read (their
    bodies are code); the objects' attributes are, as the walk reads any holder's. A few objects per fit: the walk
    is bounded as for any holder (:data:`MAX_VISITED`)."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    todo = [(f"optimizer {i}", o) for i, o in enumerate(optimizers)]
    todo += [(f"scheduler {i}", s) for i, s in enumerate(schedulers)]
    while todo:
        label, obj = todo.pop(0)
        if obj is None or id(obj) in seen or isinstance(obj, (type, types.ModuleType)):
            continue
        seen.add(id(obj))
        fields = vars(obj) if hasattr(obj, "__dict__") else {}
        out.append((label, _released_left(obj, fields) if isinstance(obj, torch.optim.Optimizer) else obj))
        todo += [(f"{label}.{key}", fields.get(key)) for key in ("_optimizer", "optimizer")
                 if isinstance(fields.get(key), torch.optim.Optimizer)]
        todo += [(f"{label}._schedulers[{j}]", s) for j, s in enumerate(fields.get("_schedulers") or ())]
        for cls in type(obj).__mro__:
            if id(cls) in seen or library_type(cls):
                continue
            seen.add(id(cls))
            body = {k: v.__func__ if isinstance(v, (staticmethod, classmethod)) else v.fget
                    if isinstance(v, property) else v
                    for k, v in vars(cls).items() if not (k.startswith("__") and k.endswith("__"))}
            out.append((f"class {cls.__qualname__}", types.SimpleNamespace(**body)))
    return out


def _released_left(optimizer: Any, fields: dict[str, Any]) -> types.SimpleNamespace:
    """An optimizer's attributes as a holder, less the released state: its per-parameter ``state`` (moments of ĝ)
    and its groups' ``params`` (the weights) are left out; what it keeps under other keys is walked."""
    state = fields.get("state")
    groups = fields.get("param_groups")
    view = dict(fields)
    if isinstance(state, dict):
        view["state"] = {k: v for k, v in state.items() if not isinstance(k, Tensor)}
    if isinstance(groups, list):
        view["param_groups"] = [{k: v for k, v in g.items() if k != "params"} if isinstance(g, dict) else g
                                for g in groups]
    return types.SimpleNamespace(**{k: v for k, v in view.items() if isinstance(k, str)})
