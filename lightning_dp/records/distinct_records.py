"""A declaration that records with identical contents are nevertheless different records.

The content check (:mod:`lightning_dp.record_checks.records`) refuses a training set in which
many records are exact copies of another: that is what oversampling and a ``__len__`` that repeats the
data look like, and a repeated record's privacy loss adds up over its copies. Some data repeat by
nature: two people with the same short message, the same answers to a categorical survey. Wrapping the
dataset in :class:`DistinctRecords` states that each position is its own person's record, whatever it
contains: the content check is skipped (what can be seen without reading the data still is: a Subset
index listed twice, a dataset concatenated with itself; :mod:`~lightning_dp.record_checks.record_sources`).
The claim is yours: the accounting is for one record per position.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset


class DistinctRecords(Dataset):
    """``dataset`` unchanged (same items, length and ``__getitems__``), declared to hold one record per position.

    Args:
        dataset: the map-style training dataset (or the one a ``Subset`` split takes).
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)  # the wrapped dataset's __getitems__ (if any) and attributes
