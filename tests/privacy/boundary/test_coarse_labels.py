"""A statistic of coarse classes of the training labels (``y // 2``, ``y >> 1``) kept by a hook the replays judge:
the old public exchange (bit 0 flipped) left it alike, so it passed (zoo39 L01, L04); the labels are now exchanged
within their values by a secret shift (record_checks/label_exchange.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cases import Classifier
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError


def four_classes(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 4, (64,), generator=g))


PUBLIC = four_classes(7)  # held-out labels: a prior of theirs is public


class CoarsePrior(Classifier):
    """A logit bias from the training set's coarse-class frequencies (classes 0–1 against 2–3), set at each epoch's
    end; ``source``: where the labels come from."""

    def __init__(self, source: str = "train") -> None:
        super().__init__()
        self.net[2] = nn.Linear(8, 4)
        self.source = source
        self.register_buffer("coarse_prior", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.coarse_prior.repeat_interleave(2)

    def labels(self) -> torch.Tensor:
        return self.trainer.train_dataloader.dataset.tensors[1] if self.source == "train" else PUBLIC.tensors[1]

    def on_train_epoch_end(self) -> None:
        y = self.labels()
        self.coarse_prior.copy_(torch.bincount(y // 2, minlength=2).float().div(len(y)).log())


class SevereWeight(Classifier):
    """A loss weight of the coarse classes 2–3 set from the training labels' ``y >> 1`` as training starts."""

    def __init__(self) -> None:
        super().__init__()
        self.net[2] = nn.Linear(8, 4)
        self.severe = 1.0

    def on_train_start(self) -> None:
        self.severe = float(1.0 / (self.trainer.train_dataloader.dataset.tensors[1] >> 1).float().mean())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        weight = torch.tensor([1.0, 1.0, self.severe, self.severe])[y]
        return (nn.functional.cross_entropy(self(x), y, reduction="none") * weight).mean()


def fit(model: Classifier, **trainer_kwargs: Any) -> None:
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    quiet_trainer(strategy=dp, **trainer_kwargs).fit(model, DataLoader(four_classes(0), batch_size=16))


@pytest.mark.parametrize("model, kwargs", [(CoarsePrior, dict(max_epochs=2)), (SevereWeight, dict(max_steps=3))],
                         ids=["epoch-end prior of y // 2", "on_train_start weight of y >> 1"])
def test_a_coarse_class_statistic_of_the_training_labels_is_refused(model: type, kwargs: dict) -> None:
    module = model()
    with pytest.raises(PrivacyConfigurationError, match="Kept state written"):
        fit(module, **kwargs)


def test_the_same_prior_of_held_out_labels_trains() -> None:
    module = CoarsePrior(source="public")
    fit(module, max_epochs=2)
    assert torch.isfinite(module.coarse_prior).all() and bool((module.coarse_prior != 0).all())
