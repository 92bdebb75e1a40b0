"""Copies of a dataset's rows in its other arrays: one record's data held again, in another order or another array.

"Offline mixup" keeps the data ``x`` and a shuffled copy ``px = x[perm].clone()`` (a tensor, or a float64 NumPy
array) and reads record i as ``0.7 * x[i] + 0.3 * px[i]``: record ``perm[i]``'s row is then in record i too, and one
person's data sits in two records (its influence 2C a step, two chances to be sampled). Pairs or triplets stacked from
the training set (``torch.stack([x, x[pos], x[neg]], 1)``), a bank of negatives ``x[:100]``, partners drawn with
replacement (``x[idx]``) do the same. :mod:`.shared_records` finds a record's rows by exchanging rows of one array at
a time; a copy in other memory does not move with them, so the record looked like its own row alone.

:func:`copied_rows` finds, for a source array (one whose rows the records are made of), the rows of every other array
the dataset holds that are exact copies of its rows — compared as float64 values, so a float64 NumPy copy of float32
data is one, and rounded to the copy's type when that is float16 or bfloat16 —, also as consecutive blocks of a wider
row (a pair ``[x_i, x_j]`` is two blocks). Each row is keyed by a 64-bit digest of up to :data:`KEY_ELEMENTS` of its
elements (spread over it) and every match is then compared element by element. Only rows that occur once in the source
count (a row many records share — padding, a constant image row — is nobody's), a copy must be of at least
:data:`MIN_WIDTH` elements and not constant, and an array is taken for a copy only when at least
:data:`MIN_SHARE` of its blocks are the source's rows (a chance equality is not a copy). The exchange then moves each
copied block with its source row (:meth:`RowCopies.exchange`): a record that reads another record's row through the
copy is seen to read that row, and the shared-records checks find the two records sharing it.

Cost: nothing when no other array has rows of the source's width (``TensorDataset(x, y)``); otherwise one pass over
the arrays' rows (a few float64 operations per keyed element) once before training. Not seen: copies transformed
after they were taken (rescaled, projected, mixed already: a precomputed ``0.7 * x + 0.3 * x[perm]``), copies kept
outside the dataset's attributes and its classes' globals, and copies of rows that occur more than once in the source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_dp.records.memory_spans import memory_span

KEY_ELEMENTS = 64
"""Elements of a row (spread over it) its key digests; matches are then compared in full."""

MIN_WIDTH = 4
"""Rows of fewer elements are not matched (a label, a pair of ids: equal values are not copies)."""

MIN_SHARE = 0.25
"""The share of an array's non-constant blocks that must be the source's rows for it to be taken for a copy."""

VERIFIED = 1 << 22
"""Elements of the matched blocks compared one by one at most (beyond: a spread sample of the blocks)."""

_BLOCK = 1 << 16
"""Rows keyed at a time (bounds the float64 working copy)."""


@dataclass
class RowCopies:
    """Blocks of ``copy`` that are rows of a source array.

    Attributes:
        name: where the copy is held (its attribute or global), never its data.
        copy: the array holding the copied rows (a tensor or NumPy array, exchanged in place).
        blocks: ``copy`` viewed as ``[rows, blocks per row, source row width]`` (its memory).
        source_rows: the source row each copied block holds, sorted.
        rows: the copy's row of each block, in the order of ``source_rows``.
        columns: the block within that row.
        within: whether the copy is the source itself (a pair's second block a copy of another row's first).
    """

    name: str
    copy: Any
    blocks: Any
    source_rows: np.ndarray
    rows: np.ndarray
    columns: np.ndarray
    within: bool = False

    def exchange(self, runs: Sequence[slice], elements: Optional[Sequence[slice]] = None) -> Callable[[], None]:
        """Exchange (:func:`~lightning_dp.record_checks.outside_records.exchange`) the blocks copied from the source
        rows
        in ``runs`` (only their ``elements``, runs of positions in the flat row, when given); returns the function that
        restores them exactly."""
        from lightning_dp.record_checks.outside_records import exchange

        picked = [np.arange(*np.searchsorted(self.source_rows, [r.start, r.stop])) for r in runs]
        which = np.concatenate(picked) if picked else np.zeros(0, np.int64)
        if self.within and which.size:  # a copy in a row exchanged whole already: not flipped back
            inside = np.zeros(which.size, bool)
            for r in runs:
                inside |= (self.rows[which] >= r.start) & (self.rows[which] < r.stop)
            which = which[~inside]
        if which.size == 0:
            return lambda: None
        rows, columns = self.rows[which], self.columns[which]
        if isinstance(self.blocks, Tensor):
            device = self.blocks.device
            index = (torch.as_tensor(rows, device=device), torch.as_tensor(columns, device=device))
        else:
            index = (rows, columns)
        saved = self.blocks[index]
        changed = saved.clone() if isinstance(saved, Tensor) else saved.copy()
        for part in elements if elements is not None else [slice(None)]:
            exchange(changed[:, part], fixed=True)
        self.blocks[index] = changed

        def restore() -> None:
            self.blocks[index] = saved
        return restore


def copied_rows(source: Any, arrays: Sequence[tuple[str, Any]], name: str = "") -> list[RowCopies]:
    """The arrays among ``arrays`` (name, tensor or NumPy array) that hold copies of ``source``'s rows, and where
    (module docstring); arrays sharing its memory (views of it: exchanged with it) are skipped. And ``source``
    itself (its ``name``) when its rows are blocks (``[N, k, …]``, k ≥ 2: pairs, triplets) whose first block is
    copied into other rows' other blocks."""
    width = _row_width(source)
    if width < MIN_WIDTH:
        return []
    found = _copied_within(source, name)
    candidates = [(name, a) for name, a in arrays
                  if a is not source and _row_width(a) >= width and _row_width(a) % width == 0
                  and _blocks_view(a, width) is not None and not _same_memory(a, source)]
    if not candidates:
        return found
    keyed: dict[Optional[torch.dtype], tuple[np.ndarray, np.ndarray]] = {}
    for name, array in candidates:
        rounded = _narrower(array, source)
        if rounded not in keyed:
            keyed[rounded] = _source_keys(source, width, rounded)
        copies = _match(array, width, source, *keyed[rounded], rounded)
        if copies is not None:
            found.append(RowCopies(name, array, _blocks_view(array, width), *copies))
    return found


def _copied_within(source: Any, name: str) -> list[RowCopies]:
    """``source``'s blocks (``[N, k, …]``) that copy another row's first block (a pair ``[x_i, x_perm[i]]``)."""
    if source.ndim < 3 or source.shape[1] < 2:
        return []
    width = int(np.prod(source.shape[2:]))
    blocks = _blocks_view(source, width)
    if width < MIN_WIDTH or blocks is None:
        return []
    keys, rows = _source_keys(blocks[:, 0], width)
    copies = _match(source, width, blocks[:, 0], keys, rows, None, first_is_source=True)
    return [] if copies is None else [RowCopies(name or "the array itself", source, blocks, *copies, within=True)]


def _row_width(array: Any) -> int:
    """Elements per row (along dimension 0); 0 for what has no rows of numbers."""
    if isinstance(array, (Tensor, np.ndarray)) and array.ndim >= 1 and len(array):
        return int(np.prod(array.shape[1:])) if array.ndim > 1 else 1
    return 0


def _blocks_view(array: Any, width: int) -> Any:
    """``array``'s memory as ``[rows, blocks, width]`` (``None``: no such view of it)."""
    shape = (len(array), _row_width(array) // width, width)
    if isinstance(array, Tensor):
        try:
            return array.data.view(shape)
        except RuntimeError:
            return None
    view = array.reshape(shape)
    return view if np.shares_memory(view, array) else None


def _same_memory(a: Any, b: Any) -> bool:
    """Whether two tensors or arrays share memory (a view of one is exchanged with it)."""
    spans = [memory_span(a, whole_storage=True), memory_span(b, whole_storage=True)]
    if None in spans:
        return True  # not known: not matched
    (da, la, ha), (db, lb, hb) = spans
    return da == db and la < hb and lb < ha


def _narrower(copy: Any, source: Any) -> Optional[torch.dtype]:
    """The copy's floating-point type when it is float16 or bfloat16 and the source's is wider: the source's rows are
    keyed rounded to it."""
    dtype = copy.dtype if isinstance(copy, Tensor) else {np.dtype(np.float16): torch.float16}.get(copy.dtype)
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    wide = source.dtype if isinstance(source, Tensor) else {"f": torch.float64}.get(source.dtype.kind)
    return dtype if wide in (torch.float32, torch.float64) else None


def _blocks(array: Any, width: int) -> Optional[Tensor]:
    """``array`` as a ``[blocks, width]`` tensor of its own type (no copy where it can be a view; ``None``: not of
    numbers)."""
    if isinstance(array, np.ndarray):
        if array.dtype.kind not in "fiub":
            return None
        array = torch.from_numpy(array)
    return array.detach().reshape(-1, width)


def _values(part: Tensor, rounded: Optional[torch.dtype] = None) -> Tensor:
    """Some blocks as float64 values on the CPU (rounded to ``rounded`` first)."""
    if rounded is not None:
        part = part.to(rounded)
    return part.to("cpu", torch.float64)


def _columns(width: int) -> np.ndarray:
    return np.unique(np.linspace(0, width - 1, min(width, KEY_ELEMENTS)).round().astype(np.int64))


def _keys(array: Any, width: int, rounded: Optional[torch.dtype] = None) -> tuple[np.ndarray, np.ndarray]:
    """Each block's key (64 bits over its :data:`KEY_ELEMENTS` spread elements) and whether those are all equal (a
    constant block), computed :data:`_BLOCK` blocks at a time."""
    flat = _blocks(array, width)
    columns = torch.from_numpy(_columns(width))
    multipliers = np.random.default_rng(0xC0DE).integers(1, 1 << 62, len(columns), dtype=np.uint64) * 2 + 1
    keys, constant = [], []
    for start in range(0, flat.shape[0], _BLOCK):
        part = _values(flat[start:start + _BLOCK][:, columns.to(flat.device)], rounded).contiguous()
        words = part.numpy().view(np.uint64)
        with np.errstate(over="ignore"):
            mixed = words * multipliers
            mixed ^= mixed >> np.uint64(29)
            keys.append(mixed.sum(axis=1, dtype=np.uint64))
        constant.append((part == part[:, :1]).all(1).numpy())
    return np.concatenate(keys), np.concatenate(constant)


def _source_keys(source: Any, width: int, rounded: Optional[torch.dtype] = None) -> tuple[np.ndarray, np.ndarray]:
    """The source's keys that occur once (sorted) and, in that order, the row each is."""
    keys, _ = _keys(source, width, rounded)
    values, first, counts = np.unique(keys, return_index=True, return_counts=True)
    once = counts == 1
    return values[once], first[once]


def _match(array: Any, width: int, source: Any, keys: np.ndarray, rows: np.ndarray,
           rounded: Optional[torch.dtype], first_is_source: bool = False
           ) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(source rows, copy rows, blocks) of ``array``'s blocks that are source rows, sorted by source row, or
    ``None`` when fewer than :data:`MIN_SHARE` of its non-constant blocks are. ``first_is_source``: the source is
    ``array``'s first blocks, whose own blocks are not counted."""
    if keys.size == 0:
        return None
    found, constant = _keys(array, width)
    varied = ~constant
    per_row = _row_width(array) // width
    if first_is_source:
        varied &= np.arange(varied.size) % per_row != 0
    where = np.searchsorted(keys, found).clip(max=keys.size - 1)
    hit = varied & (keys[where] == found)
    blocks = np.flatnonzero(hit)
    if blocks.size == 0 or blocks.size < MIN_SHARE * max(int(varied.sum()), 1):
        return None
    source_rows = rows[where[blocks]]
    equal = _equal(array, source, width, blocks, source_rows, rounded)
    if equal.sum() < MIN_SHARE * max(int(varied.sum()), 1):
        return None
    blocks, source_rows = blocks[equal], source_rows[equal]  # keys alike, values not: not copies
    if first_is_source:  # a row's blocks repeating its own first block: exchanged with it
        other = blocks // per_row != source_rows
        blocks, source_rows = blocks[other], source_rows[other]
    order = np.argsort(source_rows, kind="stable")
    return source_rows[order], blocks[order] // per_row, blocks[order] % per_row


def _equal(array: Any, source: Any, width: int, blocks: np.ndarray, source_rows: np.ndarray,
           rounded: Optional[torch.dtype]) -> np.ndarray:
    """Whether each of ``array``'s ``blocks`` equals its source row, element by element (in their own type when it is
    one, else as float64); when they are more than :data:`VERIFIED` elements, a spread sample of them is compared
    and the others taken as their keys say."""
    copy_blocks, source_blocks = _blocks(array, width), _blocks(source, width)
    same_type = rounded is None and copy_blocks.dtype == source_blocks.dtype
    equal = np.ones(blocks.size, bool)
    picked = np.arange(blocks.size)
    if blocks.size * width > VERIFIED:
        picked = np.unique(np.linspace(0, blocks.size - 1, max(1, VERIFIED // width)).round().astype(np.int64))
    step = max(1, (1 << 20) // width)  # about a million elements compared at a time
    for start in range(0, picked.size, step):
        at = picked[start:start + step]
        copy = copy_blocks[torch.from_numpy(blocks[at]).to(copy_blocks.device)]
        original = source_blocks[torch.from_numpy(source_rows[at]).to(source_blocks.device)]
        if not same_type:
            copy, original = _values(copy), _values(original, rounded)
        equal[at] = (copy.cpu() == original.cpu()).all(1).numpy()
    return equal
