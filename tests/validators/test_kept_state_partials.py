"""A ``functools.partial`` the user keeps is the user's state, whatever function it wraps (validators/kept_state.py,
``binds``): a class-weighted or label-smoothed cross-entropy written as ``partial(F.cross_entropy, weight=w)``, its
weights adapted from the batch's label counts at batch end (in place or rebound), steers later releases by un-noised
data and is refused; a partial of public values, or rebound from the step count, trains."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class PartialLoss(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = functools.partial(F.cross_entropy, weight=torch.ones(2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self(x), y)


def _balanced(y: torch.Tensor) -> torch.Tensor:
    counts = torch.bincount(y, minlength=2).float() + 1
    return counts.sum() / (2 * counts)


class WeightsEmaInPlace(PartialLoss):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loss_fn.keywords["weight"].mul_(0.5).add_(0.5 * _balanced(batch[1]))


class WeightsRebound(PartialLoss):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loss_fn = functools.partial(F.cross_entropy, weight=_balanced(batch[1]))


class SmoothingFromAccuracy(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = functools.partial(F.cross_entropy, label_smoothing=0.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        x, y = batch
        with torch.no_grad():
            accuracy = float((self(x).argmax(1) == y).float().mean())
        self.loss_fn = functools.partial(F.cross_entropy, label_smoothing=0.2 * accuracy)


@pytest.mark.parametrize("model", [WeightsEmaInPlace, WeightsRebound, SmoothingFromAccuracy])
def test_a_partial_adapted_from_the_batch_is_refused(model):
    with pytest.raises(PrivacyConfigurationError, match="loss_fn"):
        fit(model(), steps=8)


class SmoothingByStep(SmoothingFromAccuracy):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loss_fn = functools.partial(F.cross_entropy, label_smoothing=min(0.1, 0.01 * self.global_step))


@pytest.mark.parametrize("model", [PartialLoss, SmoothingByStep])
def test_a_partial_of_public_values_trains(model):
    assert fit(model(), steps=6).ledger.steps == 6
