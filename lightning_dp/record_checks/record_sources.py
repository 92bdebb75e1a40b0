"""The base record each training position reads, from torch's dataset wrappers alone (nothing is read).

``Subset(dataset, indices)`` reads ``dataset[indices[i]]`` at position i (a negative index counts from the
end, as Python's indexing does); ``ConcatDataset(parts)`` reads position i from the part whose range of
cumulative sizes holds it. Mapping every position of the population down through these wrappers gives
its *source*: (the base dataset object, the index there). Two positions with one source are one record
read twice: a repeated Subset index (``-1`` and ``n − 1`` included), a dataset listed twice in a
ConcatDataset (oversampling), overlapping Subsets of one dataset. Poisson sampling gives each position its
own chance per step, so that record's privacy loss would add up over its copies: refused.

:class:`~lightning_dp.data.DistinctRecords` is looked through, and so is a dataset of the user's that is a view
of one other dataset of its length (:func:`view_of`: an augmented copy, so ``ConcatDataset([base, Flipped(base)])``
reads every record twice); any other dataset is a base, whatever its ``__getitem__`` does (what it reads is the
content check's to see: :mod:`.records`). Two bases that store the same records — the same tensors, arrays or lists,
under two augmenting classes — are one base (:mod:`.stored_sources`, zoo17 r2). Cost: a few NumPy operations per
position, no data read (and one pass over the stored bytes of each base when there are several).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
from torch.utils.data import ConcatDataset, Dataset, Subset

from lightning_dp.records.library_code import library_rooted
from lightning_dp.records.distinct_records import DistinctRecords
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_checks.stored_sources import same_records

_INDEX_BITS = 40
"""A source key is ``base number << 40 | index``: bases of up to 2⁴⁰ records."""

REPEAT_FIX = ("Pass each record once: oversampling (a record listed twice, a dataset concatenated with itself or with "
              "an augmented copy of itself) is not compatible with DP accounting, whose unit is one record; to weight "
              "records, weight their losses; for several augmented views of each record, use "
              "DPStrategy(augmentation_multiplicity=K) or lightning_dp.data.AugmentedViews.")


def check_sources(dataset: Any, indices: Optional[Sequence[int]]) -> None:
    """Refuse a population (``indices`` of ``dataset``; ``None``: all) in which two positions read one base record.

    Raises:
        PrivacyConfigurationError: naming two such positions and the fix.
    """
    if not isinstance(dataset, (Subset, ConcatDataset, DistinctRecords)):
        return  # a base or a view of one (:func:`view_of`): its positions are its records
    positions = np.arange(len(dataset), dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
    bases: dict[int, tuple[int, Any]] = {}
    keys = _sources(dataset, positions, bases)
    if len(bases) > 1:  # bases storing the same records are one (:mod:`.stored_sources`)
        keys = _one_base_per_records(keys, bases)
    order = np.argsort(keys, kind="stable")
    same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if len(same):
        first, second = sorted((int(positions[order[same[0]]]), int(positions[order[same[0] + 1]])))
        base = _base_named(bases, int(keys[order[same[0]]]) >> _INDEX_BITS)
        index = int(keys[order[same[0]]]) & ((1 << _INDEX_BITS) - 1)
        raise PrivacyConfigurationError(
            f"The training dataset reads one record more than once: positions {first} and {second} both read record "
            f"{index} of the same {type(base).__name__} ({len(same)} repeated reading(s) in all; datasets that store "
            "the same rows are one dataset here, whatever their classes), through a Subset "
            "index listed twice or a dataset reached twice in a ConcatDataset (or overlapping Subsets of it, or a view "
            "of it such as an augmented copy beside it). Poisson "
            "sampling gives every position its own chance per step, so that record's privacy loss would add up over "
            "its copies. " + REPEAT_FIX)


def _sources(dataset: Any, positions: np.ndarray, bases: dict[int, tuple[int, Any]]) -> np.ndarray:
    """The source key of each of ``positions`` of ``dataset`` (registering its base datasets in ``bases``)."""
    if isinstance(dataset, DistinctRecords):
        return _sources(dataset.dataset, positions, bases)
    if isinstance(dataset, Subset):
        return _sources(dataset.dataset, _through_subset(dataset, positions), bases)
    if isinstance(dataset, ConcatDataset):
        return _concat_sources(dataset, positions, bases)
    inner = view_of(dataset)
    if inner is not None:
        return _sources(inner, positions, bases)
    number = bases.setdefault(id(dataset), (len(bases), dataset))[0]
    return (np.int64(number) << _INDEX_BITS) | positions


def view_of(dataset: Any) -> Optional[Any]:
    """The dataset ``dataset`` is a view of, if it is one: a dataset class of the user's (not torch's) whose
    attributes hold exactly one other dataset, of the same length (``Flipped(base)`` returning ``base[i]`` flipped).
    Position i is taken to read that dataset's record i: whatever its order, a view reads each of the other's
    records once, so beside it in a ConcatDataset (the data "doubled by augmentation") every record is read twice."""
    if library_rooted(type(dataset), ("torch",)) or not hasattr(dataset, "__dict__"):
        return None
    held = [v for v in vars(dataset).values() if isinstance(v, Dataset) and v is not dataset]
    if len(held) != 1:
        return None
    try:
        return held[0] if len(held[0]) == len(dataset) else None
    except TypeError:  # no len: an iterable dataset
        return None


def _through_subset(subset: Subset, positions: np.ndarray) -> np.ndarray:
    """The indices of the dataset a Subset wraps that its ``positions`` read (a negative index counted from the end)."""
    size = len(subset.dataset)  # type: ignore[arg-type]
    read = np.asarray(subset.indices, dtype=np.int64).reshape(-1)[positions]
    if len(read) and (read.min() < -size or read.max() >= size):
        raise PrivacyConfigurationError(f"A Subset of the training dataset lists indices outside the {size} records "
                                        "of the dataset it wraps: list indices 0 … len(dataset) − 1.")
    return np.where(read < 0, read + size, read)


def _concat_sources(dataset: ConcatDataset, positions: np.ndarray, bases: dict[int, tuple[int, Any]]) -> np.ndarray:
    ends = np.asarray(dataset.cumulative_sizes, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    part = np.searchsorted(ends, positions, side="right")
    keys = np.empty(len(positions), dtype=np.int64)
    for k in np.unique(part):
        chosen = part == k
        keys[chosen] = _sources(dataset.datasets[int(k)], positions[chosen] - starts[k], bases)
    return keys


def _one_base_per_records(keys: np.ndarray, bases: dict[int, tuple[int, Any]]) -> np.ndarray:
    """``keys`` with each record that several bases store named as the first base's
    (:func:`~lightning_dp.record_checks.stored_sources.same_records`)."""
    listed = sorted(bases.values(), key=lambda entry: entry[0])
    numbers = np.asarray([number for number, _ in listed], dtype=np.int64)
    out = keys.copy()
    mask = (1 << _INDEX_BITS) - 1
    for (number, _), (owner, index) in zip(listed, same_records([dataset for _, dataset in listed])):
        mine = (keys >> _INDEX_BITS) == number
        if not len(owner) or not mine.any():
            continue
        at = keys[mine] & mask
        out[mine] = (numbers[owner[at]] << _INDEX_BITS) | index[at]
    return out


def _base_named(bases: dict[int, tuple[int, Any]], number: int) -> Any:
    return next(dataset for n, dataset in bases.values() if n == number)
