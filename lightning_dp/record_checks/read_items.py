"""Records a dataset keeps in no tensor, array or list of numbers it stores: identified by its items as read.

The record checks and the data's ledgers (:mod:`.stored_sources`, :mod:`.row_lineage`,
:mod:`~lightning_dp.accounting.data_ledgers`) identify a dataset's records by the rows of what it *stores*
(:func:`~.stored_records.stored_items`: tensors, in-memory NumPy arrays, lists of numbers, strings, tensors). A
dataset holding its records otherwise — a list of dicts (``{"features": x[i].tolist(), "label": y[i]}``, the rows of
a JSON file), a list of tuples of Python floats, a pandas-like table, records built in ``__getitem__`` — stores
nothing those digests identify, so a fresh model fitted on the same records in that form did not continue the
earlier fits' releases: its ε counted its own steps only (zoo33 L34). :func:`read_items` reads such a dataset's items
as the loader's fetcher does (:func:`~lightning_dp.records.fetch.fetch`, with the generators seeded: an augmenting
dataset gives one fixed read; the reads are the library's, not counted as the step's) and returns, per position of
the item (a tuple's or list's index, a dict's key; a tensor, a NumPy array or a number), the values of all items
stacked, one row per record: the same digests then identify them, whatever form holds them.

Only datasets of at most :data:`READ_LIMIT` records are read (one ``__getitem__`` each, at most once per dataset
and length: :data:`_READ`); larger ones keep their identity as before (by object, indices and memory). Not seen:
records whose items differ on every read (random augmentation), and positions whose values differ in shape or type
from item to item (a variable-length text: its token ids are not stacked).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dp.records.fetch import fetch, seeded

__all__ = ["READ_LIMIT", "read_items"]

READ_LIMIT = 16384
"""The largest dataset whose items are read to identify its records."""

_READ: "weakref.WeakKeyDictionary[Any, tuple[int, list[tuple[str, Tensor]]]]" = weakref.WeakKeyDictionary()
"""A dataset → (its length, its items stacked) as last read."""


def read_items(dataset: Any) -> list[tuple[str, Tensor]]:
    """(position, [N, ...] tensor) for each position of ``dataset``'s items that holds, in every item, a tensor, a
    NumPy array or a number of one shape and type (module docstring); empty when none does or the dataset is not
    read."""
    try:
        n = len(dataset)
    except TypeError:
        return []
    if not 0 < n <= READ_LIMIT:
        return []
    try:
        kept = _READ.get(dataset)
    except TypeError:  # no weak reference to it
        kept = None
    if kept is not None and kept[0] == n:
        return kept[1]
    try:
        with seeded(0):
            items = list(fetch(dataset, range(n)))
    except Exception:  # a dataset that cannot be read here (files gone, a worker-only resource): not identified
        return []
    found = _stacked(items) if len(items) == n else []
    try:
        _READ[dataset] = (n, found)
    except TypeError:
        pass
    return found


def _stacked(items: list[Any]) -> list[tuple[str, Tensor]]:
    first = items[0]
    if isinstance(first, dict):
        keys = list(first)
        if not all(isinstance(item, dict) and list(item) == keys for item in items):
            return []
        positions = [(f"[{key!r}]", [item[key] for item in items]) for key in keys]
    elif isinstance(first, (tuple, list)):
        if not all(isinstance(item, (tuple, list)) and len(item) == len(first) for item in items):
            return []
        positions = [(f"[{k}]", [item[k] for item in items]) for k in range(len(first))]
    else:
        positions = [("", items)]
    out = []
    for name, values in positions:
        column = _column(values)
        if column is not None:
            out.append((f"read items{name}", column))
    return out


def _column(values: list[Any]) -> Any:
    """The values stacked (a tensor, [N, ...]), or ``None`` when they are not tensors, arrays or numbers of one shape
    and type."""
    first = values[0]
    try:
        if isinstance(first, Tensor):
            if all(isinstance(v, Tensor) and v.shape == first.shape and v.dtype == first.dtype for v in values):
                return torch.stack([v.detach().cpu() for v in values])
        elif isinstance(first, np.ndarray):
            if first.dtype != object and all(isinstance(v, np.ndarray) and v.shape == first.shape
                                             and v.dtype == first.dtype for v in values):
                return torch.from_numpy(np.stack(values))
        elif isinstance(first, (bool, int, float, np.number)):
            kind = type(first)
            if all(type(v) is kind for v in values):
                return torch.tensor(np.asarray(values))
        elif isinstance(first, (list, tuple)) and first and all(isinstance(v, (int, float)) for v in first):
            if all(isinstance(v, (list, tuple)) and len(v) == len(first) for v in values):
                return torch.tensor(np.asarray(values, dtype=np.float64 if isinstance(first[0], float) else None))
    except (RuntimeError, TypeError, ValueError):
        return None
    return None
