"""Which records a row of numbers is: its content under casts and column orders, and the rows it was computed from.

The record of the releases made on each dataset (:mod:`lightning_dp.accounting.data_ledgers`) finds a fit's records
among earlier fits' by the digests of their rows. Three ways the same records arrive as other bytes:

* a cast: ``X.float()`` of the float64 rows an earlier fold read. :func:`value_rows` digests each row's values as
  float32 (−0 as 0), so float32 and float64 copies of one row have one digest;
* a column order: ``X[idx][:, perm]``. :func:`value_rows` also digests each row's values *sorted*, a digest that no
  column order changes. Rows of few distinct values share it (binary or small-integer rows: their sorted rows are
  mostly alike), and one shared by unrelated records would compose fits on them (ε overstated: safe, but a false
  charge), so an item keeps it only when its rows' sorted digests are at least :data:`SORTED_DISTINCT` distinct
  (within the item: then two halves of it share few sorted digests, under the data ledger's overlap of 5 %),
  judged over its distinct rows (:func:`_first_copies`);
* the library's own preprocessing: :class:`~lightning_dp.data.PrivateStandardizer` and
  :class:`~lightning_dp.data.PrivateImputer` compute new rows (noisy mean and scale, filled cells) from each input
  row. Their ``transform`` calls :func:`note_derived` (through :func:`~.released_transforms.note_transformed`, which
  hands it the digests it took): each output row's value digest is noted as descending from the input row's *root*
  (the input's own digests, or its root when the input itself descends from another transform's input).
  :func:`value_rows` reads a row through these notes, so the rows of ``fit_transform(X[idx])`` per fold are the
  rows of ``X`` they came from, wrapped later in a ``TensorDataset``, a ``Subset`` or a concatenation, cast or not.

A near-copy: ``X + 1e-7·noise``, ``X.half().float()``, ``X.round(decimals=3)`` of rows an earlier fit read hold the
same records in other values. :func:`coarse_rows` digests each row's values quantised on a grid per column (cells
of 2^−k times a power of two of the column's mean |x|, the mean over the item's rows; :data:`COARSE_LEVELS`): a
change far under the cell moves a row's cells only where a value lies near a cell's edge, so each row is digested on
two grids, the second offset by a third of a cell (two kinds of digest: a row matches on either). A third, not a
half: no integer or other value of a coarser power-of-two step (a float16) lies on an edge of the offset grid, so
rows of integers, which lie on the first grid's edges, keep all their cells on it. The column's cell width, a power
of two, moves only when its mean crosses one. An item keeps them only when its rows are
:data:`COARSE_DISTINCT` distinct by them, else those of a finer level: rows of few distinct values (binary, small
integers, two or three columns) share cells, and unrelated records sharing cells would compose fits on them.
Distinct *records* are counted (:func:`_first_copies`): exact copies of a row within the item (a record
oversampled, a constant padding row) are one row there, and so are rows in one cell of *both* grids of the finest
level where every column is digested (a record and its copy under a small jitter). They are not evidence that the
cells join unrelated records — a copy's cells are its row's by construction, exact copies are matched by the value
digests already (an item with :data:`~lightning_dp.record_checks.stored_sources.DISTINCT` distinct rows, which
:func:`coarse_rows` requires too: rows of few values repeat by chance), and two unrelated rows share a cell of both
grids far less often than one of either — and counting them made a handful of duplicates (5 of 1,000 rows) drop
every coarse digest, so a near-copy of the data was not composed with it (zoo30 r05). Measured over the draws of
docs/accounting.md: unrelated rows' coarse matches beyond their exact ones at most 0.8 % (1.2 % before).
Measured in docs/accounting.md ("Near-copies"): near-copies match by 45–100 % of their rows, unrelated data by
none. Not seen: a rescale (×1.01: every value moves by 1 %), a rotation, columns permuted and jittered together,
added or dropped columns.

The notes are process-wide, :data:`MAX_NOTED` output rows at most (24 bytes each; the oldest transforms' notes are
dropped first). A transform the user writes (``(X - m) / s`` by hand) is not seen: its rows are new records to this
module, as they are bytes the record has never held.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from lightning_dp.record_checks.stored_records import row_digests
from lightning_dp.record_checks.stored_sources import DISTINCT, identifying_items

SORTED_DISTINCT = 0.99
"""The share of distinct sorted-row digests an item's rows must reach for its column-order-free digest to be used."""

COARSE_LEVELS = (2, 5)
"""The cells of :func:`coarse_rows`, finest last: 2^−k times a power of two of each column's mean |x|, for k in it;
the first level whose rows are :data:`COARSE_DISTINCT` distinct is used."""

COARSE_DISTINCT = 0.998
"""The share of distinct rows an item's coarse digests must reach to be used. Unrelated rows of one distribution
share a cell about 2–3 times as often as the item's own rows do (measured: 99 % distinct matched 2.7 % of an
independent draw); 99.8 % keeps that under 1 % (measured, with :data:`COARSE_ROWS`: at most 1 % over normal,
uniform, exponential, log-normal and small-integer draws of 1–20 columns and 20–5,000 rows), far under the data
ledger's overlap of 5 %."""

COARSE_ROWS = 500
"""Under this many rows, an item's distinct share bounds little (no two of 50 rows in one cell is likely even where
unrelated rows share cells 1 time in 20): its rows must also be :data:`COARSE_DISTINCT` distinct on cells 16 times as
wide for the coarse digests to be used."""

COARSE_COLUMNS = 64
"""The most columns of a row :func:`coarse_rows` digests (evenly spaced): an image's 3,072 values are not needed to
tell its records apart, and each column digested is one more value that may lie near a cell's edge."""

_SCALE_FLOOR = 2.0 ** -16
"""A column's scale is at least this share of the item's largest column's: a column of zeros (a border pixel) under
``+ 1e-7·noise`` keeps a cell of the item's scale, not one of the noise's."""

MAX_NOTED = 1 << 22
"""The most output rows :func:`note_derived` keeps notes for (process-wide): about 100 MB at most."""

_CHUNK = 1 << 22

_NOTED: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
"""Per transform call, oldest first: (output rows' value digests, their roots' value digests, their roots' sorted
digests, 0 where the root's item had none)."""
_MERGED: dict[str, Any] = {"for": None}


def float32_rows(value: Any) -> Optional[Tensor]:
    """``value``'s rows (dimension 0) as float32 [N, D] (−0 as 0, one NaN), ``None`` when not numbers: the values
    every digest of this module and of :mod:`.released_transforms` is taken of."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf" or isinstance(value, np.memmap) or value.ndim == 0:
            return None
        t = torch.from_numpy(np.ascontiguousarray(value.reshape(len(value), -1), dtype=np.float32))
    elif isinstance(value, Tensor):
        if value.layout != torch.strided or value.is_quantized or value.is_complex() or value.dim() == 0 \
                or hasattr(value, "to_local"):
            return None
        t = value.detach().reshape(len(value), -1).to(torch.float32)
    else:
        return None
    if t.shape[0] == 0:
        return None
    t = t + 0.0  # −0.0 + 0.0 is 0.0
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)


def own_rows(value: Any) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(each row's value digest, its sorted digest — zeros when the item's distinct rows are under
    :data:`SORTED_DISTINCT` distinct by it) of ``value`` itself, not read through the notes; ``None`` when not
    numbers."""
    if not isinstance(value, (Tensor, np.ndarray)) or not value.ndim or float32_rows(value[:1]) is None:
        return None
    width = max(1, int(np.prod(value.shape[1:])))
    step = max(2, _CHUNK // width)  # a float32 copy of at most _CHUNK values at a time
    step += len(value) % step == 1  # never a last chunk of one row (a single number is not digested)
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    for start in range(0, len(value), step):
        t = float32_rows(value[start:start + step])
        found = None if t is None else (row_digests(t), row_digests(_sorted(t)))
        if found is None or found[0] is None or found[1] is None:
            return None
        parts.append(found)  # type: ignore[arg-type]
    if not parts:
        return None
    values, ordered = np.concatenate([v for v, _ in parts]), np.concatenate([o for _, o in parts])
    first = _first_copies(values)
    if len(np.unique(ordered[first])) < SORTED_DISTINCT * len(first):
        ordered = np.zeros_like(ordered)
    return values, ordered


def coarse_rows(value: Any, records: Optional[np.ndarray] = None) -> Optional[tuple[int, np.ndarray, np.ndarray]]:
    """(level k, each row's digest on the grid of cells 2^−k × its column's scale, on that grid offset by a third
    of a cell) of ``value`` (module docstring) at the first of :data:`COARSE_LEVELS` whose distinct rows are
    :data:`COARSE_DISTINCT` distinct; ``None`` when none is, when under
    :data:`~lightning_dp.record_checks.stored_sources.DISTINCT` of its rows are distinct, or ``value`` is not
    numbers. NaN stays NaN. Of a row wider than :data:`COARSE_COLUMNS`, that many columns evenly spaced are digested.
    ``records``: each row's value digest over all its columns (equal for exact copies), where the caller has them;
    else taken here."""
    if not isinstance(value, (Tensor, np.ndarray)) or isinstance(value, np.memmap) or value.ndim == 0 \
            or len(value) < 2 or float32_rows(value[:1]) is None:
        return None
    if records is None or len(records) != len(value):
        own = own_rows(value)
        if own is None:
            return None
        records = own[0]
    first = _first_copies(records)
    if len(first) < DISTINCT * len(value):  # rows of few values: exact copies by chance (the value digests' rule)
        return None
    flat = value.reshape(len(value), -1)
    width = flat.shape[1]
    picked = np.unique(np.linspace(0, width - 1, min(width, COARSE_COLUMNS)).round().astype(np.int64))
    step = max(2, _CHUNK // len(picked))
    step += len(value) % step == 1  # never a last chunk of one row (a single number is not digested)
    parts = [float32_rows(flat[start:start + step][:, picked]) for start in range(0, len(value), step)]
    if any(t is None for t in parts):
        return None
    total = sum(t.abs().nan_to_num(0.0).to(torch.float64).sum(0) for t in parts)  # type: ignore[union-attr]
    count = sum((~torch.isnan(t)).sum(0) for t in parts)  # type: ignore[arg-type]
    scale = total / count.clamp(min=1)  # type: ignore[union-attr]
    largest = float(scale.max())
    scale = scale.clamp(min=_SCALE_FLOOR * largest) if largest > 0 else torch.ones_like(scale)
    power = torch.floor(torch.log2(torch.where(scale > 0, scale, torch.ones_like(scale))))
    if len(picked) == width:  # every column digested: rows in one cell of both finest grids are one record
        finest = [_cells(parts, power - COARSE_LEVELS[-1], shift) for shift in (0.0, 1 / 3)]
        if finest[0] is None or finest[1] is None:
            return None
        first = first[np.sort(np.unique(np.stack(finest, 1)[first], axis=0, return_index=True)[1])]  # type: ignore
    for level in COARSE_LEVELS:
        on, off = (_cells(parts, power - level, shift) for shift in (0.0, 1 / 3))
        if on is None or off is None or not _distinct(on[first]) or not _distinct(off[first]):
            continue
        if len(first) < COARSE_ROWS:  # few rows: distinct on cells 16 times as wide too
            wide = _cells(parts, power - level + 4, 0.0)
            if wide is None or not _distinct(wide[first]):
                continue
        return level, on, off
    return None


def _cells(parts: list[Tensor], power: Tensor, shift: float) -> Optional[np.ndarray]:
    """Each row's digest of its cells of width 2^``power`` (per column; a power of two: x / cell is exact), their
    edges ``shift`` of a cell below the multiples of the width."""
    found = [row_digests(torch.floor(t.to(torch.float64) / torch.pow(2.0, power) + shift)) for t in parts]
    return None if any(d is None for d in found) else np.concatenate(found)  # type: ignore[arg-type]


def _distinct(digests: np.ndarray) -> bool:
    return len(np.unique(digests)) >= COARSE_DISTINCT * len(digests)


def _first_copies(records: np.ndarray) -> np.ndarray:
    """The positions of the first row of each distinct value digest in ``records``: the item's distinct rows, over
    which the distinct shares of its sorted and coarse digests are judged (module docstring)."""
    return np.sort(np.unique(records, return_index=True)[1])


def _sorted(t: Tensor) -> np.ndarray:
    """Each row of ``t`` (float32 [N, D] on the CPU, −0 as 0, one NaN) sorted, NaN last: ``np.sort``, bit for bit
    ``torch.sort``'s values here (so stored sorted digests stay valid) and 4–5× faster on image rows (ledger29)."""
    return np.sort(t.detach().cpu().numpy(), axis=1)


def value_rows(value: Any) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(each row's root value digest, its root sorted digest, 0 where none) of ``value``: its own
    (:func:`own_rows`), or, for a row a noted transform computed, those of the row it came from; ``None`` when
    ``value`` is not numbers."""
    own = own_rows(value)
    return None if own is None else _rooted(*own)


def _rooted(values: np.ndarray, ordered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Own digests (:func:`own_rows`) read through the notes: a noted output row's are its root's."""
    merged = _merged()
    if merged is None:
        return values, ordered
    keys, roots, root_ordered = merged
    at = np.clip(np.searchsorted(keys, values), 0, len(keys) - 1)
    hit = keys[at] == values
    return np.where(hit, roots[at], values), np.where(hit, root_ordered[at], ordered)


def note_derived(inputs: Any, outputs: Any, digested: Optional[tuple[Any, Any]] = None) -> None:
    """Note that row i of ``outputs`` was computed from row i of ``inputs`` (a row-to-row transform of the library's:
    module docstring); nothing when they are not numbers of as many rows. ``digested``: their :func:`own_rows`,
    where the caller took them already (:func:`~.released_transforms.note_transformed`: one pass for both notes)."""
    came, made = digested if digested is not None else (own_rows(inputs), own_rows(outputs))
    found = None if came is None else _rooted(*came)
    if found is None or made is None or len(found[0]) != len(made[0]):
        return
    roots, ordered = found
    new = made[0] != roots  # a row the transform left as it was is its own root already
    if not new.any():
        return
    _NOTED.append((made[0][new], roots[new], ordered[new]))
    total = sum(len(k) for k, _, _ in _NOTED)
    while len(_NOTED) > 1 and total > MAX_NOTED:
        total -= len(_NOTED.pop(0)[0])
    _MERGED["for"] = None


def _merged() -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The notes as one lookup sorted by output digest (the newest note of a digest wins), ``None`` when empty."""
    if not _NOTED:
        return None
    if _MERGED["for"] is None:
        keys = np.concatenate([k for k, _, _ in reversed(_NOTED)])
        roots = np.concatenate([r for _, r, _ in reversed(_NOTED)])
        ordered = np.concatenate([o for _, _, o in reversed(_NOTED)])
        keys, first = np.unique(keys, return_index=True)
        _MERGED.update({"for": True, "lookup": (keys, roots[first], ordered[first])})
    return _MERGED["lookup"]


def forget_notes() -> None:
    """Drop every note (for the test suite: each test stands for a process of its own)."""
    _NOTED.clear()
    _MERGED["for"] = None


def dataset_rows(dataset: Any) -> dict[tuple, np.ndarray]:
    """Per item of ``dataset`` with one row per record that identifies them (numbers, not a column of integers, at
    least :data:`~lightning_dp.record_checks.stored_sources.DISTINCT` distinct rows): ``("values", row shape)`` →
    each row's root value digest, ``("sorted", row shape)`` → its root sorted digest (0: none), by
    :func:`value_rows`, and ``("coarse", row shape, level, 0 | 1)`` → its digest on either grid of :func:`coarse_rows`
    (none where the item's rows are not distinct by them); empty when no item identifies the records."""
    out: dict[tuple, np.ndarray] = {}
    for value, (values, ordered) in identifying_items(dataset, _lineage_rows):
        width = tuple(value.shape[1:])
        if ("values", width) in out:
            continue
        out[("values", width)], out[("sorted", width)] = values, ordered
        try:
            coarse = coarse_rows(value, values)  # root digests: rows of one root are one record
        except (RuntimeError, TypeError, ValueError, NotImplementedError):  # a tensor without data (meta), ...
            coarse = None
        if coarse is not None:
            level, on, off = coarse
            out[("coarse", width, level, 0)], out[("coarse", width, level, 1)] = on, off
    return out


def _lineage_rows(value: Any) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """:func:`value_rows` of a stored item, ``None`` where it is not numbers or cannot be read."""
    if not isinstance(value, (Tensor, np.ndarray)):
        return None
    try:
        return value_rows(value)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):  # a tensor without data (meta), ...
        return None
