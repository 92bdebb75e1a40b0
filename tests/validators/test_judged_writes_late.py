"""A hook that writes nothing at its first call and starts writing later (validators/judged_writes.py, judged29):
its calls are still watched, and a write it starts making — at step 5, on the second epoch — is refused there, even
under a name the release boundary accepts for other reasons (a counter ``training_step`` keeps)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torch.set_num_threads(1)


def _statistic(trainer: pl.Trainer) -> torch.Tensor:
    return trainer.train_dataloader.dataset.tensors[0].mean(0)


class Counting(Classifier):
    """Keeps a step counter in a buffer and in a Python attribute (written by every step alike: accepted at every
    release)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.count += 1
        self.calls += 1
        return super().training_step(batch, batch_idx)


class OverwritesTheBuffer(pl.Callback):
    """Silent until step 5, then the counter buffer overwritten with a statistic of the training data."""

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step >= 5:
            pl_module.count.copy_(_statistic(trainer)[0])


class OverwritesTheNumber(pl.Callback):
    """Silent until the second epoch, then the Python counter set to a statistic of the training data."""

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.current_epoch >= 1:
            pl_module.calls = float(_statistic(trainer)[0])


class ClampsFromStepFive(pl.Callback):
    """Writes from its first call a function of the released weights (a clamp whose bound tightens at step 5)."""

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        bound = 0.05 if trainer.global_step >= 5 else 0.5
        with torch.no_grad():
            pl_module.net[2].bias.clamp_(min=-bound, max=bound)


class Silent(pl.Callback):
    """Never writes (a hook watched at every call at no more than a fingerprint's cost)."""

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.seen = getattr(self, "seen", 0)


def _fit(model: pl.LightningModule, callback: pl.Callback) -> pl.Trainer:
    trainer = quiet_trainer(strategy=strategy(), max_steps=10, callbacks=[callback], num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(data(64), batch_size=8))  # 8 steps an epoch: step 8 is the second epoch's first
    return trainer


@pytest.mark.parametrize("callback", [OverwritesTheBuffer, OverwritesTheNumber])
def test_a_write_from_the_data_that_starts_late_is_refused(callback: type) -> None:
    model = Counting()
    with pytest.raises(PrivacyConfigurationError, match="wrote nothing at its first call") as refusal:
        _fit(model, callback())
    assert ("count" if callback is OverwritesTheBuffer else "calls") in str(refusal.value)
    assert model.trainer.global_step == (5 if callback is OverwritesTheBuffer else 8)


def test_a_counter_the_step_keeps_and_a_silent_hook_train() -> None:
    model = Counting()
    assert _fit(model, Silent()).global_step == 10
    assert model.calls == 10 and float(model.count) == 10.0


def test_a_released_write_from_the_first_call_whose_bound_changes_later_trains() -> None:
    assert _fit(Classifier(), ClampsFromStepFive()).global_step == 10
