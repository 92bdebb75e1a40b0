"""Interactions the data switch on (validators/step_checks.py, records/constructed_batches.py): a rare class whose rows
share a loss budget, a batch standardised only when it is large, a batch of two treated apart. The first step's batch
need not hold them; the first check also compares batches built from the training records (every label, the largest
batch the sampler plausibly draws, two records), so they are refused before any release. Fixed class weights and
independent examples train."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch.utils.data import DataLoader, Subset, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[1] / "privacy" / "boundary"))
from cases import Classifier, parameters, unchanged  # noqa: E402

from lightning_dp import DPStrategy, PrivacyConfigurationError  # noqa: E402


def run(model, dataset, steps=2, **kwargs):
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, **kwargs)
    quiet_trainer(strategy=strategy, max_steps=steps).fit(model, DataLoader(dataset, batch_size=32))
    return strategy


def rare_data(n=256, rare=(17, 101, 230)):
    """Two common classes and three records of a rare third one (none among the first step's examples)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    y[list(rare)] = 2
    return TensorDataset(x, y)


class ThreeClasses(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net[2] = torch.nn.Linear(8, 3)


class RareShare(ThreeClasses):
    """Long-tail recipe: the rare class's rows in a batch share a fixed loss budget (1 / their count)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        rare = y == 2
        if rare.any():
            losses = torch.where(rare, losses * 4.0 / rare.sum(), losses)
        return losses.mean()


class FixedClassWeights(ThreeClasses):
    """Class weights fixed in advance, each example's loss weighted by its own label's: served."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        weights = torch.tensor([1.0, 1.0, 4.0])
        return (F.cross_entropy(self(x), y, reduction="none") * weights[y]).mean()


class LargeBatchStatistics(Classifier):
    """Standardises its batch by the batch's statistics, only for batches of 44 or more (B = 32: rarely drawn)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if len(x) >= 44:
            x = (x - x.mean(0)) / (x.std(0) + 1e-3)
        return F.cross_entropy(self(x), y)


def two_classes(n=256):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


@pytest.mark.parametrize("factory,dataset,match", [
    (RareShare, rare_data, "holding every label value"),
    (RareShare, lambda: Subset(rare_data(300), list(range(280))), "holding every label value"),
    (LargeBatchStatistics, two_classes, r"of 55 records, the largest batch"),
])
def test_behaviour_the_data_switch_on_is_refused_at_the_first_step(factory, dataset, match):
    model = factory()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=rf"Examples interact at step 0 \(not the sampled batch: .*{match}"):
        run(model, dataset())
    assert unchanged(before, model), "a release happened"


@pytest.mark.parametrize("factory,dataset", [(FixedClassWeights, rare_data), (Classifier, two_classes)])
def test_fixed_class_weights_and_independent_examples_train(factory, dataset):
    assert run(factory(), dataset(), steps=3).ledger.steps == 3
