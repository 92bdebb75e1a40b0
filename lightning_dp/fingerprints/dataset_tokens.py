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

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_dp.fingerprints.checksums import _array_digest
from lightning_dp.records.identity import Same
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
    """The settings the datasets ``dataset`` is made of (:func:`dataset_parts`) and the user's collate object hold:
    their plain attributes (numbers, strings, flags, ``None``) and small dicts of named plain values
    (:func:`_settings`), by value, each named ``"dataset setting Class.key (type)"`` (``"collate setting …"``) — the
    type of the value, never the value (a refusal quotes the name). The fetch reads them for every later batch: one a
    batch-end hook sets from the loss (``dataset.scale = 1 + loss``) carries the batch into every later input; one set
    from the epoch number (``set_epoch``) is alike on any data. Which is which the replays tell (the decision
    windows, the first step's: docs/release_boundary.md, rule 3); :func:`put_back` puts them back after each."""
    entries: dict[str, Hashable] = {}
    for kind, d in _holders(dataset, collate_fn):
        for key, value in (vars(d).items() if hasattr(d, "__dict__") else ()):
            if key.startswith("__"):
                continue
            if isinstance(value, _PLAIN):
                entries[f"{kind} setting {type(d).__name__}.{key} ({type(value).__name__})"] = \
                    (type(value).__name__, value)
            elif _settings(value) and value:
                entries[f"{kind} setting {type(d).__name__}.{key} (dict of settings)"] = tuple(value.items())
    return entries


def _holders(dataset: Any, collate_fn: Any) -> list[tuple[str, Any]]:
    """("dataset", each dataset ``dataset`` is made of), ("collate", ``collate_fn``) when it is an object of the
    user's class (not a function, nor a library's), and ("transform", each object of a class not torch's nor
    Lightning's that they hold — in an attribute, or in a list, tuple or dict of one, two levels deep: a transform
    inside a ``Compose`` list, whose ``factor`` an epoch hook may set, zoo23 c1)."""
    found = [("dataset", d) for d in dataset_parts(dataset)[0]]
    if _settings_object(collate_fn):
        found.append(("collate", collate_fn))
    seen = {id(obj) for _, obj in found}
    level = [obj for _, obj in found]
    for _ in range(2):
        held = [v for obj in level for v in _held_objects(vars(obj).values()) if id(v) not in seen]
        seen.update(id(v) for v in held)
        found.extend(("transform", v) for v in held)
        level = held
    return found


def _held_objects(values: Any) -> list[Any]:
    """The objects among ``values`` and in their lists, tuples and dicts (of at most 64 items) that hold settings
    (:func:`_settings_object`)."""
    out: list[Any] = []
    for value in values:
        if isinstance(value, (list, tuple)) and len(value) <= 64:
            out.extend(v for v in value if _settings_object(v))
        elif isinstance(value, dict) and len(value) <= 64:
            out.extend(v for v in value.values() if _settings_object(v))
        elif _settings_object(value):
            out.append(value)
    return out


def _settings_object(value: Any) -> bool:
    """An object with attributes, of a class not torch's nor Lightning's (nor a function, class, module or tensor): a
    collate or transform object whose plain attributes the fetch reads."""
    root = (type(value).__module__ or "").split(".")[0]
    return hasattr(value, "__dict__") and not isinstance(value, (*_CALLABLES, Tensor, Dataset)) \
        and root not in _LIBRARIES


_CALLABLES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType, type, partial)
_LIBRARIES = ("torch", "lightning_dp", "pytorch_lightning", "lightning", "transformers", "builtins")


_PLAIN = (int, float, complex, str, bool, bytes, type(None))


def put_back(dataset: Any, collate_fn: Any = None) -> Callable[[], None]:
    """A function that puts the attributes of the datasets ``dataset`` is made of and of the user's collate object
    (:func:`_holders`) back as they are now: each bound to its object again, and the items of their dicts, lists,
    sets and deques (a list an epoch hook shuffles in place, ``set_epoch``'s settings dict) — by reference only: no
    record, tensor or array is copied (a write into one is the fingerprint's to refuse). A replay of the user's hooks
    then leaves the training data's settings as found."""
    held = [(d, dict(vars(d))) for _, d in _holders(dataset, collate_fn) if hasattr(d, "__dict__")]
    items = [(v, list(v.items()) if isinstance(v, dict) else list(v)) for _, fields in held
             for v in fields.values() if isinstance(v, (dict, list, set, deque))]

    def put() -> None:
        for d, fields in held:
            for key in [k for k in vars(d) if k not in fields and not k.startswith("_")]:
                delattr(d, key)
            for key, value in fields.items():
                if vars(d).get(key, _ABSENT) is not value:
                    vars(d)[key] = value
        for container, kept in items:
            if not _same(container, kept):
                container.clear()
                if isinstance(container, (dict, set)):
                    container.update(kept)
                else:
                    container.extend(kept)
    return put


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
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None and value.dtype != object:
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
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None and value.dtype != object:
        return ("ndarray", value.shape, _array_digest(value))
    if isinstance(value, (tuple, list, dict)) and depth < 2:
        items = list(value.items()) if isinstance(value, dict) else value
        ends = items if len(items) <= 2 * NESTED else [*items[:NESTED], *items[-NESTED:]]
        return (len(items), *(_item(x, depth + 1) for x in ends))
    return type(value).__qualname__
