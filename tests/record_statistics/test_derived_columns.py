"""Per-record columns derived from the training labels' statistics (record_statistics/derived_columns.py, rule 11): a
"balanced" sample-weight column and a target-encoded feature are refused before any release; public weights,
category ids and rounded features are not statistics."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_statistics.data_statistics import data_statistics_held  # noqa: E402

X, Y = data(64).tensors
COUNTS = torch.bincount(Y).float()


class Weighted(Classifier):
    """The loss weighted by the third item of each record."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, w = batch
        return (nn.functional.cross_entropy(self(x), y, reduction="none") * w.float()).mean()


def _fit(model: Classifier, dataset: Any) -> Any:
    torch.set_num_threads(1)
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2).fit(model, DataLoader(dataset, batch_size=16))
    return dp


@pytest.mark.parametrize("weights, what", [
    (lambda: len(Y) / (2 * COUNTS[Y]), "balanced class weight"),  # sklearn compute_sample_weight("balanced", y)
    (lambda: 1 / COUNTS[Y], "inverse class count"),
    (lambda: (1 / COUNTS[Y]) / (1 / COUNTS[Y]).sum(), "normalised to sum 1 over the records"),
    (lambda: (1 / COUNTS[Y]) / (1 / COUNTS[Y]).mean(), "balanced class weight"),  # N / (K count) averages 1
])
def test_a_sample_weight_column_from_the_label_counts_is_refused_before_any_release(weights, what):
    model = Weighted()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)without noise before training.*tensors\[2\] is the "
                                                        rf".*({what}).*weight classes by a public prior"):
        _fit(model, TensorDataset(X, Y, weights()))
    assert unchanged(before, model)


def _target_encoded(m: float = 0.0, classes: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features with a category's mean label (smoothed toward the global mean with strength m) as their last column."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g)
    cat = torch.randint(0, 6, (64,), generator=g)
    y = ((x[:, 0] + 0.3 * cat) > 0.8).long() if classes == 2 else ((x[:, 0] + 0.3 * cat) * 2).clamp(0, 2).long()
    target = y.float() if classes == 2 else (y == 1).float()
    n = torch.bincount(cat, minlength=6).float()
    means = torch.stack([target[cat == c].mean() for c in range(6)])
    encoded = (n * means + m * target.mean()) / (n + m)
    return torch.cat([x, encoded[cat][:, None]], 1), y, cat


@pytest.mark.parametrize("m, classes", [(0.0, 2), (10.0, 2), (0.0, 3)], ids=["exact", "smoothed", "one-vs-rest"])
def test_a_target_encoded_column_is_refused_before_any_release(m, classes):
    x, y, _ = _target_encoded(m, classes)
    model = Classifier()
    model.net[2] = nn.Linear(8, classes)
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)column 3 of tensors\[0\] is the mean label.*target "
                                                        r"encoding of a category.*encode categories by public values"):
        _fit(model, TensorDataset(x, y))
    assert unchanged(before, model)


class _Table(Dataset):
    """A tabular dataset holding NumPy arrays: features, a category id, labels and a weight column."""

    def __init__(self, x: np.ndarray, cat: np.ndarray, y: np.ndarray, w: np.ndarray) -> None:
        self.x, self.cat, self.y, self.w = x, cat, y, w

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Any:
        return torch.from_numpy(self.x[i]).float(), int(self.y[i])


def test_columns_of_a_datasets_numpy_arrays_are_read():
    x, y, cat = _target_encoded()
    table = _Table(x.numpy(), cat.numpy(), y.numpy(), (len(y) / (2 * torch.bincount(y).float()[y])).numpy())
    found = data_statistics_held([], table)
    assert any(f.startswith("column 3 of dataset _Table.x is the mean label") for f in found), found
    assert any(f.startswith("dataset _Table.w is the balanced class weight") for f in found), found


def test_public_weights_category_ids_and_rounded_features_train():
    g = torch.Generator().manual_seed(1)
    x, y, cat = _target_encoded()
    public = torch.tensor([1.0, 2.0])[y]  # a public prior per class
    random = torch.rand(64, generator=g)  # weights from a public source
    rounded = torch.cat([x[:, :3], (x[:, :1] * 4).round() / 8, cat[:, None].float()], 1)  # few values, no encoding
    shares = (cat.float() + 1) / 8  # a public value per category, in [0, 1]
    assert data_statistics_held([], TensorDataset(rounded, cat, y, public, random, shares)) == []
    votes = torch.cat([torch.zeros(24), torch.ones(24), torch.full((16,), 0.5)])  # two annotators' vote fraction
    majority = torch.cat([torch.zeros(24), torch.ones(24), torch.arange(16) % 2]).long()  # ties split evenly
    assert data_statistics_held([], TensorDataset(torch.cat([X[:, :3], votes[:, None]], 1), majority)) == []
    assert _fit(Weighted(), TensorDataset(X, Y, torch.ones(64))).ledger.steps == 2  # equal weights
    other, labels = data(64, seed=1).tensors  # other records: its own ledger
    assert _fit(Weighted(), TensorDataset(other, labels, public)).ledger.steps == 2
    balanced = torch.cat([torch.zeros(32), torch.ones(32)]).long()  # equally frequent classes: weights are all 1
    assert data_statistics_held([], TensorDataset(X, balanced, len(balanced) / (2 * torch.bincount(balanced)[balanced]
                                                                                 .float()))) == []
