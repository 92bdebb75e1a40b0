"""Weights and priors of coarse classes of a K-class task (``y >= 2``, ``y == 3``, ``y // 2``, ``y % 2``) are
statistics of the training labels like the class counts' (record_statistics/coarse_labels.py, zoo39 L05)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_statistics.data_statistics import data_statistics_held  # noqa: E402


def graded(n: int = 256, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 6, (n,), generator=g))


def test_coarse_weights_and_priors_of_the_labels_are_found() -> None:
    dataset = graded()
    y = dataset.tensors[1]
    holder = nn.Module()
    holder.severe_weight = float((y < 2).sum() / (y >= 2).sum())  # BCE's pos_weight of y >= 2
    holder.register_buffer("coarse_prior", torch.bincount(y // 2).float().div(len(y)).log())
    found = data_statistics_held([("model", holder)], dataset)
    assert any("severe_weight equals the ratio of the class counts (0 to 1) of y >= 2" in f for f in found), found
    assert any("coarse_prior equals the log class frequencies of y // 2" in f for f in found), found
    holder = nn.Module()
    holder.alpha = float((y == 3).float().mean())  # a one-against-the-rest focal alpha, kept in float32
    holder.parity = float((y % 2 == 1).float().mean())
    found = data_statistics_held([("model", holder)], dataset)
    assert len(found) == 2 and "fraction of class 1 of y == 3" in found[0] and "y % 2" in found[1], found


def test_the_same_numbers_of_other_labels_or_round_ones_are_not_statistics() -> None:
    dataset, public = graded(), graded(seed=5).tensors[1]
    holder = nn.Module()
    holder.severe_weight = float((public < 2).sum() / (public >= 2).sum())
    holder.alpha = 0.25
    holder.register_buffer("coarse_prior", torch.bincount(public // 2).float().div(len(public)).log())
    assert data_statistics_held([("model", holder)], dataset) == []


class Graded(pl.LightningDataModule):
    """Loads its records in ``setup`` and keeps the weight of the severe grades (2–5) from those it loaded, or from
    a public table of the grades' prevalence."""

    def __init__(self, public: bool) -> None:
        super().__init__()
        self.public = public

    def setup(self, stage: str) -> None:
        self.train_set = graded(64)
        y = graded(64, seed=5).tensors[1] if self.public else self.train_set.tensors[1]
        self.severe_weight = float((y < 2).sum() / (y >= 2).sum())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=16)


class Severity(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net[2] = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        weight = torch.tensor(self.trainer.datamodule.severe_weight)
        return nn.functional.binary_cross_entropy_with_logits(self(x).squeeze(1), (y >= 2).float(), pos_weight=weight)


def test_a_datamodule_weight_of_the_severe_grades_is_refused_and_a_public_one_trains() -> None:
    with pytest.raises(PrivacyConfigurationError, match="severe_weight equals the ratio of the class counts"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(Severity(), datamodule=Graded(public=False))
    quiet_trainer(strategy=strategy(), max_steps=2).fit(Severity(), datamodule=Graded(public=True))
