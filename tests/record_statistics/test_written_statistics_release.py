"""The training data's statistics kept for a fit (record_statistics/written_statistics.py) are let go when the fit
ends (validators/step_checks.forget_written_statistics): the strategy kept after ``fit`` (to read its ε, to fit
again) no longer holds them — nor the training tensors, their sorted copies and principal directions they hold —
until its next fit's first probe. A failed fit lets them go too."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class Watched(pl.Callback):
    """Takes weak references to the fit's kept statistics and the training tensors they hold, at a batch's end."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        watch = trainer.strategy.private_step.written_statistics
        if watch is not None and not self.refs:
            self.refs = [weakref.ref(watch), weakref.ref(watch.statistics),
                         *(weakref.ref(t) for _, t in watch.statistics.tensors)]


class FailsAtStep(Classifier):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step == 2:
            self.kept = batch[0].mean(0)  # a batch statistic kept outside the release: refused


@pytest.mark.parametrize("model, fails", [(Classifier, False), (FailsAtStep, True)], ids=["ends", "fails"])
def test_the_training_statistics_are_let_go_when_the_fit_ends(model, fails):
    torch.manual_seed(0)
    dp, watched = strategy(), Watched()
    trainer = quiet_trainer(strategy=dp, max_steps=4, callbacks=[watched], num_sanity_val_steps=0)
    x, y = data(64).tensors
    dataset = torch.utils.data.TensorDataset(x * 2.0, y)  # the training tensors: this fit's own
    del x, y
    if fails:
        with pytest.raises(PrivacyConfigurationError):
            trainer.fit(model(), DataLoader(dataset, batch_size=16))
    else:
        trainer.fit(model(), DataLoader(dataset, batch_size=16))
    assert len(watched.refs) >= 3
    del dataset
    gc.collect()
    assert dp.private_step.written_statistics is None and dp.private_step.boundary.on_update is None
    assert [ref() for ref in watched.refs[:2]] == [None, None]  # the watch and the statistics (the strategy kept)

