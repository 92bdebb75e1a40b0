"""Datasets that store the same records: several base datasets of one population built over the same stored rows.

:mod:`.record_sources` maps each training position down through torch's wrappers to a *base* dataset and an index
there, and refuses two positions with one source. A base is a dataset object; but two objects can store one set of
records — ``ConcatDataset([Flipped(x, y), Jittered(x, y)])`` of two augmenting classes holding the same tensors, or
two torchvision-style datasets each loading the same training files (``CIFAR10(train=True, transform=t)`` twice,
with two transforms): every person is then two positions, drawn twice per step and clipped twice, while the ledger
charges one chance in N for twice the people (zoo17 r2). :func:`stored_key` names a base by what it stores, so that
such bases are one source.

A base's key is a digest of its *per-record items* — the tensors, in-memory NumPy arrays and lists it stores with one
row per record (:func:`~lightning_dp.validators.stored_records.stored_items`) — each as the sorted digests of its rows
(:func:`~lightning_dp.validators.stored_records.row_digests`: the same records stored in another order are the same
records). Two bases share a key when every per-record item of one equals one of the other's. A base is keyed only when
one of its items identifies its records: at least :data:`DISTINCT` of its rows distinct and not a column of integers
(labels, ids or indices ``0 … n − 1`` are alike in datasets of other people); a base of under :data:`MIN_RECORDS`
records, or one whose records live in files it reads by index, keeps its identity as its name.

Cost: one pass over the stored bytes of each base, only when a population has two bases or more. Not seen: copies
stored after a transform (a flipped copy of the images kept as a second array: the content checks' to see, or not,
:mod:`.repeated_records`), and bases that store other items beside the same records (a second label column).
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import numpy as np
import torch

from lightning_dp.validators.stored_records import row_digests, stored_items

MIN_RECORDS = 8
"""Bases of fewer records keep their identity as their name."""

DISTINCT = 0.9
"""The share of distinct rows of an item that identifies its records."""


def stored_key(dataset: Any) -> Optional[bytes]:
    """What ``dataset`` stores, as one key (module docstring); ``None`` when it stores nothing that identifies its
    records."""
    try:
        n = len(dataset)
    except TypeError:
        return None
    if n < MIN_RECORDS:
        return None
    items, identified = [], False
    for _, value in stored_items(dataset):
        rows = row_digests(value)
        if rows is None or len(rows) != n:
            continue  # not one row per record: a table, a setting
        identified = identified or (len(np.unique(rows)) >= DISTINCT * n and not _integer_column(value))
        items.append(repr((_width(value), _kind(value))).encode() + np.sort(rows).tobytes())
    if not identified:
        return None
    return hashlib.blake2b(b"".join(sorted(items)), digest_size=16).digest()


def same_as(bases: list[Any]) -> list[int]:
    """For each of ``bases``, the position of the first of them that stores the same records (its own if none)."""
    first: dict[bytes, int] = {}
    out = []
    for position, base in enumerate(bases):
        key = stored_key(base)
        out.append(position if key is None else first.setdefault(key, position))
    return out


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
