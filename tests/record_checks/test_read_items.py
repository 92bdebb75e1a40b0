"""Records held in no tensor, array or list of numbers (record_checks/read_items.py; zoo33 L34): a list of dicts is
identified by its items as read, so a fresh model fitted on the same records in that form continues the earlier
fits' releases; other records in that form start a ledger of their own."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.accounting import forget_data_releases
from lightning_dp.record_checks import read_items as read_items_module
from lightning_dp.record_checks.read_items import read_items
from lightning_dp.record_checks.stored_sources import identifying_rows


class Records(Dataset):
    """The rows of a JSON file: one dict per record, Python floats and ints."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.rows = [{"features": x[i].tolist(), "label": int(y[i])} for i in range(len(x))]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        r = self.rows[i]
        return torch.tensor(r["features"]), torch.tensor(r["label"])


def _data(seed: int, n: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def _fit(dataset: Dataset) -> DPStrategy:
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=dp, max_steps=4).fit(TinyClassifier(), DataLoader(dataset, batch_size=16))
    return dp


def test_items_are_stacked_per_position():
    x, y = _data(0)
    found = dict(read_items(Records(x, y)))
    assert torch.equal(found["read items[0]"], x) and torch.equal(found["read items[1]"], y)
    dicts = [{"a": float(v), "b": np.float32(v) * 2} for v in x[:, 0]]
    found = dict(read_items(dicts))
    assert torch.allclose(found["read items['a']"].float(), x[:, 0])
    assert read_items([torch.zeros(2), torch.zeros(3)]) == []  # shapes differ: not stacked


def test_a_list_of_dicts_is_identified_like_the_tensors_it_came_from():
    x, y = _data(0)
    stored = identifying_rows(TensorDataset(x, y))
    read = identifying_rows(Records(x, y))
    assert stored and read and all(np.array_equal(read[kind], stored[kind]) for kind in read)


def test_a_fresh_model_on_the_same_records_as_dicts_continues_the_earlier_fit():
    x, y = _data(1)
    forget_data_releases()
    first = _fit(TensorDataset(x, y))
    second = _fit(Records(x, y))
    assert second.ledger.steps == first.ledger.steps + 4  # the first fit's releases on these records are counted
    forget_data_releases()


def test_other_records_as_dicts_start_a_ledger_of_their_own():
    forget_data_releases()
    _fit(TensorDataset(*_data(2)))
    assert _fit(Records(*_data(3))).ledger.steps == 4
    forget_data_releases()


def test_a_dataset_larger_than_the_limit_is_not_read(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(read_items_module, "READ_LIMIT", 50)
    assert read_items(Records(*_data(0))) == []
