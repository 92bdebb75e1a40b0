"""A module's train/eval mode is kept state (rule 3 of docs/release_boundary.md; validators/kept_state.training_modes):
a dropout switched off once the batch loss is low — in training_step or a callback's on_train_batch_end — makes the
returned model differ between neighbouring datasets and is refused; a mode set alike on all data (a frozen BatchNorm
put in eval mode in __init__ and at every epoch's start, a dropout switched off at every step) trains, and so does
Lightning's own toggling around validation (the sanity check, validation inside the fit, val_check_interval,
trainer.validate/test/predict after it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torch.set_num_threads(1)


class DropNet(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 2))


class DropoutOffOnceFitted(DropNet):
    """'Stop regularising once the model fits': the dropout's mode decided from the batch loss, in training_step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if loss.item() < 0.45:  # crossed at step 6, not by the first step's replays
            self.net[2].eval()
        return loss


def test_a_dropout_switched_off_from_the_batch_loss_in_training_step_is_refused() -> None:
    module = DropoutOffOnceFitted()
    with pytest.raises(PrivacyConfigurationError, match=r"mode net\.2"):
        quiet_trainer(strategy=strategy(), max_steps=12).fit(module, loader(64))


class DropoutOffAtBatchEnd(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if float(outputs["loss"]) < 10.0:
            pl_module.net[2].eval()


def test_a_dropout_switched_off_from_the_batch_loss_by_a_callback_is_refused() -> None:
    module = DropNet()
    with pytest.raises(PrivacyConfigurationError, match=r"mode net\.2"):
        quiet_trainer(strategy=strategy(), max_steps=6, callbacks=[DropoutOffAtBatchEnd()]).fit(module, loader(64))


class FrozenNorm(pl.LightningModule):
    """A pretrained BatchNorm frozen (eval mode, no gradient) in __init__ and again at every epoch's start, a dropout
    that trains; validated during the fit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 2))
        self.net[1].requires_grad_(False)
        self.net[1].eval()
        self.modes_in_step: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_epoch_start(self) -> None:
        self.net[1].eval()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.modes_in_step = [(self.net[1].training, self.net[3].training)]
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


def test_a_frozen_batchnorm_and_lightnings_validation_toggling_train() -> None:
    module = FrozenNorm()
    held_out = DataLoader(data(32, seed=7), batch_size=16)
    trainer = quiet_trainer(strategy=strategy(public_state=["modes_in_step"]), max_epochs=2, val_check_interval=0.5)
    trainer.fit(module, loader(64), held_out)
    assert module.modes_in_step == [(False, True)]  # the BatchNorm frozen, the dropout on, after the validations
    trainer.validate(module, held_out, verbose=False)
    trainer.test(module, held_out, verbose=False)
    trainer.predict(module, held_out)
    assert not module.net[1].training and module.net[3].training


class FrozenAtTrainStart(FrozenNorm):
    def on_train_epoch_start(self) -> None:
        pass

    def on_train_start(self) -> None:
        self.net[1].train()  # Lightning before 2.2 put every module in training mode: frozen again, from a constant
        self.net[1].eval()


def test_a_batchnorm_put_in_eval_mode_in_on_train_start_trains() -> None:
    module = FrozenAtTrainStart()
    held_out = DataLoader(data(32, seed=7), batch_size=16)
    quiet_trainer(strategy=strategy(public_state=["modes_in_step"]), max_steps=6).fit(module, loader(64), held_out)
    assert module.modes_in_step == [(False, True)]


class DropoutOffEveryStep(DropNet):
    """The dropout switched off at every step, whatever the batch: alike on all data."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.net[2].eval()
        return super().training_step(batch, batch_idx)


def test_a_mode_set_alike_at_every_step_trains() -> None:
    module = DropoutOffEveryStep()
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=6).fit(module, loader(64))
    assert dp.private_step.ledger.steps == 6
