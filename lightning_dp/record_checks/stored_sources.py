"""Datasets that store the same records: several base datasets of one population built over the same stored rows.

:mod:`.record_sources` maps each training position down through torch's wrappers to a *base* dataset and an index
there, and refuses two positions with one source. A base is a dataset object; but two objects can store one set of
records — ``ConcatDataset([Flipped(x, y), Jittered(x, y)])`` of two augmenting classes holding the same tensors, or
two torchvision-style datasets each loading the same training files (``CIFAR10(train=True, transform=t)`` twice,
with two transforms): every person is then two positions, drawn twice per step and clipped twice, while the ledger
charges one chance in N for twice the people (zoo17 r2, r5). :func:`same_records` finds the records such bases
share, so that each is one source.

Each base's records are digested as it stores them: the rows of its *identifying items* — the tensors, in-memory
NumPy arrays and lists it stores with one row per record
(:func:`~lightning_dp.record_checks.stored_records.stored_items`,
:func:`~lightning_dp.record_checks.stored_records.row_digests`) that are not a column of integers (labels, ids and
indices ``0 … n − 1`` are alike in datasets of other people) and whose rows are at least :data:`DISTINCT` distinct.
A record of a later base whose row an earlier base stores (an item of the same element type and row shape) is that
base's record, once the two share :data:`OVERLAP` of the smaller one's records or more: the whole data twice, or a
copy of the minority class's rows concatenated to oversample it under a transform of its own. A base with no
identifying stored item (a list of dicts, records read from files by index) is identified by its items as read
(:mod:`.read_items`, up to its limit of records); beyond it, it keeps its identity as its name.

Cost: one pass over the stored bytes of each base, only when a population has two bases or more. Not seen: copies
stored after a transform (a flipped or float64 copy of the images kept as a second array: the content checks' to see,
or not, :mod:`.repeated_records`), and an overlap under :data:`OVERLAP` of the smaller base.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from lightning_dp.record_checks.read_items import read_items
from lightning_dp.record_checks.stored_records import row_digests, stored_items

OVERLAP = 0.05
"""The share of the smaller base's records another base must store too for the two to be taken for one population
(a few equal records in two sources are natural: two people's identical short messages)."""

DISTINCT = 0.9
"""The share of distinct rows of an item that identifies its records."""


def same_records(bases: list[Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each of ``bases``, per record: the position (in ``bases``) of the first base that stores it and its index
    there — its own base and index when no earlier base stores it (module docstring)."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    earlier: dict[tuple, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}  # item kind → (rows, base, index)
    for number, base in enumerate(bases):
        items = identifying_rows(base)
        n = len(next(iter(items.values()))) if items else 0
        owner, index = np.full(n, number, dtype=np.int64), np.arange(n, dtype=np.int64)
        for kind, rows in items.items():
            _take_stored(rows, earlier.get(kind, []), owner, index, number)
        for kind, rows in items.items():
            earlier.setdefault(kind, []).append((rows, owner, index))
        out.append((owner, index))
    return out


def identifying_rows(dataset: Any) -> dict[tuple, np.ndarray]:
    """Per kind of item (element type, row shape), the row digests of the items of ``dataset`` with one row per record
    that identify its records (module docstring); empty when none does."""
    found: dict[tuple, np.ndarray] = {}
    for value, rows in identifying_items(dataset, row_digests):
        found.setdefault((_kind(value), _width(value)), rows)
    return found


def identifying_items(dataset: Any, digest: Callable[[Any], Any]) -> Iterator[tuple[Any, Any]]:
    """(item, ``digest(item)``) for each item ``dataset`` stores (:func:`stored_items`) with one row per record that
    is not a column of integers, whose row digests — ``digest``'s array, or the first of its tuple; ``None``: not
    digested — are one per record and at least :data:`DISTINCT` distinct; when none is, the same of the items as
    read (:func:`~.read_items.read_items`: a list of dicts). Nothing for a dataset without a length or records; an
    item of no rows (a 0-d tensor or array: a setting) is passed over undigested."""
    try:
        n = len(dataset)
    except TypeError:
        return
    if not n:
        return
    identified = False
    for value, found in _identifying((value for _, value in stored_items(dataset)), n, digest):
        identified = True
        yield value, found
    if not identified:  # nothing stored identifies them: the items as read (a list of dicts, :mod:`.read_items`)
        yield from _identifying((value for _, value in read_items(dataset)), n, digest)


def _identifying(values: Iterator[Any], n: int, digest: Callable[[Any], Any]) -> Iterator[tuple[Any, Any]]:
    for value in values:
        if _row_count(value) != n or _integer_column(value):
            continue  # not one row per record (a table, a setting), or labels, ids, indices
        found = digest(value)
        rows = found[0] if isinstance(found, tuple) else found
        if rows is not None and len(rows) == n and len(np.unique(rows)) >= DISTINCT * n:
            yield value, found


def _row_count(value: Any) -> Optional[int]:
    """How many rows (dimension 0) a stored item has; ``None`` for a 0-d tensor or array."""
    if isinstance(value, list):
        return len(value)
    return int(value.shape[0]) if getattr(value, "ndim", 0) else None


def _take_stored(rows: np.ndarray, before: list[tuple[np.ndarray, np.ndarray, np.ndarray]], owner: np.ndarray,
                 index: np.ndarray, number: int) -> None:
    """Point the records of base ``number`` (``rows``) that an earlier base stores too at that base's record, for
    each earlier base that stores :data:`OVERLAP` of the smaller of the two or more."""
    for stored, stored_owner, stored_index in before:
        order = np.argsort(stored, kind="stable")
        at = np.clip(np.searchsorted(stored[order], rows), 0, len(stored) - 1)
        hit = (stored[order][at] == rows) & (owner == number)
        smaller = min(len(rows), len(stored))
        if hit.sum() and hit.sum() >= OVERLAP * smaller:
            owner[hit] = stored_owner[order][at][hit]
            index[hit] = stored_index[order][at][hit]


def _integer_column(value: Any) -> bool:
    if isinstance(value, list):
        return isinstance(value[0], (int, np.integer))
    dtype = value.dtype
    integer = (not dtype.is_floating_point and not dtype.is_complex) if isinstance(value, torch.Tensor) \
        else np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_)
    return bool(integer) and (value.ndim <= 1 or int(np.prod(value.shape[1:])) == 1)


def _width(value: Any) -> tuple[int, ...]:
    return () if isinstance(value, list) else tuple(value.shape[1:])


def _kind(value: Any) -> str:
    """The item's element type, alike for a tensor and a NumPy array of one dtype."""
    return "list" if isinstance(value, list) else str(value.dtype).replace("torch.", "")
