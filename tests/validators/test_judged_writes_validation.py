"""What validation's end writes during a fit (validators/judged_writes.py, judged29): ``on_validation_end`` is
judged as the other hooks outside the step — a statistic of the training set kept there, read from the dataset's
tensors (no record read is seen), is refused; weights swapped back from a backup and the best held-out loss kept from
validation's outputs train. (When validation reads the training records, what it keeps after that read is refused
by the comparison at validation's end: tests/privacy.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError
from lightning_dp.privacy.noise import GaussianNoise  # noqa: E402

torch.set_num_threads(1)


class Validated(Classifier):
    def on_validation_epoch_start(self) -> None:
        self.val_losses: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.val_losses.append(loss)
        self.log("val_loss", loss)


class KeepsTrainingMeans(pl.Callback):
    """Keeps the training features' means, read from the dataset's tensors (no record read is seen)."""

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.means = trainer.train_dataloader.dataset.tensors[0].mean(0).clone()


class KeepsTheBest(pl.Callback):
    """Keeps the best held-out loss, from the outputs validation kept on the module."""

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now = torch.stack(pl_module.val_losses).mean()
        self.best = now if not hasattr(self, "best") else torch.minimum(self.best, now)


class SwapsBack(pl.Callback):
    """Weights shrunk for validation at its start and put back from the backup at its end."""

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.backup = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(0.5)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.load_state_dict(self.backup)
        self.validations = getattr(self, "validations", 0) + 1


def _fit(callback: pl.Callback) -> pl.Trainer:
    # (the noise seeded: with OS-seeded noise a held-out loss kept on the module came within the 1e-4 tolerance of
    # a training class fraction about once in 50 runs, and the fit's end refused it as a written statistic)
    trainer = quiet_trainer(strategy=strategy(noise=GaussianNoise(seed=0)), max_steps=4, callbacks=[callback],
                            num_sanity_val_steps=0,
                            val_check_interval=2)
    trainer.fit(Validated(), DataLoader(data(64), batch_size=16), DataLoader(data(32, seed=1), batch_size=16))
    return trainer


def test_a_statistic_of_the_training_set_kept_at_validations_end_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match="on_validation_end"):
        _fit(KeepsTrainingMeans())


def test_weights_swapped_back_and_the_best_held_out_loss_kept_at_validations_end_train() -> None:
    swaps, best = SwapsBack(), KeepsTheBest()
    assert _fit(swaps).global_step == 4 and swaps.validations == 2
    assert _fit(best).global_step == 4 and best.best.ndim == 0
