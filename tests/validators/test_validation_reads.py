"""Validation hooks reading the training records by another path than their loader (validators/validation_reads.py;
zoo30 m06): the training rows reached through the trainer, the datamodule, a copy the module keeps or a global make
every value validation logs the training data's — monitored, refused, naming the hook; held-out validation, the
training set's length, and a declared ``trainer.validate`` train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import EarlyStopping
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, data, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import DPStrategy, PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.monitored import private_logged  # noqa: E402
from lightning_dp.validators.validation_reads import read_in_evaluation  # noqa: E402

TRAIN = data(64)
HELD_OUT = data(32, seed=1)
X_TRAIN = TRAIN.tensors[0].clone()  # a global copy of the training features (another memory)
Y_TRAIN = TRAIN.tensors[1].clone()


class HeldOut(Classifier):
    """Validates on the batch its (held-out) loader hands it."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


class ThroughTheTrainer(Classifier):
    """zoo30 m06: the loss of the training rows reached through the trainer, logged as ``val_loss``."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = self.trainer.train_dataloader.dataset.tensors
        self.log("val_loss", F.cross_entropy(self(x), y))


class ByItem(Classifier):
    """A training record read through the trainer's dataset, its features handed to the model as they are."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = self.trainer.train_dataloader.dataset[0]
        self.log("val_loss", self(x).logsumexp(0))


class ThroughTheDatamodule(Classifier):
    """The training set the datamodule holds (``self.trainer.datamodule.train_set``)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = self.trainer.datamodule.train_set.tensors
        self.log("val_loss", F.cross_entropy(self(x), y))


class KeepsACopy(Classifier):
    """Copies the training tensors onto itself in ``setup`` (other memory), validates on the copy (the copy declared
    public: kept state otherwise, refused before the first release)."""

    def setup(self, stage: str) -> None:
        self.train_x, self.train_y = (t.clone() for t in TRAIN.tensors)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(self.train_x), self.train_y))


class AtEpochEnd(HeldOut):
    """Validates on held-out data, then logs the training set's loss (a global copy) at validation's epoch end."""

    def on_validation_epoch_end(self) -> None:
        self.log("train_set_loss", F.cross_entropy(self(X_TRAIN), Y_TRAIN))


class AtStart(HeldOut):
    """Logs the training set's loss (a global copy) from ``on_validation_start``, a hook Lightning calls before the
    strategy's (watched from the loop's start)."""

    def on_validation_start(self) -> None:
        self.log("train_set_loss", F.cross_entropy(self(X_TRAIN), Y_TRAIN))


class AtModelEval(HeldOut):
    """Reads the training rows in ``on_validation_model_eval`` (the loop's first hook) and logs their loss from a
    value the hook computed (kept for the batch: the read comes first, so the kept value is refused with it)."""

    def on_validation_model_eval(self) -> None:
        super().on_validation_model_eval()
        self.log_later = F.cross_entropy(self(X_TRAIN), Y_TRAIN).detach()


class TrainingLossAtValidationStart(pl.Callback):
    """A callback logging the training set's loss through the trainer when validation starts."""

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        x, y = trainer.train_dataloader.dataset.tensors
        pl_module.log("train_set_loss", F.cross_entropy(pl_module(x), y))


class Arrays(Dataset):
    """The training records held as NumPy arrays."""

    def __init__(self) -> None:
        self.x, self.y = (t.numpy().copy() for t in TRAIN.tensors)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple:
        return torch.from_numpy(self.x[i]), int(self.y[i])


class FromNumpy(Classifier):
    """Wraps the training dataset's NumPy arrays (``torch.from_numpy``: no torch call is handed the array)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        dataset = self.trainer.train_dataloader.dataset
        self.log("val_loss", F.cross_entropy(self(torch.from_numpy(dataset.x)), torch.from_numpy(dataset.y)))


class SwallowsTheRefusal(ThroughTheTrainer):
    """Catches the refusal raised at the read: raised again when validation ends, before the stop."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        try:
            super().validation_step(batch, batch_idx)
        except PrivacyConfigurationError:
            self.log("val_loss", 0.0)


class ReadsTheLength(HeldOut):
    """Reads only public metadata of the training set: its length and its features' shape."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        dataset = self.trainer.train_dataloader.dataset
        self.log("n_train", float(len(dataset) * dataset.tensors[0].shape[1]))


class Data(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.train_set, self.val_set = TRAIN, HELD_OUT

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=16)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=32)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=32)


def _fit(model: Classifier, monitor: Optional[str] = "val_loss", dp: Optional[DPStrategy] = None) -> DPStrategy:
    dp = dp or strategy(public_state=["train_x", "train_y"] if isinstance(model, KeepsACopy) else [])
    callbacks = [EarlyStopping(monitor=monitor, patience=0, mode="min")] if monitor else []
    trainer = quiet_trainer(strategy=dp, max_epochs=3, callbacks=callbacks, num_sanity_val_steps=0)
    if isinstance(model, ThroughTheDatamodule):
        trainer.fit(model, datamodule=Data())
    elif isinstance(model, FromNumpy):
        trainer.fit(model, DataLoader(Arrays(), batch_size=16), DataLoader(HELD_OUT, batch_size=32))
    else:
        trainer.fit(model, DataLoader(TRAIN, batch_size=16), DataLoader(HELD_OUT, batch_size=32))
    return dp


def _no_mode_left() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return not _get_current_function_mode_stack()


@pytest.mark.parametrize("model, hook, monitor", [
    (ThroughTheTrainer, "validation_step", "val_loss"),
    (ByItem, "validation_step", "val_loss"),
    (ThroughTheDatamodule, "validation_step", "val_loss"),
    (KeepsACopy, "validation_step", "val_loss"),
    (AtEpochEnd, "on_validation_epoch_end", "val_loss"),  # the monitored value itself is held out's
    (FromNumpy, "validation_step", "val_loss"),
    (SwallowsTheRefusal, "validation_step", "val_loss"),
])
def test_validation_reading_the_training_records_while_a_value_is_monitored_is_refused(model, hook, monitor):
    m = model()
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)^{hook} read the training records during validation"
                                                        rf".*EarlyStopping monitors '{monitor}'.*public_state="
                                                        r"\['trainer.validate'\]"):
        _fit(m)
    assert m.trainer.strategy.ledger.steps == 4, "refused in the first validation, after the first epoch"
    assert _no_mode_left()


@pytest.mark.parametrize("model, hook", [(AtStart, "on_validation_start"),
                                         (AtModelEval, "on_validation_model_eval")])
def test_a_read_in_validations_first_hooks_is_seen(model, hook):
    """The hooks Lightning calls before the strategy's ``on_validation_start`` are watched too."""
    m = model()
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)^{hook} read the training records during validation"
                                                        r".*EarlyStopping monitors 'val_loss'"):
        _fit(m)
    assert m.trainer.strategy.ledger.steps == 4
    assert _no_mode_left()


def test_a_callbacks_read_when_validation_starts_is_seen():
    trainer = quiet_trainer(strategy=strategy(), max_epochs=3, num_sanity_val_steps=0,
                            callbacks=[TrainingLossAtValidationStart(), EarlyStopping(monitor="val_loss", patience=0)])
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)^on_validation_start read the training records"):
        trainer.fit(HeldOut(), DataLoader(TRAIN, batch_size=16), DataLoader(HELD_OUT, batch_size=32))
    assert _no_mode_left()


def test_the_evaluation_loops_are_restored_after_the_fit():
    m = HeldOut()
    trainer = quiet_trainer(strategy=strategy(), max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(m, DataLoader(TRAIN, batch_size=16), DataLoader(HELD_OUT, batch_size=32))
    loops = (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
    assert all("on_run_start" not in vars(loop) for loop in loops)
    assert all("update_lr_schedulers" not in vars(loop) for loop in (trainer.fit_loop.epoch_loop,))


def test_held_out_validation_and_the_training_sets_length_train_with_early_stopping():
    for model in (HeldOut(), ReadsTheLength()):
        dp = _fit(model)
        assert dp.ledger.steps >= 4 and read_in_evaluation(model.trainer) is None
        assert _no_mode_left()


def test_a_read_without_a_monitor_trains_and_makes_validations_values_private():
    """Nothing decides from it: a report; from the read on, what validation logs is the training data's (read back
    by the user's code, it is judged as a training-logged value)."""
    m = ThroughTheTrainer()
    dp = _fit(m, monitor=None)
    assert dp.ledger.steps == 12 and read_in_evaluation(m.trainer) == "validation_step"
    assert "val_loss" in private_logged(m.trainer)


def test_declared_public_validation_may_read_the_training_records():
    dp = _fit(ThroughTheTrainer(), dp=strategy(public_state=["trainer.validate"]))
    assert dp.ledger.steps >= 4
    assert _no_mode_left()


class KeepsTheTrainingLoss(HeldOut):
    """Keeps the training set's loss, read in validation, for training to read (no value logged from it)."""

    def on_validation_epoch_end(self) -> None:
        x, y = self.trainer.train_dataloader.dataset.tensors
        self.scale = float(F.cross_entropy(self(x), y))


def test_state_validation_keeps_after_reading_the_training_tensors_is_refused():
    """Read past the item access (``.tensors``), the state kept from then on is refused as a record read's."""
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)during validation after it read training data.*scale"):
        _fit(KeepsTheTrainingLoss(), monitor=None)
    assert _no_mode_left()


class HoldsACopy(KeepsACopy):
    """Holds a (public) copy of the training tensors but validates on its held-out batch: the library's own reads of
    the state (fingerprints in its callbacks' evaluation hooks) are not the user's."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        HeldOut.validation_step(self, batch, batch_idx)


def test_a_module_holding_a_copy_but_validating_held_out_trains():
    m = HoldsACopy()
    dp = _fit(m)
    assert dp.ledger.steps >= 4 and read_in_evaluation(m.trainer) is None


def test_a_read_through_lightning_dps_own_model_is_the_users():
    """``self(x)`` of lightning_dp's DigitsCNN on the training tensors: its forward is the user's call, not the
    library's own read."""
    from lightning_dp.models import DigitsCNN

    class Digits(DigitsCNN):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, _ = self.trainer.train_dataloader.dataset.tensors  # the features only: handed to the forward
            self.log("val_loss", self(x).logsumexp(1).mean())

    g = torch.Generator().manual_seed(0)
    images = [torch.utils.data.TensorDataset(torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,),
                                                                                                generator=g))
              for n in (64, 32)]
    trainer = quiet_trainer(strategy=strategy(), max_epochs=3, num_sanity_val_steps=0,
                            callbacks=[EarlyStopping(monitor="val_loss", patience=0)])
    with pytest.raises(PrivacyConfigurationError, match="^validation_step read the training records"):
        trainer.fit(Digits(channels=4), DataLoader(images[0], batch_size=16), DataLoader(images[1], batch_size=32))


# ---------------------------------------------------------------- after the fit: trainer.validate / test / predict
class AlsoOnTheTrainingSet(HeldOut):
    """zoo32 v10: after the fit, ``trainer.validate`` on held-out data whose ``validation_step`` also logs the loss of
    the training rows (a global copy), ``test_step`` the datamodule's training set's, ``predict_step`` the training
    rows' outputs."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("train_loss", F.cross_entropy(self(X_TRAIN), Y_TRAIN))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = self.trainer.datamodule.train_set.tensors
        self.log("train_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(X_TRAIN)


class OnItsBatch(HeldOut):
    """Evaluates the batch its (held-out) loader hands it, in every stage."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        HeldOut.validation_step(self, batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch[0])


def _fitted(model: Classifier, dp: Optional[DPStrategy] = None) -> pl.Trainer:
    trainer = quiet_trainer(strategy=dp or strategy(), max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=Data())
    return trainer


def _evaluate(trainer: pl.Trainer, model: Classifier, stage: str) -> Any:
    if stage == "test":
        return trainer.test(model, datamodule=Data(), verbose=False)
    held_out = DataLoader(HELD_OUT, batch_size=32)
    return trainer.validate(model, held_out, verbose=False) if stage == "validate" else trainer.predict(model, held_out)


@pytest.mark.parametrize("stage, hook", [("validate", "validation_step"), ("test", "test_step"),
                                         ("predict", "predict_step")])
def test_evaluation_after_the_fit_reading_the_training_records_is_refused(stage, hook):
    """zoo32 v10: outside a fit the strategy cannot see where the result goes; refused before it returns."""
    m = AlsoOnTheTrainingSet()
    trainer = _fitted(m)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)^trainer.{stage}\(\.\.\.\) under DPStrategy: {hook} "
                                                        rf"read the training records.*public_state=\['trainer.{stage}'"
                                                        r"\]"):
        _evaluate(trainer, m, stage)
    assert _no_mode_left()


class TestsAtStart(OnItsBatch):
    """After the fit, ``on_test_start`` logs the training rows' loss (a global copy) beside a held-out test."""

    def on_test_start(self) -> None:
        self.log("train_loss", F.cross_entropy(self(X_TRAIN), Y_TRAIN))


def test_a_read_in_on_test_start_after_the_fit_is_refused():
    m = TestsAtStart()
    trainer = _fitted(m)
    with pytest.raises(PrivacyConfigurationError, match=r"^trainer.test\(\.\.\.\) under DPStrategy: on_test_start "
                                                        r"read the training records"):
        _evaluate(trainer, m, "test")
    assert _no_mode_left()


def test_evaluation_under_a_new_strategy_of_a_privately_fitted_module_is_refused():
    """The module's last private fit: its training records, evaluated through another trainer's DPStrategy."""
    m = AlsoOnTheTrainingSet()
    _fitted(m)
    trainer = quiet_trainer(strategy=strategy(), max_epochs=1)
    with pytest.raises(PrivacyConfigurationError, match=r"^trainer.validate\(\.\.\.\) under DPStrategy: "
                                                        r"validation_step read the training records"):
        trainer.validate(m, DataLoader(HELD_OUT, batch_size=32), verbose=False)
    assert _no_mode_left()


def test_held_out_evaluation_after_the_fit_returns():
    m = OnItsBatch()
    trainer = _fitted(m)
    assert "val_loss" in _evaluate(trainer, m, "validate")[0]
    assert "val_loss" in _evaluate(trainer, m, "test")[0]
    assert len(_evaluate(trainer, m, "predict")) == 1
    assert _no_mode_left()


def test_declared_public_evaluation_after_the_fit_returns():
    m = AlsoOnTheTrainingSet()
    trainer = _fitted(m, strategy(public_state=["trainer.validate"]))
    assert "train_loss" in _evaluate(trainer, m, "validate")[0]
    with pytest.raises(PrivacyConfigurationError, match=r"trainer.predict"):  # declared for validate only
        _evaluate(trainer, m, "predict")
    assert _no_mode_left()
