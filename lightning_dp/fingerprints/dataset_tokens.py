"""The training data as the kept-state fingerprint reads it: the datasets a dataset is made of, the tensors they
hold (:func:`dataset_parts`), and a token of them (:func:`dataset_token`: identity and version counter of each tensor,
and the records kept as NumPy arrays or lists of numbers or strings), so a record written in place shows.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Any, Hashable, Optional

from torch import Tensor
from torch.utils.data import Dataset

from lightning_dp.fingerprints.checksums import _array_digest
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
    contents are not read (a dataset's size is unbounded). A cache its ``__getitem__`` fills is the fetch's to judge
    (:mod:`~lightning_dp.records.stateless`)."""
    datasets, tensors = dataset_parts(dataset)
    return ("dataset", type(dataset).__name__, id(dataset),
            tuple((path, (id(t), t._version, tuple(t.shape))) for path, t in tensors),
            tuple((key, token) for d in datasets for key, value in (vars(d).items() if hasattr(d, "__dict__") else ())
                  for token in [_records_token(value)] if token is not None))


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
            return ("list", len(value), id(value))
    if _settings(value):  # {"epoch": 2} written by set_epoch: named plain values, as plain attributes are (qa9 e2b)
        return None
    if isinstance(value, (dict, list, set, deque)):  # per-record state a step's hooks write (zoo20 j1)
        filled = fetch_filled(value) if isinstance(value, dict) else {}  # a cache's entries the fetch added
        items: Any = value.items() if isinstance(value, dict) else value
        length = len(value) - len(filled)
        if len(value) > MAX_HASHED:  # its length and a sample of its items, evenly spaced (a fetch's entries, added
            items = list(islice(items, 0, None, max(1, length // SAMPLED)))  # at the end, leave the spacing as it is)
        if filled:
            items = [(k, v) for k, v in items if filled.get(k) != id(v)]
            length = length if len(value) > MAX_HASHED else len(items)
        return (type(value).__name__, id(value), length, hash(tuple(_item(x, 0) for x in items)))
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


def _item(value: Any, depth: int) -> Hashable:
    """A container item's token: a plain value itself, a tensor by identity, version and shape, an array by
    :func:`_array_digest`, a tuple or nested container item-wise (two levels), another object by its class only (a
    list of transforms whose items a callback swaps is configuration, not records)."""
    if isinstance(value, (int, float, complex, str, bool, bytes, type(None))):
        return value
    if isinstance(value, Tensor):
        return ("tensor", id(value), value._version, tuple(value.shape))
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None and value.dtype != object:
        return ("ndarray", value.shape, _array_digest(value))
    if isinstance(value, (tuple, list, dict)) and depth < 2:
        items = list(value.items()) if isinstance(value, dict) else value
        ends = items if len(items) <= 2 * NESTED else [*items[:NESTED], *items[-NESTED:]]
        return (len(items), *(_item(x, depth + 1) for x in ends))
    return type(value).__qualname__
