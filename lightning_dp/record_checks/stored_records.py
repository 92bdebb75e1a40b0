"""A rebuilt training loader stores the same records as the fit's first (rule 8, beside
:func:`lightning_dp.validators.loaders.record_set`).

The privacy unit is a record, and the accounting is for one population whose records are fixed: Poisson sampling
draws each record at rate q in every step. A ``train_dataloader`` rebuilt every epoch
(``reload_dataloaders_every_n_epochs``) that stores records computed from the training set — every input scaled by
the model's mean loss over the whole set (a "temperature curriculum"), features re-normalised by the current
model's statistics, labels smoothed by the current predictions — makes each later record depend on every other
record, un-noised. Augmentation belongs to the fetch (``__getitem__`` or the collate, from public values such as the
epoch number), not to the stored tensors.

:func:`stored_records` notes, at the fit's first training loader, a digest of every row (along dimension 0) of what
its datasets store: the tensors they hold (:func:`~lightning_dp.fingerprints.dataset_tokens.dataset_parts`), the
in-memory NumPy arrays and the lists of numbers, strings (file paths), tensors or arrays they hold as attributes — one
pass over their bytes, on the tensors' own device. At a reload on the same indices, :func:`changed_records` compares the
rebuilt loader's (the same dataset or a new one built alike): a stored item at the same place, of the same shape and
type, whose rows differ is refused, unless the records as a whole (the rows of all the items of that length
together, at the loader's indices) are the same ones in another order. Without a reload,
:func:`check_stored_unchanged` compares them again at every epoch's first step (records mixed in place by a callback
after a warm-up, zoo17 c3). Not compared: items of under two elements (a setting, an epoch number), memory-mapped
arrays and what a dataset reads lazily from files (a fetch is stateless: ``records/stateless.py``), items present in
one loader only, and a rebuilt loader on another set of indices.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Subset

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.dataset_tokens import dataset_parts

MAX_ITEMS = 1 << 17
"""Items of a list of tensors or arrays beyond which it is not digested (one digest per item)."""

_CHUNK = 1 << 24
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class StoredRecords:
    """Row digests of what a training loader's datasets store.

    Attributes:
        indices: the loader's records (indices of the dataset under its ``Subset`` wrappers, sorted).
        length: that dataset's length.
        items: path → (shape, type, one 64-bit digest per row).
    """

    indices: tuple[int, ...]
    length: int
    items: dict[str, tuple[tuple[int, ...], str, np.ndarray]]


def stored_records(dataset: Any, indices: Any) -> StoredRecords:
    """:class:`StoredRecords` of ``dataset`` (a loader's), whose records are ``indices`` of the dataset under its
    ``Subset`` wrappers (:func:`~lightning_dp.validators.loaders.record_set`)."""
    base = dataset
    while isinstance(base, Subset):
        base = base.dataset
    try:
        length = len(base)
    except TypeError:
        length = -1
    items = {}
    for path, value in _stored(dataset):
        digest = _rows(value)
        if digest is not None:
            items[path] = (_shape(value), _kind(value), digest)
    return StoredRecords(tuple(sorted(int(i) for i in indices)), length, items)


def changed_records(before: StoredRecords, now: StoredRecords) -> list[str]:
    """The stored items whose records changed from ``before`` to ``now`` (module docstring); empty if none, or if the
    loaders train on other indices (:func:`~lightning_dp.validators.loaders.record_set`'s case)."""
    if before.indices != now.indices or before.length != now.length:
        return []
    common = [p for p in before.items if p in now.items and before.items[p][:2] == now.items[p][:2]]
    changed = [p for p in common if not np.array_equal(before.items[p][2], now.items[p][2])]
    found = []
    for size in dict.fromkeys(len(before.items[p][2]) for p in changed):
        together = sorted(p for p in common if len(before.items[p][2]) == size)
        if not np.array_equal(_records(before, together, size), _records(now, together, size)):
            found += [p for p in changed if len(before.items[p][2]) == size]
    return found


def check_stored_unchanged(before: StoredRecords, dataset: Any, indices: Any) -> None:
    """At an epoch's first step: refuse when what the training loader's datasets store changed since the fit's first
    loader, without a reload — written in place or bound anew by your code between epochs (offline mixup or a
    re-normalisation switched on after a warm-up: each stored record then holds others' data; zoo17 c3). Only items
    whose rows were :data:`FILLED` distinct are compared: a decode buffer the reads fill changes as it is filled.

    Raises:
        PrivacyConfigurationError: naming the items that changed (:func:`changed_records_error`).
    """
    held = {path: item for path, item in before.items.items() if len(np.unique(item[2])) >= FILLED * len(item[2])}
    changed = changed_records(StoredRecords(before.indices, before.length, held), stored_records(dataset, indices))
    if changed:
        raise changed_records_error(changed, rebuilt=False)


FILLED = 0.9
"""Items compared between epochs of one loader: those whose rows were this share distinct or more at the fit's first
loader. A buffer the reads fill (records decoded into a preallocated tensor of zeros) is not compared."""


def changed_records_error(found: list[str], rebuilt: bool = True) -> PrivacyConfigurationError:
    """The refusal of :func:`changed_records`' findings (``rebuilt``: at a reload of the loader; else between epochs
    of one loader)."""
    names = ", ".join((p.lstrip(".") or "the dataset") for p in found[:4])
    how = "was rebuilt on the same records with" if rebuilt else "holds the same records with"
    return PrivacyConfigurationError(
        f"The training loader {how} other stored values ({names} changed since the "
        "fit's first training loader): the privacy unit is a record, and each record must be the same data in "
        "every epoch. Values recomputed while training (inputs scaled by the model's loss over the training set, "
        "features normalised by the current model, labels relabelled from its predictions) depend on every other "
        "record, un-noised (so do records mixed with others in place after a warm-up). Nothing more was released. Keep "
        "the stored records fixed, and compute per-epoch "
        "transforms in __getitem__ (or the collate) from public values only (the epoch number, a seeded random "
        "augmentation).")


def _stored(dataset: Any) -> Iterator[tuple[str, Any]]:
    """(path, tensor / array / list) the datasets of ``dataset`` store (module docstring)."""
    datasets, tensors = dataset_parts(dataset)
    positions = {id(d.indices) for d in datasets if isinstance(d, Subset)}  # which records: record_set's, not records
    for path, t in tensors:
        if id(t) not in positions:
            yield path or "tensor", t
    for position, d in enumerate(datasets):
        for key, value in (vars(d).items() if hasattr(d, "__dict__") else ()):
            if id(value) in positions or _order(value):
                continue
            if isinstance(value, np.ndarray) and not isinstance(value, np.memmap) and value.dtype != object:
                yield f"dataset {position} ({type(d).__name__}).{key}", value
            elif isinstance(value, list) and len(value) >= 2 and isinstance(value[0], (int, float, str, bytes,
                                                                                      Tensor, np.ndarray)):
                yield f"dataset {position} ({type(d).__name__}).{key}", value


def _order(value: Any) -> bool:
    """A list of positions in another order (``set_epoch`` shuffles ``self.order``): which records, not records."""
    return isinstance(value, list) and len(value) >= 2 and all(type(v) is int for v in value) \
        and min(value) == 0 and max(value) == len(value) - 1 and len(set(value)) == len(value)


def _shape(value: Any) -> tuple[int, ...]:
    return (len(value),) if isinstance(value, list) else tuple(value.shape)


def _kind(value: Any) -> str:
    return "list" if isinstance(value, list) else f"{type(value).__name__}:{value.dtype}"


def _rows(value: Any) -> Optional[np.ndarray]:
    """One 64-bit digest per row of ``value`` (uint64), or ``None`` (under two elements, sparse, too many items)."""
    if isinstance(value, list):
        return _list_rows(value)
    if isinstance(value, np.ndarray):
        return _tensor_rows(_bytes_of(value)) if value.size >= 2 else None
    if not isinstance(value, Tensor) or value.layout != torch.strided or value.numel() < 2 or value.is_quantized:
        return None
    return _tensor_rows(value)


def _bytes_of(value: np.ndarray) -> Tensor:
    """A NumPy array's rows as bytes (any dtype but object: strings too), as a tensor."""
    rows = np.ascontiguousarray(value).reshape(len(value) if value.ndim else 1, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only array
        return torch.from_numpy(rows.view(np.uint8).reshape(rows.shape[0], -1))


def _tensor_rows(t: Tensor) -> np.ndarray:
    """Each row's bytes as 32-bit words, combined with fixed multipliers (wrapping int64 sums), on ``t``'s device in
    chunks of rows."""
    t = t.detach()
    t = t.reshape(1, -1) if t.dim() == 0 else t.contiguous().reshape(t.shape[0], -1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    raw = t.view(torch.uint8)
    pad = (-raw.shape[1]) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(raw.shape[0], pad)], 1)
    words = raw.view(torch.int32)
    width = words.shape[1]
    multipliers = torch.from_numpy(np.random.default_rng(0x5EED).integers(1, 1 << 30, width, dtype=np.int64) * 2 + 1)
    multipliers = multipliers.to(words.device)
    out = torch.empty(words.shape[0], dtype=torch.int64, device=words.device)
    step = max(1, _CHUNK // max(1, width))
    for start in range(0, words.shape[0], step):
        out[start:start + step] = (words[start:start + step].to(torch.int64) * multipliers).sum(1) ^ width
    return out.cpu().numpy().view(np.uint64)


def _list_rows(value: list) -> Optional[np.ndarray]:
    """A list's items' digests: a tensor's or array's bytes (with its shape), a number's or string's hash."""
    if isinstance(value[0], (Tensor, np.ndarray)):
        if len(value) > MAX_ITEMS:
            return None
        digests = []
        for item in value:
            if isinstance(item, Tensor) and item.layout == torch.strided and not item.is_quantized:
                rows: Optional[np.ndarray] = _tensor_rows(item.reshape(1, -1))
            elif isinstance(item, np.ndarray) and item.dtype != object:
                rows = _tensor_rows(_bytes_of(item.reshape(1, -1)))
            else:
                rows = None
            shape = hash(tuple(getattr(item, "shape", ())))
            digests.append((hash(repr(item)) if rows is None else int(rows[0]) ^ shape) & _MASK)
        return np.array(digests, dtype=np.uint64)
    try:
        return np.array([hash(item) & _MASK for item in value], dtype=np.uint64)
    except TypeError:  # an unhashable item further on
        return None


def _records(stored: StoredRecords, paths: list[str], size: int) -> np.ndarray:
    """The records of ``paths`` (items of ``size`` rows) taken together, one digest each, at the loader's indices
    where they are the dataset's rows, sorted (their order aside)."""
    combined = np.zeros(size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k, path in enumerate(paths):
            combined = combined * np.uint64(0x9E3779B97F4A7C15) + stored.items[path][2] + np.uint64(k)
    if size == stored.length and stored.indices and stored.indices[-1] < size:
        combined = combined[np.asarray(stored.indices, dtype=np.int64)]
    return np.sort(combined)


def stored_items(dataset: Any) -> Iterator[tuple[str, Any]]:
    """(path, tensor / array / list) that the datasets of ``dataset`` store (module docstring)."""
    return _stored(dataset)


def row_digests(value: Any) -> Optional[np.ndarray]:
    """One 64-bit digest per row of a stored item (uint64), or ``None`` where it is not digested."""
    return _rows(value)
