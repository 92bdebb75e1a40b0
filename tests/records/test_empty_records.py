"""Empty records (records/empty_records.py): None for an unreadable file, which the collate drops, holds no data; the
first step's probe takes examples that hold data."""

from __future__ import annotations

import numpy as np
import torch

from lightning_dp.records.empty_records import holding_data, is_empty


def test_none_and_containers_of_nothing_are_empty_and_data_is_not():
    assert all(is_empty(r) for r in (None, (None, None), [], {}, {"x": None}, torch.zeros(0, 3), np.zeros(0)))
    assert not any(is_empty(r) for r in ("", 0, (None, 1), torch.zeros(1), {"x": None, "y": 0}, b"", np.zeros(1)))


class _Every(torch.utils.data.Dataset):
    def __init__(self, every: int) -> None:
        self.every = every

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i):
        return None if i % self.every == 0 else (torch.full((2,), float(i)), i)


def test_the_probe_takes_the_first_records_that_hold_data():
    candidates = list(range(24))
    assert holding_data(_Every(3), candidates, 6) == [1, 2, 4, 5, 7, 8]
    assert holding_data(_Every(1000), candidates, 6) == [1, 2, 3, 4, 5, 6]
    assert holding_data(_Every(1), candidates, 6) == [0, 1, 2, 3, 4, 5]  # nothing holds data: as they were
    full = torch.utils.data.TensorDataset(torch.randn(40, 2))
    assert holding_data(full, candidates, 6) == [0, 1, 2, 3, 4, 5]
