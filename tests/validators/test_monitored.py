"""A monitored name logged by training_step passes as a counter of the loop (validators/monitored.py,
``counter_valued``) only if it equals the SAME counter at every check: a value that is some counter at each check but
chosen among them by the data (``global_step if loss < t else batch_idx``) is the training data's (zoo29 m01/m02/m06);
a value that is one counter throughout (the docs' "keep the latest k") stays accepted."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class ChoosesACounter(Classifier):
    """Logs under "global_step" one of the loop's counters at every step; which one is chosen by ``pick`` (here a
    function of the step standing for a test of the batch's loss, whose outcome the check cannot see)."""

    def __init__(self, pick: str) -> None:
        super().__init__()
        self.pick = pick

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        step, epoch = self.global_step, self.current_epoch
        value = {"global_step": step, "batch_idx": batch_idx, "epoch": epoch,
                 "step or epoch": step if batch_idx != 2 else epoch,     # m02: `step if loss > t else epoch`
                 "step or batch_idx": step if epoch == 0 or batch_idx % 2 else batch_idx,  # m01
                 "epoch or batch_idx": epoch if batch_idx != 3 else batch_idx}[self.pick]  # m06
        self.log("global_step", float(value), on_step=True, on_epoch=False)
        return loss


def _fit(pick: str, callback: Any, epochs: int = 2) -> Any:
    dp = strategy()
    quiet_trainer(strategy=dp, max_epochs=epochs, callbacks=[callback],
                  enable_checkpointing=isinstance(callback, ModelCheckpoint)).fit(ChoosesACounter(pick), loader(64))
    return dp


@pytest.mark.parametrize("pick", ["step or epoch", "step or batch_idx", "epoch or batch_idx"])
def test_a_value_chosen_among_the_counters_is_refused(pick, tmp_path):
    callback = (ModelCheckpoint(dirpath=str(tmp_path), monitor="global_step", mode="max", save_top_k=1,
                                every_n_train_steps=1) if pick == "step or epoch"
                else EarlyStopping(monitor="global_step", mode="min" if pick.startswith("epoch") else "max",
                                   patience=0, check_on_train_epoch_end=True))
    with pytest.raises(PrivacyConfigurationError, match="monitors 'global_step', logged by a training hook"):
        _fit(pick, callback, epochs=3)


@pytest.mark.parametrize("pick", ["global_step", "batch_idx", "epoch"])
def test_a_value_that_is_one_counter_throughout_trains(pick, tmp_path):
    callback = ModelCheckpoint(dirpath=str(tmp_path), monitor="global_step", mode="max", save_top_k=2,
                               every_n_train_steps=2)
    dp = _fit(pick, callback)
    assert dp.ledger.steps == 8 and len(list(tmp_path.glob("*.ckpt"))) == 2
