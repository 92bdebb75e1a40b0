"""A checkpoint written while a decision window is open (validators/decisions.py, ``before_checkpoint``): Lightning's
``ModelCheckpoint`` saves in its own ``on_train_epoch_end``, after the user's epoch hooks ran and before the epoch's
window closes. What those hooks wrote so far is judged at the checkpoint as the window judges it: an epoch count or a
list of epoch times (alike on other data) is written, a statistic of the training data is refused before the
checkpoint is written."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, loader, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class EpochLog(pl.Callback):
    """An epoch count, the epochs seen and their wall-clock times."""

    def __init__(self) -> None:
        self.epochs_seen = 0
        self.epochs: list[int] = []
        self.times: list[float] = []

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.epochs_seen += 1
        self.epochs.append(trainer.current_epoch)
        self.times.append(time.time())


class CountsEpochs(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.epochs_seen = 0

    def on_train_epoch_end(self) -> None:
        self.epochs_seen += 1


class MeanAfterAnEpoch(Classifier):
    """From its second epoch's end on, keeps the training features' mean (after a count of its own: the first step's
    replays of the epoch hooks, from the count as it is then, compute nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ends = 0

    def on_train_epoch_end(self) -> None:
        self.ends += 1
        if self.ends >= 2:
            self.mean = self.trainer.train_dataloader.dataset.tensors[0].mean(0)


def fit(model: Any, callbacks: list, epochs: int = 3) -> Any:
    dp = strategy()
    quiet_trainer(strategy=dp, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=True).fit(model, loader())
    return dp


def test_an_epoch_count_and_times_kept_by_a_callback_are_checkpointed_at_epoch_end(tmp_path):
    log = EpochLog()
    dp = fit(Classifier(), [log, ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)])
    assert log.epochs_seen == 3 and log.epochs == [0, 1, 2] and len(log.times) == 3
    assert len(list(tmp_path.glob("*.ckpt"))) == 3 and dp.ledger.steps == 12


def test_an_epoch_count_of_the_module_is_checkpointed_at_epoch_end(tmp_path):
    model = CountsEpochs()
    fit(model, [ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)])
    assert model.epochs_seen == 3 and len(list(tmp_path.glob("*.ckpt"))) == 3


def test_a_training_set_statistic_written_at_epoch_end_is_refused_before_the_checkpoint(tmp_path):
    model = MeanAfterAnEpoch()
    with pytest.raises(PrivacyConfigurationError, match=r"at the end of an epoch.*attribute mean"):
        fit(model, [ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)])
    assert [p.name for p in tmp_path.glob("*.ckpt")] == ["epoch=0-step=4.ckpt"]  # the second epoch's is not written


def test_a_window_reopened_at_the_checkpoint_still_judges_the_hooks_after_it(tmp_path):
    class MeanAfterSaving(ModelCheckpoint):
        """Saves, then keeps the training features' mean from its second epoch's end on."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.ends = 0

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            super().on_train_epoch_end(trainer, pl_module)
            self.ends += 1
            if self.ends >= 2:
                self.mean = trainer.train_dataloader.dataset.tensors[0].mean(0)

    with pytest.raises(PrivacyConfigurationError, match=r"MeanAfterSaving\.mean"):
        fit(Classifier(), [EpochLog(), MeanAfterSaving(dirpath=tmp_path, save_top_k=-1)])
