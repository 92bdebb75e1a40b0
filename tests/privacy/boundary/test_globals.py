"""Kept state in module-level globals (validators/kept_state.py, user_modules): a global of the user's code written
from the batch — a list appended, a counter rebound, a tensor updated in place — is refused before any release (or
before the next one, for a write that starts later), unless declared public; globals of other modules are not read."""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import pytest
import pytorch_lightning as pl
import torch
from cases import Classifier, data, fit, loader, parameters, strategy, unchanged
from conftest import quiet_trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dp import PrivacyConfigurationError
from lightning_dp.fingerprints.state_walker import user_modules

MEMORY: list[torch.Tensor] = []
POSITIVES = 0
RUNNING = torch.zeros(4)


class AppendsToGlobal(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        MEMORY.append(batch[0].detach())
        return super().training_step(batch, batch_idx)


class CountsInGlobal(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        global POSITIVES
        POSITIVES += int((batch[1] == 1).sum())
        return super().training_step(batch, batch_idx)


class UpdatesGlobalTensor(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        RUNNING.mul_(0.9).add_(batch[0].mean(0), alpha=0.1)
        return super().training_step(batch, batch_idx)


class CallbackKeepsGlobal(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        MEMORY.append(outputs["loss"].detach())


@pytest.fixture(autouse=True)
def _reset():
    global POSITIVES
    MEMORY.clear()
    POSITIVES = 0
    RUNNING.zero_()
    yield


@pytest.mark.parametrize("model, name", [(AppendsToGlobal, "MEMORY"), (CountsInGlobal, "POSITIVES"),
                                         (UpdatesGlobalTensor, "RUNNING")])
def test_a_global_written_from_the_batch_is_refused_before_any_release(model, name):
    m = model()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=f"global {__name__}.{name}"):
        fit(m, steps=3)
    assert unchanged(before, m)


def test_a_callback_handed_the_batch_writing_a_global_is_refused():
    with pytest.raises(PrivacyConfigurationError, match=f"global {__name__}.MEMORY"):
        fit(Classifier(), steps=3, callbacks=[CallbackKeepsGlobal()])


def test_a_public_global_is_allowed():
    fit(CountsInGlobal(), steps=3, public_state=["POSITIVES"])
    assert POSITIVES > 0


def test_only_the_users_modules_are_read():
    modules = {m.__name__ for m in user_modules([AppendsToGlobal, CallbackKeepsGlobal])}
    assert __name__ in modules and "cases" in modules
    assert not any(name.split(".")[0] in ("torch", "pytorch_lightning", "lightning_dp", "builtins")
                   for name in modules)


class Records(pl.LightningDataModule):
    """A LightningDataModule with no save_hyperparameters: Lightning makes its empty `hparams` when a checkpoint
    first reads them."""

    def setup(self, stage: str) -> None:
        self.ds = data(64)
        self.memory: list[torch.Tensor] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.ds, batch_size=16)


class Trained(Classifier):
    """Defined here, so this module's globals are read (user_modules)."""


class KeepsInDatamodule(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trainer.datamodule.memory.append(batch[0].detach())
        return super().training_step(batch, batch_idx)


class KeepsInDatamoduleHparams(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trainer.datamodule.hparams["mean"] = float(batch[0].mean())
        return super().training_step(batch, batch_idx)


class EpochNotes(Callback):
    def __init__(self) -> None:
        self.seen = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen = trainer.global_step


DATAMODULE: Optional[Records] = None
MODEL: Optional[Classifier] = None
CALLBACK: Optional[EpochNotes] = None


def checkpointed_fit(tmp_path, model: Classifier, datamodule: Optional[Records] = None,
                     callbacks: Sequence[Callback] = ()) -> None:
    """Six private steps, a ModelCheckpoint writing at the epoch's end (every 4 steps)."""
    trainer = quiet_trainer(strategy=strategy(), max_steps=6, enable_checkpointing=True,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path), *callbacks])
    if datamodule is not None:
        trainer.fit(model, datamodule=datamodule)
    else:
        trainer.fit(model, loader(64))


def test_a_datamodule_held_as_a_global_trains_with_checkpoints(tmp_path):
    """A checkpoint reads the datamodule's `hparams`, which makes them: Lightning's own, not a write of the step."""
    global DATAMODULE
    DATAMODULE = Records()
    checkpointed_fit(tmp_path, Trained(), DATAMODULE)
    assert DATAMODULE.hparams == {} and list(tmp_path.glob("*.ckpt"))


def test_a_module_and_a_callback_held_as_globals_train_with_checkpoints(tmp_path):
    global MODEL, CALLBACK
    MODEL, CALLBACK = Trained(), EpochNotes()
    checkpointed_fit(tmp_path, MODEL, callbacks=[CALLBACK])
    assert list(tmp_path.glob("*.ckpt"))


@pytest.mark.parametrize("as_global", [True, False])
@pytest.mark.parametrize("model, name", [(KeepsInDatamodule, "memory"), (KeepsInDatamoduleHparams, "_hparams")])
def test_a_datamodule_written_from_the_batch_is_refused_global_or_not(tmp_path, model, name, as_global):
    global DATAMODULE
    datamodule = Records()
    if as_global:
        DATAMODULE = datamodule
    m = model()
    before = parameters(m)
    where = f"global {__name__}.DATAMODULE" if as_global else f"datamodule Records.{name}"
    with pytest.raises(PrivacyConfigurationError, match=re.escape(where)):
        checkpointed_fit(tmp_path, m, datamodule)
    assert unchanged(before, m)


# ---------------------------------------------------------------------------- classes of the user's module
class GradScaleSTE(torch.autograd.Function):
    """A straight-through estimator whose backward scales by the previous step's raw gradient magnitude, kept in its
    class body and refreshed once per step: raw, unclipped gradients steering the next release."""

    scale = 1.0
    last: Optional[torch.Tensor] = None
    step = -1

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, step: int) -> torch.Tensor:
        ctx.step = step
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.step != GradScaleSTE.step and GradScaleSTE.last is not None:
            GradScaleSTE.scale = 1.0 / (1.0 + float(GradScaleSTE.last))
        GradScaleSTE.step, GradScaleSTE.last = ctx.step, g.detach().abs().mean()
        return g * GradScaleSTE.scale, None


class QuantisedClassifier(Classifier):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](GradScaleSTE.apply(self.net[1](self.net[0](x)), self.global_step))


class HP:
    """A namespace class used as a mutable configuration."""

    temperature = 1.0
    name = "run"


class TemperatureFromLoss(Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        HP.temperature = 1.0 + float(outputs["loss"])


class ReadsTheConfig(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x) / HP.temperature, y)


def test_a_class_of_the_users_module_keeping_raw_gradient_statistics_is_refused():
    GradScaleSTE.scale, GradScaleSTE.last, GradScaleSTE.step = 1.0, None, -1
    with pytest.raises(PrivacyConfigurationError, match=r"class attribute .*GradScaleSTE\.(last|scale|step)"):
        fit(QuantisedClassifier(), steps=6)


def test_a_namespace_class_set_from_the_loss_is_refused_and_a_read_only_one_trains():
    HP.temperature = 1.0
    with pytest.raises(PrivacyConfigurationError, match=r"HP\.temperature"):
        fit(ReadsTheConfig(), steps=6, callbacks=[TemperatureFromLoss()])
    HP.temperature = 1.0
    assert fit(ReadsTheConfig(), steps=4).ledger.steps == 4  # read only: trains


EPOCHS_DONE = 0
EPOCH_LOG: list[int] = []
FEATURE_MEAN: list[float] = []


class CountsEpochsInGlobal(Classifier):
    def on_train_epoch_end(self) -> None:
        global EPOCHS_DONE
        EPOCHS_DONE += 1


class LogsEpochsInGlobal(Classifier):
    def on_train_epoch_end(self) -> None:
        EPOCH_LOG.append(self.current_epoch)


class KeepsTrainingMeanInGlobal(Classifier):
    def on_train_epoch_end(self) -> None:
        xs, _ = self.trainer.train_dataloader.dataset.tensors
        FEATURE_MEAN.append(float(xs.mean()))  # a statistic of the training set


@pytest.mark.parametrize("public", [False, True])
@pytest.mark.parametrize("model", [CountsEpochsInGlobal, LogsEpochsInGlobal])
def test_an_epoch_counter_in_a_global_trains_and_holds_exactly_the_real_epochs(model, public):
    """The library's replays of the epoch hooks (first step, decision windows, end of fit) put the user's globals
    back: an epoch count is alike on every replay (accepted, as the same counter held as an attribute is), and after
    the fit the globals hold the real epochs only — no replay's residue."""
    global EPOCHS_DONE
    EPOCHS_DONE = 0
    EPOCH_LOG.clear()
    public_state = ["EPOCHS_DONE", "EPOCH_LOG"] if public else []
    trainer = quiet_trainer(strategy=strategy(public_state=public_state), max_epochs=2)
    trainer.fit(model(), loader(64))
    assert trainer.global_step > 0
    if model is CountsEpochsInGlobal:
        assert EPOCHS_DONE == 2 and EPOCH_LOG == []
    else:
        assert EPOCH_LOG == [0, 1] and EPOCHS_DONE == 0


def test_a_training_set_statistic_kept_in_a_global_at_epoch_end_is_refused():
    """Refused as the epoch hooks' write (the exchanged replay sets it apart), not as the batch hooks'; the replays'
    appends are put back."""
    FEATURE_MEAN.clear()
    model = KeepsTrainingMeanInGlobal()
    before = parameters(model)
    refused = rf"hooks that see no batch .*computed from the training data.*global {__name__}\.FEATURE_MEAN"
    with pytest.raises(PrivacyConfigurationError, match=refused):
        quiet_trainer(strategy=strategy(), max_epochs=2).fit(model, loader(64))
    assert unchanged(before, model)
    assert FEATURE_MEAN == []
