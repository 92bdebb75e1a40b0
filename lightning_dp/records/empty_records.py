"""Empty records: what a dataset returns for a record it cannot read, for the loader's collate to drop.

The Kaggle recipe for corrupt files: ``__getitem__`` returns ``None`` for an unreadable record and the ``collate_fn``
filters the ``None`` out of the batch (zoo28 d02). Such a record holds no data: it adds nothing to any step's
gradient, however often it is sampled, and all of them are alike. So the record checks do not count them
(:mod:`lightning_dp.record_checks`): ``None`` records are not copies of one another (:mod:`.repeated_records`
compares the records that hold data), a probe of fixed records looks past them (a dataset is not taken to ignore
its index because the records probed were all ``None``), the first step's probe takes examples that hold data
(:func:`holding_data`), and a batch of only empty records is an empty batch
(:class:`~lightning_dp.records.collate.EmptySafeCollate`, its template the first record that holds data).

What the accountant assumes: nothing changes. The population is the dataset's ``len`` (empty records included); each
index is still drawn at rate q; a step whose batch lost its empty records is a smaller batch of the same Poisson
draw, and the release divides by the expected batch size as always, so one record still moves it by at most C / B:
the sensitivity is unchanged and ε is what the ledger says (for the readable records it is conservative: they are
fewer than N). A record that is empty because of its own content (``None`` for a label the recipe skips) is a
function of that record alone, like its gradient.

Empty: ``None``, a tensor or array of no elements, or a tuple, list or dict holding only empty values (``(None,
None)``, ``{}``). An empty string is data (an empty message), not an empty record.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from lightning_dp.records.fetch import fetch, seeded

__all__ = ["holding_data", "is_empty"]


def is_empty(record: Any, depth: int = 4) -> bool:
    """Whether ``record`` holds no data (the module docstring): ``None``, a tensor or array without elements, or a
    container, ``depth`` levels down, of only such values."""
    if record is None:
        return True
    if isinstance(record, torch.Tensor):
        return record.numel() == 0
    if isinstance(record, np.ndarray):
        return record.size == 0
    if depth > 0 and isinstance(record, (tuple, list)):
        return all(is_empty(item, depth - 1) for item in record)
    if depth > 0 and isinstance(record, dict):
        return all(is_empty(item, depth - 1) for item in record.values())
    return False


def holding_data(dataset: Any, candidates: Sequence[int], k: int) -> list[int]:
    """The first ``k`` of ``candidates`` (dataset indices, in order) whose records hold data, read as the loader reads
    them (the first ``k`` in one batch; further ones one by one only when some of those were empty); all of the first
    ``k`` when fewer than two hold data (the checks then say what fails)."""
    first = list(candidates[:k])
    with seeded(0):
        items = fetch(dataset, first)
        if not isinstance(items, (list, tuple)) or len(items) != len(first):
            return first  # a batch-level read: its records are not told apart
        found = [i for i, record in zip(first, items) if not is_empty(record)]
        for index in candidates[k:]:
            if len(found) >= k:
                break
            if not is_empty(fetch(dataset, [index])[0]):
                found.append(index)
    return found if len(found) >= 2 else first
