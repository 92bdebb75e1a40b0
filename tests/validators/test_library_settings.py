"""The settings of Lightning's callbacks and the trainer's validation and checkpoint schedule are decisions (rule 3 of
docs/release_boundary.md; validators/steered_settings.library_settings): an EarlyStopping patience or stopping threshold, a
Timer duration, a ModelCheckpoint or validation schedule set by the user's hooks from the training batch loss decide
how many releases (or validations, or checkpoints) there are, and are refused; the callbacks used as Lightning runs
them (EarlyStopping on a held-out value, ModelCheckpoint, Timer, LearningRateMonitor, val_check_interval), and a
setting a user's hook writes from a constant, train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint, Timer
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torch.set_num_threads(1)


class Validated(Classifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


def held_out() -> DataLoader:
    return DataLoader(data(32, seed=7), batch_size=16)


class PatienceFromTheLoss(pl.Callback):
    """'Be patient while the training loss is still high.'"""

    def __init__(self, stopper: EarlyStopping) -> None:
        self.stopper = stopper

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.stopper.patience = 0 if float(outputs["loss"]) < 10.0 else 100


def test_an_early_stopping_patience_set_from_the_batch_loss_is_refused_and_put_back() -> None:
    stopper = EarlyStopping("val_loss", patience=100)
    with pytest.raises(PrivacyConfigurationError, match=r"EarlyStopping\.patience"):
        quiet_trainer(strategy=strategy(), max_steps=12, callbacks=[stopper, PatienceFromTheLoss(stopper)]).fit(
            Validated(), loader(64), held_out())
    assert stopper.patience == 100  # the replays put it back


class ThresholdWhileHigh(pl.Callback):
    """Stop at the next validation while the training loss is above a floor (after a warm-up of 3 steps): the first
    step's replays, at the plan's last step, all set it; the batch's window, with the loss near zero, does not."""

    def __init__(self, stopper: EarlyStopping) -> None:
        self.stopper = stopper

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step >= 3 and float(outputs["loss"]) > 0.01:
            self.stopper.stopping_threshold = 1e9


def test_a_stopping_threshold_set_once_the_batch_loss_is_above_a_floor_is_refused() -> None:
    stopper = EarlyStopping("val_loss", patience=100)
    # refused when made at step 3, or before any release by the first step's replays as the plan's last step runs
    with pytest.raises(PrivacyConfigurationError, match=r"(at the end of step 3|replayed on the probe's examples).*"
                                                        r"EarlyStopping\.stopping_threshold"):
        quiet_trainer(strategy=strategy(), max_steps=12, callbacks=[stopper, ThresholdWhileHigh(stopper)]).fit(
            Validated(), loader(64), held_out())


class NoMoreTime(pl.Callback):
    def __init__(self, timer: Timer) -> None:
        self.timer = timer

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if float(outputs["loss"]) < 10.0:
            self.timer._duration = 0.0


def test_a_timer_duration_set_from_the_batch_loss_is_refused_and_put_back() -> None:
    timer = Timer(interval="step")  # measures only (a duration is a wall-clock budget: refused at setup)
    with pytest.raises(PrivacyConfigurationError, match=r"Timer\._duration"):
        quiet_trainer(strategy=strategy(), max_steps=12, callbacks=[timer, NoMoreTime(timer)]).fit(
            Classifier(), loader(64))
    assert timer._duration is None


class CheckpointWhenClose(pl.Callback):
    def __init__(self, checkpoint: ModelCheckpoint) -> None:
        self.checkpoint = checkpoint

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if float(outputs["loss"]) < 10.0:
            self.checkpoint._every_n_train_steps = 1


def test_a_checkpoint_schedule_set_from_the_batch_loss_is_refused(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=100, save_top_k=-1)
    with pytest.raises(PrivacyConfigurationError, match=r"ModelCheckpoint\._every_n_train_steps"):
        quiet_trainer(strategy=strategy(), max_steps=6, enable_checkpointing=True,
                      callbacks=[checkpoint, CheckpointWhenClose(checkpoint)]).fit(Classifier(), loader(64))
    assert list(tmp_path.iterdir()) == []


class ValidateMoreOften(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if float(outputs["loss"]) < 10.0:
            trainer.check_val_every_n_epoch = 1
            trainer.val_check_batch = 1


def test_a_validation_schedule_set_from_the_batch_loss_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"check_val_every_n_epoch|val_check_batch"):
        quiet_trainer(strategy=strategy(), max_steps=8, check_val_every_n_epoch=5,
                      callbacks=[ValidateMoreOften()]).fit(Validated(), loader(64), held_out())


class PatienceInTheStep(Validated):
    """Sets the early stop's patience from its own batch loss inside training_step, at a step no replay reaches."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 4:
            self.trainer.early_stopping_callback.patience = int(loss.item() * 10)
        return loss


def test_a_library_setting_written_in_training_step_is_refused_before_that_step_releases() -> None:
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"within the step.*EarlyStopping\.patience"):
        quiet_trainer(strategy=dp, max_steps=8, callbacks=[EarlyStopping("val_loss", patience=100)]).fit(
            PatienceInTheStep(), loader(64), held_out())
    assert dp.private_step.ledger.steps == 4


class Logged(Validated):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_lightnings_callbacks_used_as_lightning_runs_them_train(tmp_path: Path) -> None:
    stopper = EarlyStopping("val_loss", patience=1, min_delta=0.0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, every_n_train_steps=2)
    timer = Timer(interval="step")  # measures only (a duration is a wall-clock budget: refused at setup)
    trainer = quiet_trainer(strategy=strategy(), max_epochs=3, val_check_interval=0.5, enable_checkpointing=True,
                            logger=CSVLogger(tmp_path), log_every_n_steps=1,
                            callbacks=[stopper, checkpoint, timer, LearningRateMonitor()])
    trainer.fit(Logged(), loader(64), held_out())
    assert trainer.global_step > 0 and checkpoint.best_model_path
    trainer.validate(trainer.lightning_module, held_out(), verbose=False)


class SettingsFromConstants(pl.Callback):
    """A user's callback setting library objects' attributes from constants: at the start of training and of every
    epoch, alike on all data."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.early_stopping_callback.patience = 5
        trainer.check_val_every_n_epoch = 1

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.checkpoint_callback._every_n_train_steps = 3
        trainer.early_stopping_callback.stopping_threshold = 1e-6


def test_library_settings_written_from_constants_train(tmp_path: Path) -> None:
    stopper = EarlyStopping("val_loss", patience=100)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=100, save_top_k=-1)
    dp = strategy()
    quiet_trainer(strategy=dp, max_epochs=2, enable_checkpointing=True, check_val_every_n_epoch=2,
                  callbacks=[stopper, checkpoint, SettingsFromConstants()]).fit(Validated(), loader(64), held_out())
    assert stopper.patience == 5 and checkpoint._every_n_train_steps == 3
    assert dp.private_step.ledger.steps > 0
