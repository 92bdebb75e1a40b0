"""The trainer's metric dicts hold what self.log put there (validators/metric_writes.py): an entry the user's code
writes into ``trainer.callback_metrics`` / ``logged_metrics`` / ``progress_bar_metrics`` during a private fit is
refused, so a training statistic cannot reach EarlyStopping, ModelCheckpoint or a callback under a name never logged
(zoo29 n03, n04, n25); reading the dicts, Lightning's own updates and monitoring a logged validation metric train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, loader, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

_WRITES = {
    "item": lambda metrics, v: metrics.__setitem__("val_loss", v),
    "update": lambda metrics, v: metrics.update({"val_loss": v}),
    "update by keyword": lambda metrics, v: metrics.update(val_loss=v),
    "setdefault": lambda metrics, v: metrics.setdefault("val_loss", v),
    "in-place or": lambda metrics, v: metrics.__ior__({"val_loss": v}),
}


class WritesTheLoss(Classifier):
    """Writes its training loss into one of the trainer's metric dicts, under a validation name (no self.log)."""

    def __init__(self, how: str = "item", attribute: str = "callback_metrics") -> None:
        super().__init__()
        self.how, self.attribute = how, attribute

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        _WRITES[self.how](getattr(self.trainer, self.attribute), loss.detach())
        return loss


@pytest.mark.parametrize("how", sorted(_WRITES))
def test_a_loss_written_into_callback_metrics_for_early_stopping_is_refused_before_any_release(how):
    model = WritesTheLoss(how)
    before = parameters(model)
    dp = strategy()
    stop = EarlyStopping(monitor="val_loss", patience=0, check_on_train_epoch_end=True)
    with pytest.raises(PrivacyConfigurationError, match=r"trainer\.callback_metrics\['val_loss'\] was written "
                                                        r"directly .*in training_step.*self\.log\(name, value\)"):
        quiet_trainer(strategy=dp, max_epochs=3, callbacks=[stop]).fit(model, loader())
    assert dp.ledger.steps == 0 and unchanged(before, model)


@pytest.mark.parametrize("attribute", ["logged_metrics", "progress_bar_metrics"])
def test_the_other_two_metric_dicts_are_watched_alike(attribute):
    with pytest.raises(PrivacyConfigurationError, match=rf"trainer\.{attribute}\['val_loss'\] was written"):
        quiet_trainer(strategy=strategy(), max_steps=3).fit(WritesTheLoss("update", attribute), loader())


def test_a_checkpoint_filename_fed_through_callback_metrics_is_refused(tmp_path):
    """n25: ModelCheckpoint(filename="{epoch}-{hint:.4f}") would write the batch's loss into the file's name."""
    class Hint(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.trainer.callback_metrics["hint"] = loss.detach()
            return loss

    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), filename="{epoch}-{hint:.4f}", save_top_k=-1)
    with pytest.raises(PrivacyConfigurationError, match=r"callback_metrics\['hint'\] was written directly"):
        quiet_trainer(strategy=strategy(), max_epochs=2, callbacks=[checkpoint],
                      enable_checkpointing=True).fit(Hint(), loader())
    assert not list(tmp_path.glob("*.ckpt"))


class Mailbox(Callback):
    """A callback that keeps a logged value in callback_metrics at batch end (``how``), and sets the learning rate from
    the mailbox at the next epoch's start."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        value = outputs["loss"].detach()
        if self.how == "past the dict's methods":
            dict.__setitem__(trainer.callback_metrics, "hint", value)
        else:
            trainer.callback_metrics["hint"] = value

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if "hint" in trainer.callback_metrics:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.1 * float(trainer.callback_metrics["hint"])


@pytest.mark.parametrize("how", ["item", "past the dict's methods"])
def test_a_callback_writing_callback_metrics_at_batch_end_is_refused(how):
    dp = strategy()
    match = "was written directly by the user's code" if how == "item" else "holds an object no library put there"
    with pytest.raises(PrivacyConfigurationError, match=rf"callback_metrics\['hint'\] {match}"):
        quiet_trainer(strategy=dp, max_epochs=2, callbacks=[Mailbox(how)]).fit(Classifier(), loader())
    assert dp.ledger.steps <= 4, "refused in the first epoch, before the rate was set from the mailbox"


class LogsBoth(Classifier):
    """Logs its training loss (read back by a callback that prints it) and a validation loss (monitored)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx))


class Prints(Callback):
    """Reads the metric dicts (all three, every way) at batch and epoch end."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.seen.append(len(dict(trainer.callback_metrics)) + len(list(trainer.logged_metrics.items())))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.seen.append(len(trainer.progress_bar_metrics.copy()) + ("val_loss" in trainer.callback_metrics))


def test_reading_the_dicts_lightnings_updates_and_a_monitored_validation_metric_train(tmp_path):
    prints = Prints()
    callbacks = [prints, EarlyStopping(monitor="val_loss", patience=5), LearningRateMonitor(logging_interval="step"),
                 ModelCheckpoint(dirpath=str(tmp_path), monitor="val_loss", filename="{epoch}-{val_loss:.3f}")]
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, max_epochs=2, callbacks=callbacks, enable_checkpointing=True,
                            logger=CSVLogger(str(tmp_path)), log_every_n_steps=1, limit_val_batches=1,
                            num_sanity_val_steps=0)
    trainer.fit(LogsBoth(), loader(), DataLoader(data(16, seed=1), batch_size=16))
    assert dp.ledger.steps == 8 and len(prints.seen) == 10 and list(tmp_path.glob("*.ckpt"))
    assert {"val_loss", "lr-SGD"} <= set(trainer.callback_metrics)
    trainer.callback_metrics["after the fit"] = torch.tensor(1.0)  # a plain dict again: nothing is watched
