"""A subclass of Lightning's own callback keeps Lightning's state as Lightning's (validators/kept_state.py,
``lightning_owned``): what ``ModelCheckpoint``'s or ``EarlyStopping``'s own methods write (``best_model_path``,
``best_k_models``, ``kth_value``, ``wait_count``, ``best_score``) from the values they monitor is judged by rule 10, not
as the user's kept state; what the user's code writes (an attribute of its own, or one of Lightning's it names) is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from cases import Classifier, data, loader, strategy
from conftest import quiet_trainer
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dp import PrivacyConfigurationError
from lightning_dp.fingerprints.callback_state import lightning_owned


class Validated(Classifier):
    """Logs a held-out loss (and, as a report, the training loss)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx))


class MyCheckpoint(ModelCheckpoint):
    pass


class MyStopping(EarlyStopping):
    pass


class CountsEpochs(ModelCheckpoint):
    """An epoch counter of its own, from the loop's public counter, written after Lightning saved."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epochs_seen = 0
        self.last_epoch = -1

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self.epochs_seen += 1
        self.last_epoch = trainer.current_epoch


class CountsBeforeSaving(CountsEpochs):
    """Counts the epoch before Lightning saves it (the checkpoint judges the open epoch window: an epoch count)."""

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.epochs_seen += 1
        ModelCheckpoint.on_train_epoch_end(self, trainer, pl_module)
        self.last_epoch = trainer.current_epoch


class KeepsBatchMean(ModelCheckpoint):
    """Keeps the last batch's mean feature: the batch's data."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batch_mean = batch[0].mean().item()


class WritesBestScore(ModelCheckpoint):
    """Writes one of Lightning's own attributes from the batch."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.best_model_score = batch[0].mean()


def fit(model: Any, callbacks: list, epochs: int = 2, validate: bool = True) -> Any:
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=True)
    trainer.fit(model, loader(), DataLoader(data(32, seed=1), batch_size=16) if validate else None)
    return dp


def test_empty_subclasses_of_model_checkpoint_and_early_stopping_train(tmp_path):
    class LocalCheckpoint(ModelCheckpoint):
        pass

    dp = fit(Validated(), [MyStopping(monitor="val_loss", patience=5),
                           MyCheckpoint(dirpath=tmp_path / "a", monitor="val_loss", save_top_k=2),
                           LocalCheckpoint(dirpath=tmp_path / "b")], epochs=3)
    assert dp.ledger.steps > 0
    assert len(list((tmp_path / "a").glob("*.ckpt"))) == 2 and list((tmp_path / "b").glob("*.ckpt"))


def test_a_subclass_saving_at_the_training_epoch_end_trains(tmp_path):
    fit(Classifier(), [MyCheckpoint(dirpath=tmp_path, save_top_k=-1)], epochs=3, validate=False)
    assert len(list(Path(tmp_path).glob("*.ckpt"))) == 3


@pytest.mark.parametrize("callback", [CountsEpochs, CountsBeforeSaving])
def test_a_subclass_counting_epochs_from_the_loop_trains(tmp_path, callback):
    ck = callback(dirpath=tmp_path, save_top_k=-1)
    fit(Classifier(), [ck], epochs=3, validate=False)
    assert ck.epochs_seen == 3 and ck.last_epoch == 2 and len(list(Path(tmp_path).glob("*.ckpt"))) == 3


@pytest.mark.parametrize("callback, entry", [(KeepsBatchMean, "KeepsBatchMean.batch_mean"),
                                             (WritesBestScore, "WritesBestScore.best_model_score")])
def test_what_a_subclass_writes_from_the_batch_is_refused(tmp_path, callback, entry):
    with pytest.raises(PrivacyConfigurationError, match=entry.replace(".", r"\.")):
        fit(Classifier(), [callback(dirpath=tmp_path)], validate=False)


@pytest.mark.parametrize("callback", [MyCheckpoint, MyStopping])
def test_a_subclass_monitoring_a_training_logged_value_is_refused(tmp_path, callback):
    kwargs = {"dirpath": tmp_path} if callback is MyCheckpoint else {}
    with pytest.raises(PrivacyConfigurationError, match="train_loss"):
        fit(Validated(), [callback(monitor="train_loss", **kwargs)])


def test_lightning_state_is_lightnings_unless_the_users_code_names_it_or_hands_lightning_values():
    class Reads(ModelCheckpoint):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            print(self.best_model_path)

    class Candidates(ModelCheckpoint):
        def _monitor_candidates(self, trainer: Any) -> dict:
            return {"loss": trainer.lightning_module.last_loss}

    class Hands(ModelCheckpoint):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self._save_topk_checkpoint(trainer, {"loss": outputs["loss"]})

    class Uploads(ModelCheckpoint):
        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            super()._save_checkpoint(trainer, filepath)

    assert {"best_model_path", "best_k_models", "kth_value", "current_score"} <= lightning_owned(MyCheckpoint)
    assert {"wait_count", "best_score"} <= lightning_owned(MyStopping)
    assert "epochs_seen" not in lightning_owned(CountsEpochs)
    assert "best_model_path" not in lightning_owned(Reads) and "best_k_models" in lightning_owned(Reads)
    assert lightning_owned(Candidates) == lightning_owned(Hands) == frozenset()
    assert "best_model_path" in lightning_owned(Uploads)
    assert lightning_owned(ModelCheckpoint) == lightning_owned(Classifier) == frozenset()


def test_the_replays_of_a_subclass_hooks_write_link_or_remove_no_checkpoint_file(tmp_path):
    class EpochCount(pl.Callback):
        def __init__(self) -> None:
            self.seen = 0

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self.seen += 1  # the epoch's window runs its hooks again, MyCheckpoint's on_train_epoch_end with them

    fit(Classifier(), [EpochCount(), MyCheckpoint(dirpath=tmp_path, save_last="link", monitor="step", mode="max")],
        epochs=3, validate=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=2-step=12.ckpt", "last.ckpt"]
