"""validators/rng.py: the checks leave every generator as they found it; the user's code seeding a global generator
from the data — the batch, its loss, the training set at epoch end — is refused on the first step's replays before
any release, and seeding from the step count or a constant is not."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit, parameters, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.rng import forked_rngs, seeds_recorded  # noqa: E402


def test_forked_generators_come_back_as_they_were() -> None:
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    expected = (torch.rand(2), np.random.rand(2), random.random())
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    with forked_rngs():
        torch.manual_seed(99)
        torch.rand(5), np.random.rand(5), random.random()
    got = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_the_users_seeds_are_recorded_and_the_functions_put_back() -> None:
    originals = (torch.manual_seed, np.random.seed, random.seed, random.setstate)
    with seeds_recorded() as calls:
        torch.manual_seed(7)
        np.random.seed(8)
        random.seed("x")
        pl.seed_everything(5, verbose=False)  # a library function the user called: recorded through it
    names = [name for name, _ in calls]
    assert names[:3] == ["manual_seed", "seed", "seed"] and len(names) > 3
    assert (torch.manual_seed, np.random.seed, random.seed, random.setstate) == originals
    with seeds_recorded() as again:
        torch.manual_seed(7)
    with seeds_recorded() as other:
        torch.manual_seed(8)
    assert again == calls[:1] and other != again


class Dropout(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 2))


class SeedsFromTheBatch(Dropout):
    """Seeds torch's generator from the batch at the end of training_step: the next step's dropout masks carry it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        torch.manual_seed(int(batch[0].abs().sum() * 1000))
        return loss


class SeedsFromTheLoss(Classifier):
    """Seeds Python's generator from the loss at batch end (a dataset's augmentation draws from it)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        random.seed(float(outputs["loss"]))


class SeedsFromTheTrainingSet(Classifier):
    """Seeds NumPy's generator from a sum over the training set at epoch end, from the second epoch."""

    def on_train_epoch_end(self) -> None:
        if self.current_epoch >= 1:
            xs = self.trainer.train_dataloader.dataset.tensors[0]
            np.random.seed(int(xs.abs().sum() * 100) % 2**31)


@pytest.mark.parametrize("model", [SeedsFromTheBatch, SeedsFromTheLoss, SeedsFromTheTrainingSet])
def test_a_generator_seeded_from_the_data_is_refused_before_any_release(model: type) -> None:
    m = model()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match="global random generator .* seeded with different values"):
        fit(m, steps=12)
    assert unchanged(before, m)


class SeedsFromTheStep(Dropout):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        torch.manual_seed(1000 + self.global_step)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_start(self) -> None:
        pl.seed_everything(self.current_epoch, verbose=False)


def test_seeding_from_the_step_count_trains() -> None:
    dp = fit(SeedsFromTheStep(), steps=6)
    assert dp.ledger.steps == 6
