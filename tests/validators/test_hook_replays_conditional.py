"""Writes made on one side of a threshold only, in the hooks that see no batch (validators/pre_hook_state.py,
``StepReplays._replay_epoch_hooks`` in validators/step_replays.py, rule 3 of docs/release_boundary.md).

``if p > t: <setting> = x`` with no other branch, ``p`` the training labels' positive rate: replayed from the state
the real hook left, the replay on the exchanged labels skips the write and leaves the real run's value, so it agreed
with the replay on the data. The replays start from the state as the fit started, so each class is refused before
any release: a trainer limit (``setup``), a module attribute (``on_train_start``), a library callback's setting
(``on_fit_start``), an optimizer's learning rate and a scheduler's setting (``on_fit_start``), the weights and which
layers train (``setup``), a datamodule's batch size (its ``setup``, now replayed) and a buffer written in
``configure_model`` (now replayed); and, with a scheduler returned by ``configure_optimizers``, a stop written on
both sides of the threshold (the replays failed there and judged nothing). The same writes from constants train,
and the values the real hooks set stay after the judge ran.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import EarlyStopping
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

DATA = data(64)  # positive rate 0.4375; the exchanged labels' is above one half


def _rate() -> float:
    """The training labels' positive rate, read from the script's dataset (exchanged with the training data)."""
    return float(DATA.tensors[1].float().mean())


def _fit(model: pl.LightningModule, callbacks: list[Any] | None = None, datamodule: Any = None,
         **trainer_kwargs: Any) -> pl.Trainer:
    trainer_kwargs.setdefault("max_steps", 3)
    trainer = quiet_trainer(strategy=strategy(), callbacks=callbacks or [], **trainer_kwargs)
    if datamodule is not None:
        trainer.fit(model, datamodule=datamodule)
    else:
        trainer.fit(model, DataLoader(DATA, batch_size=16))
    return trainer


class LimitIfLow(pl.Callback):
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if _rate() < 0.5:
            trainer.limit_train_batches = 2


class ScaleIfLow(Classifier):
    scale = 1.0

    def on_train_start(self) -> None:
        if _rate() < 0.5:
            self.scale = 0.5

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.scale


class PatienceIfLow(pl.Callback):
    def __init__(self, stopper: EarlyStopping) -> None:
        self.stopper = stopper

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _rate() < 0.5:
            self.stopper.patience = 0


class RateIfLow(Classifier):
    def on_fit_start(self) -> None:
        if _rate() < 0.5:
            self.trainer.optimizers[0].param_groups[0]["lr"] = 0.25


class BiasIfLow(Classifier):
    def setup(self, stage: str) -> None:
        if _rate() < 0.5:
            with torch.no_grad():
                self.net[2].bias.fill_(0.3)


class FrozenIfLow(Classifier):
    def setup(self, stage: str) -> None:
        if _rate() < 0.5:
            self.net[0].requires_grad_(False)


class Scheduled(Classifier):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 5)]


class StepSizeIfLow(Scheduled):
    def on_fit_start(self) -> None:
        if _rate() < 0.5:
            self.trainer.lr_scheduler_configs[0].scheduler.step_size = 1


class EpochsFromLabelsWithScheduler(Scheduled):
    """Both branches written (refused without a scheduler already): with a scheduler returned by
    configure_optimizers, the replays' comparison of the optimizers it builds failed, and nothing was judged."""

    def on_train_start(self) -> None:
        self.trainer.fit_loop.max_epochs = 1 if _rate() < 0.5 else 3


class BatchSizeFromLabels(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.batch_size = 8 if _rate() < 0.5 else 32

    def train_dataloader(self) -> DataLoader:
        return DataLoader(DATA, batch_size=self.batch_size)


class ScaleInConfigureModel(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1))

    def configure_model(self) -> None:
        self.scale.fill_(round(float(DATA.tensors[0][:, 0].std()), 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x / self.scale)


def _stopper() -> EarlyStopping:
    return EarlyStopping("val_loss", patience=5, strict=False)


@pytest.mark.parametrize("build, match", [
    (lambda: dict(model=Classifier(), callbacks=[LimitIfLow()], max_steps=-1, max_epochs=1), "limit_train_batches"),
    (lambda: dict(model=ScaleIfLow()), "attribute scale"),
    (lambda: (lambda es: dict(model=Classifier(), callbacks=[es, PatienceIfLow(es)]))(_stopper()),
     "EarlyStopping.patience"),
    (lambda: dict(model=RateIfLow()), r"param_groups\[0\]\.lr"),
    (lambda: dict(model=BiasIfLow()), "net.2.bias"),
    (lambda: dict(model=Classifier(), datamodule=BatchSizeFromLabels()), "batch_size"),
    (lambda: dict(model=ScaleInConfigureModel()), "buffer scale"),
    (lambda: dict(model=FrozenIfLow()), "model trainable"),
    (lambda: dict(model=StepSizeIfLow()), "lr scheduler 0 StepLR"),
    (lambda: dict(model=EpochsFromLabelsWithScheduler(), max_steps=-1, max_epochs=3), "max_epochs"),
], ids=["trainer-limit-in-setup", "module-attribute-on-train-start", "library-callback-setting-on-fit-start",
        "learning-rate-on-fit-start", "weights-in-setup", "datamodule-setup", "configure-model",
        "frozen-layer-in-setup", "scheduler-setting-on-fit-start", "max-epochs-with-a-scheduler"])
def test_a_write_from_the_labels_in_a_hook_that_sees_no_batch_is_refused(build: Any, match: str) -> None:
    """Each write, made on the data's side of the threshold only (or, in the hooks not replayed before, made at
    all), is refused before any release."""
    torch.manual_seed(0)
    kwargs = build()
    model = kwargs.pop("model")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match=match):
        _fit(model, **kwargs)
    if not isinstance(model, BiasIfLow):  # (that one's own write moved the weights before any release)
        assert all(torch.allclose(a, p.detach()) for a, p in zip(before, model.parameters()))


class PublicSettings(pl.Callback):
    """The same writes from constants: a limit in setup, a library callback's patience in on_fit_start."""

    def __init__(self, stopper: EarlyStopping) -> None:
        self.stopper = stopper

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.limit_train_batches = 2

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stopper.patience = 1


class PublicWrites(Classifier):
    """A module attribute, a learning rate, a buffer in configure_model and a bias, each set from a constant."""

    scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("centre", torch.zeros(1))

    def setup(self, stage: str) -> None:
        with torch.no_grad():
            self.net[2].bias.fill_(0.3)

    def configure_model(self) -> None:
        self.centre.fill_(0.25)

    def on_fit_start(self) -> None:
        self.trainer.optimizers[0].param_groups[0]["lr"] = 0.25
        self.trainer.lr_scheduler_configs[0].scheduler.step_size = 3

    def on_train_start(self) -> None:
        self.scale = 0.5
        self.net[0].bias.requires_grad_(False)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 5)]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - self.centre)


class PublicBatchSize(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.batch_size = 8

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*DATA.tensors), batch_size=self.batch_size)


def test_the_same_writes_from_constants_train_and_stay_as_the_real_hooks_set_them() -> None:
    """Safe twin: every write above from a constant trains, and what the real hooks set is what the fit runs with
    after the judge's replays (the replays started from the state before them, and put it back)."""
    torch.manual_seed(0)
    stopper = _stopper()
    model = PublicWrites()
    trainer = _fit(model, callbacks=[stopper, PublicSettings(stopper)], datamodule=PublicBatchSize(),
                   max_steps=-1, max_epochs=2)
    assert trainer.global_step == 4  # two epochs of the two batches limit_train_batches = 2 allows
    assert trainer.limit_train_batches == 2 and stopper.patience == 1
    assert model.scale == 0.5 and float(model.centre) == 0.25
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.25
    assert trainer.lr_scheduler_configs[0].scheduler.step_size == 3 and not model.net[0].bias.requires_grad
    assert trainer.datamodule.batch_size == 8
