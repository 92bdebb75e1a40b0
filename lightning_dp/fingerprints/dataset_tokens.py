"""The training data as the kept-state fingerprint reads it: the datasets a dataset is made of, the tensors they
hold (:func:`dataset_parts`), and a token of them (:func:`dataset_token`: identity and version counter of each tensor,
and the records kept as NumPy arrays or lists of numbers or strings), so a record written in place shows.
"""

from __future__ import annotations

import types
from collections import deque
from functools import partial
from itertools import islice
from operator import is_
from typing import Any, Callable, Hashable, Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_dp.containers import held_items, put_back as put_items_back
from lightning_dp.fingerprints.checksums import _array_digest
from lightning_dp.records.identity import Same
from lightning_dp.records.library_code import installed_class, library_rooted, users_code
from lightning_dp.records.fetch_reruns import fetch_written
from lightning_dp.records.stateless import fetch_filled

def dataset_parts(dataset: Any) -> tuple[list[Any], list[tuple[str, Tensor]]]:
    """The datasets ``dataset`` is made of (itself and those it wraps: ``Subset.dataset``, ``ConcatDataset.datasets``,
    any dataset held as an attribute) and the tensors they hold (in their attributes and in those attributes'
    lists, tuples and dicts of at most 64 items), each once, six attribute or item levels deep; tensors named by
    their path."""
    datasets: list[Any] = []
    tensors: list[tuple[str, Tensor]] = []
    seen: set[int] = set()

    def visit(value: Any, path: str, depth: int) -> None:
        if id(value) in seen or depth > 6:
            return
        seen.add(id(value))
        if isinstance(value, Tensor):
            tensors.append((path, value))
        elif isinstance(value, (list, tuple)) and len(value) <= 64:
            for i, item in enumerate(value):
                visit(item, f"{path}[{i}]", depth + 1)
        elif isinstance(value, dict) and len(value) <= 64:
            for key, item in value.items():
                visit(item, f"{path}[{key!r}]", depth + 1)
        elif isinstance(value, Dataset):
            datasets.append(value)
            for key, item in (vars(value).items() if hasattr(value, "__dict__") else ()):
                visit(item, f"{path}.{key}", depth + 1)

    visit(dataset, "", 0)
    return datasets, tensors


def dataset_token(dataset: Any) -> Hashable:
    """A dataset's identity and its tensors (:func:`dataset_parts`) by identity, shape and version counter, and the
    records its datasets hold as NumPy arrays or Python lists of numbers or strings (:func:`_records_token`): a
    record written in place (a label relabelled from the batch) shows, and so does state a step's hooks keep on the
    dataset in a dict, list, set or deque (per-record losses for hard-example weights: :func:`_records_token`). Tensors'
    contents are not read (a dataset's size is unbounded), but for those of at most :data:`SMALL` elements (a loss a
    hook keeps: each replay of the hooks makes another tensor, alike or not by its values). A cache its
    ``__getitem__`` fills is the fetch's to judge (:mod:`~lightning_dp.records.stateless`)."""
    datasets, tensors = dataset_parts(dataset)
    return ("dataset", type(dataset).__name__, Same(dataset),
            tuple((path, _item(t, 0)) for path, t in tensors),
            tuple((key, token) for d in datasets for key, value in (vars(d).items() if hasattr(d, "__dict__") else ())
                  for token in [_records_token(value)] if token is not None))


def dataset_settings(dataset: Any, collate_fn: Any = None) -> dict[str, Hashable]:
    """The settings the datasets ``dataset`` is made of (:func:`dataset_parts`), the user's collate object and the
    transforms they hold (:func:`_holders`) keep: their plain attributes (numbers, strings, flags, ``None``) and small
    dicts of named plain values (:func:`_settings`), by value; the collate's and the transforms' (not the datasets':
    their tensors are records, :func:`dataset_token`) small lists of plain values, tensors and NumPy arrays too, and an
    ``nn.Module`` transform's buffers and parameters (:func:`_setting_token`) — each named
    ``"dataset setting Class.key (type)"`` (``"collate setting …"``, ``"transform setting …"``): the type of the
    value, never the value (a refusal quotes the name). The fetch reads them for every later batch: one a batch-end
    hook sets from the loss (``dataset.scale = 1 + loss``, ``tf.factor.fill_(1 + loss)``) carries the batch into every
    later input; one set from the epoch number (``set_epoch``) is alike on any data. Which is which the replays tell
    (the decision windows, the first step's: docs/release_boundary.md, rule 3); :func:`put_back` puts them back."""
    entries: dict[str, Hashable] = {}

    def add(entry: str, token: Hashable) -> None:  # a second holder of one class (two Scales in a Compose): `#2`
        n = 1
        while (named := entry if n == 1 else f"{entry} #{n}") in entries:
            n += 1
        entries[named] = token

    for kind, d in _holders(dataset, collate_fn):
        name = _holder_name(d)
        for key, value in _fields(d).items():
            if key.startswith("__") or fetch_written(d, key, value):  # a fetch's write, judged alike on any records
                continue
            if isinstance(value, _PLAIN):
                add(f"{kind} setting {name}.{key} ({type(value).__name__})", (type(value).__name__, value))
            elif _settings(value) and value:
                add(f"{kind} setting {name}.{key} (dict of settings)", tuple(value.items()))
            elif kind != "dataset" and (token := _setting_token(value)) is not None:
                add(f"{kind} setting {name}.{key} ({token[0]})", token)
        if kind != "dataset" and isinstance(d, torch.nn.Module):  # its buffers and parameters (a factor buffer)
            for key, t in islice((*d.named_buffers(), *d.named_parameters()), 64):
                add(f"{kind} setting {name}.{key} (Tensor)", _setting_token(t))
    return entries


def _setting_token(value: Any) -> Optional[tuple[Any, ...]]:
    """A transform's or collate object's setting that is not a plain value, by its kind first: a list of at most
    :data:`SMALL` plain values, a tensor or a NumPy array of at most :data:`SMALL` elements by its values, a larger
    one by identity, version (a tensor) and :func:`_array_digest` (bounded: it is taken several times a step); else
    ``None``."""
    if type(value) is list and len(value) <= SMALL and all(isinstance(v, _PLAIN) for v in value):
        return ("list of settings", tuple((type(v).__name__, v) for v in value))
    if isinstance(value, Tensor) and value.layout == torch.strided and not value.is_meta:
        if value.numel() <= SMALL:
            return ("Tensor", tuple(value.shape), str(value.dtype), tuple(value.detach().flatten().tolist()))
        return ("Tensor", Same(value), value._version, tuple(value.shape), _tensor_digest(value))
    if _numpy(value) and getattr(value, "dtype", None) is not None and value.dtype != object \
            and getattr(value, "shape", None) is not None:
        if value.size <= SMALL:
            return ("ndarray", value.shape, str(value.dtype), tuple(value.ravel().tolist()))
        return ("ndarray", Same(value), value.shape, str(value.dtype), _array_digest(value))
    return None


def _tensor_digest(value: Tensor) -> Optional[bytes]:
    """A CPU tensor's contents by :func:`_array_digest` (a write through a NumPy view moves no version); ``None`` for
    one NumPy cannot view (another device's: its writes are torch's, counted by the version)."""
    try:
        return _array_digest(value.detach().numpy()) if value.device.type == "cpu" else None
    except (TypeError, RuntimeError):  # bfloat16, a conjugate or negative view
        return None


def _holders(dataset: Any, collate_fn: Any) -> list[tuple[str, Any]]:
    """("dataset", each dataset ``dataset`` is made of), ("collate", ``collate_fn``) when it is an object of the
    user's class (not a library's), and ("transform", each object of a class not a library's, and each function or
    ``partial`` of the user's, that they hold — in an attribute, in a list, tuple or dict of one, or through a
    callable: a partial's arguments, a bound method's object, a function's closure cells and defaults
    (:func:`_held_objects`) — :data:`HOLDER_DEPTH` levels deep: a transform inside a ``Compose`` list, whose
    ``factor`` an epoch hook may set, zoo23 c1; ``partial(fn, st=obj)``, ``Wrap(Wrap(obj))``, zoo25 t1)."""
    found = [("dataset", d) for d in dataset_parts(dataset)[0]]
    if _settings_object(collate_fn) or _users_callable(collate_fn):
        found.append(("collate", collate_fn))
    seen = {id(obj) for _, obj in found}
    level = [obj for _, obj in found]
    for _ in range(HOLDER_DEPTH):
        held = [v for obj in level for v in _held_objects(_fields(obj).values(), seen)]
        found.extend(("transform", v) for v in held)
        level = held
    return found


HOLDER_DEPTH = 4
"""Levels of held objects :func:`_holders` follows below the datasets and the collate object (each level bounded:
:func:`_held_objects`)."""


def _held_objects(values: Any, seen: set[int]) -> list[Any]:
    """The objects among ``values`` and in their lists, tuples and dicts (of at most 64 items) that hold settings
    (:func:`_settings_object`), and the user's callables (:func:`_users_callable`), each with the objects its state
    holds (a bound method: its object), each once (``seen``)."""
    out: list[Any] = []

    def add(value: Any, depth: int) -> None:
        if id(value) in seen or depth > 2:
            return
        if isinstance(value, (list, tuple)) and len(value) <= 64:
            for v in value:
                add(v, depth + 1)
        elif isinstance(value, dict) and len(value) <= 64:
            for v in value.values():
                add(v, depth + 1)
        elif _settings_object(value):
            seen.add(id(value))
            out.append(value)
        elif _users_callable(value):
            seen.add(id(value))
            out.append(value)
            if isinstance(value, types.MethodType):
                add(value.__self__, depth)

    for value in values:
        add(value, 0)
    return out


def _numpy(value: Any) -> bool:
    """A NumPy value (its class NumPy's, written there: not a user's class claiming ``__module__ = "numpy"``)."""
    return type(value).__module__ == "numpy" and installed_class(type(value))


def _users_callable(value: Any) -> bool:
    """A function, bound method or ``partial`` of the user's (not a library's): a transform whose partial arguments,
    closure cells, defaults or object hold settings."""
    if isinstance(value, partial):
        return True
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return (getattr(value, "__module__", None) or "").split(".")[0] not in _LIBRARIES or users_code(value)
    return False


def _fields(holder: Any) -> dict[str, Any]:
    """What a holder keeps by name: an object's attributes; a partial's arguments (``args[i]``, its keywords) and its
    function's; a function's closure cells (by their variable names) and default arguments; a bound method's object
    (``__self__``, followed, never a setting)."""
    if isinstance(holder, partial):
        return {**{f"args[{i}]": a for i, a in enumerate(holder.args[:64])},
                **dict(islice(holder.keywords.items(), 64)), "__func__": holder.func}
    if isinstance(holder, types.MethodType):
        return {"__self__": holder.__self__, "__func__": holder.__func__}
    if isinstance(holder, types.FunctionType):
        out: dict[str, Any] = {}
        for key, cell in zip(holder.__code__.co_freevars, holder.__closure__ or ()):
            try:
                out[key] = cell.cell_contents
            except ValueError:  # an empty cell
                pass
        names = holder.__code__.co_varnames[:holder.__code__.co_argcount]
        out.update(zip(names[len(names) - len(holder.__defaults__ or ()):], holder.__defaults__ or ()))
        out.update(holder.__kwdefaults__ or {})
        return out
    return vars(holder) if hasattr(holder, "__dict__") else {}


def _holder_name(holder: Any) -> str:
    """A holder's name in a setting's entry: its class's; a function's own (``partial(fn)``, ``fn``)."""
    if isinstance(holder, partial):
        return f"partial({getattr(holder.func, '__name__', type(holder.func).__name__)})"
    if isinstance(holder, (types.FunctionType, types.MethodType)):
        return holder.__name__
    return type(holder).__name__


def _settings_object(value: Any) -> bool:
    """An object with attributes, of a class not a library's (nor a function, class, module or tensor, nor a
    Lightning subclass: the module being trained): a collate or transform object whose settings the fetch reads."""
    return hasattr(value, "__dict__") and not isinstance(value, (*_CALLABLES, Tensor, Dataset)) \
        and not library_rooted(type(value), _LIBRARIES) \
        and not any(library_rooted(c, _LIGHTNING) for c in type(value).__mro__)


_CALLABLES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType, type, partial)
_LIBRARIES = ("torch", "lightning_dp", "pytorch_lightning", "lightning", "transformers", "tokenizers", "builtins",
              "numpy", "functools")


_LIGHTNING = ("pytorch_lightning", "lightning")

_PLAIN = (int, float, complex, str, bool, bytes, type(None))


def put_back(dataset: Any, collate_fn: Any = None) -> Callable[[], None]:
    """A function that puts the settings of the datasets ``dataset`` is made of, of the user's collate object and of
    the transforms they hold (:func:`_holders`) back as they are now: each attribute bound to its object again (a
    tensor rebound: the old one), a function's closure cells too, and the items of their dicts, lists, sets and
    deques (a list an epoch hook shuffles in place, ``set_epoch``'s settings dict, an ``nn.Module``'s buffers) — by
    reference only: no record, tensor or array is copied (a write into one is the fingerprint's to refuse). A replay
    of the user's hooks then leaves the training data's settings as found."""
    found = _holders(dataset, collate_fn)
    holders = [d for _, d in found]
    small = [(v, v.detach().clone() if isinstance(v, Tensor) else v.copy())
             for v in _small_arrays([d for kind, d in found if kind != "dataset"])]
    held = [(d, dict(vars(d))) for d in holders if hasattr(d, "__dict__") and not isinstance(d, _CALLABLES)]
    cells = [(cell, cell.cell_contents) for d in holders if isinstance(d, types.FunctionType)
             for cell in d.__closure__ or () if _filled(cell)]
    fields = [f for d in holders for f in (_fields(d).values() if isinstance(d, _CALLABLES) else ())]
    items = [(v, held_items(v))
             for v in [*(v for _, kept in held for v in kept.values()), *fields]
             if isinstance(v, (dict, list, set, deque))]

    def put() -> None:
        for d, kept in held:
            for key in [k for k in vars(d) if k not in kept and not k.startswith("_")]:
                delattr(d, key)
            for key, value in kept.items():
                if vars(d).get(key, _ABSENT) is not value:
                    vars(d)[key] = value
        for cell, value in cells:
            if not _filled(cell) or cell.cell_contents is not value:
                cell.cell_contents = value
        for array, values in small:  # a setting written in place (``tf.factor.fill_(v)``): its values as found
            if not (torch.equal(array, values) if isinstance(array, Tensor) else (array == values).all()):
                with torch.no_grad():
                    array[...] = values
        for container, kept in items:
            if not _same(container, kept):
                put_items_back(container, kept)
    return put


def _small_arrays(holders: list[Any]) -> list[Any]:
    """The tensors and NumPy arrays of at most :data:`SMALL` elements the ``holders`` keep as settings (an attribute,
    a closure cell, an ``nn.Module``'s buffer or parameter): :func:`put_back` puts their values back (a copy of a
    few numbers), as it rebinds a plain setting."""
    out: dict[int, Any] = {}
    for d in holders:
        values = [*_fields(d).values(), *(islice((t for _, t in (*d.named_buffers(), *d.named_parameters())), 64)
                                          if isinstance(d, torch.nn.Module) else ())]
        for v in values:
            if isinstance(v, Tensor) and v.layout == torch.strided and not v.is_meta and v.numel() <= SMALL \
                    or isinstance(v, np.ndarray) and v.dtype != object and v.size <= SMALL:
                out.setdefault(id(v), v)
    return list(out.values())


def _filled(cell: Any) -> bool:
    """Whether a closure cell holds a value."""
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _same(container: Any, kept: list[Any]) -> bool:
    """Whether ``container`` holds the items ``kept`` (a dict's: its ``(key, value)`` pairs), in order, by identity."""
    if len(container) != len(kept):
        return False
    if isinstance(container, dict):
        return all(map(is_, container, (k for k, _ in kept))) \
            and all(map(is_, container.values(), (v for _, v in kept)))
    return all(map(is_, container, kept))


_ABSENT = object()


def _records_token(value: Any) -> Optional[Hashable]:
    """A NumPy array of records (:func:`_array_digest`), a list of plain numbers or strings (labels kept as a
    list: its length and hash), another dict, list, set or deque (its identity, length and the hash of its items'
    tokens: :func:`_item`; beyond :data:`MAX_HASHED` items, of about :data:`SAMPLED`), else ``None``."""
    if _numpy(value) and getattr(value, "dtype", None) is not None and value.dtype != object:
        return ("ndarray", value.shape, str(value.dtype), _array_digest(value))
    if isinstance(value, list) and value and isinstance(value[0], (int, float, str, bool)):
        try:
            return ("list", len(value), hash(tuple(value)))
        except TypeError:  # an unhashable item further on
            return ("list", len(value), Same(value))
    if _settings(value):  # {"epoch": 2} written by set_epoch: named plain values, as plain attributes are (qa9 e2b)
        return None
    if isinstance(value, (dict, list, set, deque)):  # per-record state a step's hooks write (zoo20 j1)
        filled = fetch_filled(value) if isinstance(value, dict) else {}  # a cache's entries the fetch added
        items: Any = value.items() if isinstance(value, dict) else value
        length = len(value) - len(filled)
        if len(value) > MAX_HASHED:  # its length and a sample of its items, evenly spaced (a fetch's entries, added
            items = list(islice(items, 0, None, max(1, length // SAMPLED)))  # at the end, leave the spacing as it is)
        if filled:
            items = [(k, v) for k, v in items if filled.get(k, _ABSENT) is not v]
            length = length if len(value) > MAX_HASHED else len(items)
        return (type(value).__name__, Same(value), length, hash(tuple(_item(x, 0) for x in items)))
    return None


def _settings(value: Any) -> bool:
    """A small dict of named plain values (``{"epoch": 2, "strength": 0.1}``): the dataset's settings, left out of
    the token as its plain attributes are (an epoch hook writes them; per-record state is keyed by record)."""
    return (type(value) is dict and len(value) <= 16 and all(type(k) is str for k in value)
            and all(isinstance(v, (int, float, str, bool, type(None))) for v in value.values()))


MAX_HASHED = 4096
"""Items of a container on the training dataset up to which all are hashed; beyond, about :data:`SAMPLED` of them,
evenly spaced (a take costs a bounded walk: it is taken several times a step)."""

SAMPLED = 256

NESTED = 8
"""Items at each end of a container inside a container that its token holds (beside its length)."""

SMALL = 16
"""Elements up to which a tensor in a container is read by its values (else by identity, version and shape)."""


def _item(value: Any, depth: int) -> Hashable:
    """A container item's token: a plain value itself, a tensor by identity, version and shape (one of at most
    :data:`SMALL` elements by its values), an array by
    :func:`_array_digest`, a tuple or nested container item-wise (two levels), another object by its class only (a
    list of transforms whose items a callback swaps is configuration, not records)."""
    if isinstance(value, (int, float, complex, str, bool, bytes, type(None))):
        return value
    if isinstance(value, Tensor):  # a small one by its values: a loss kept per record is compared across the replays
        if value.numel() <= SMALL and value.layout == torch.strided and not value.is_meta:  # (made anew by each)
            return ("tensor", tuple(value.shape), str(value.dtype), tuple(value.detach().flatten().tolist()))
        return ("tensor", Same(value), value._version, tuple(value.shape))
    if _numpy(value) and getattr(value, "dtype", None) is not None and value.dtype != object:
        return ("ndarray", value.shape, _array_digest(value))
    if isinstance(value, (tuple, list, dict)) and depth < 2:
        items = list(value.items()) if isinstance(value, dict) else value
        ends = items if len(items) <= 2 * NESTED else [*items[:NESTED], *items[-NESTED:]]
        return (len(items), *(_item(x, depth + 1) for x in ends))
    return type(value).__qualname__
