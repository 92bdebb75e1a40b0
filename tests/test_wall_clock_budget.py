"""A wall-clock budget is refused under DPStrategy (lightning_dp/_strategy_glue.check_no_wall_clock_budget):
``Trainer(max_time=...)`` or a ``Timer`` with a duration stops after however many steps fit in the time, and a step's
time depends on the data (a record slow to load), so the number of releases would be an un-noised output of one
record (zoo13 time1). A fixed ``max_steps``/``max_epochs`` and a ``Timer`` without a duration train."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path


import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import Timer

sys.path.insert(0, str(Path(__file__).resolve().parent / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torch.set_num_threads(1)


def test_max_time_is_refused_before_any_release() -> None:
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"wall-clock budget.*max_steps"):
        quiet_trainer(strategy=dp, max_steps=100, max_time=timedelta(seconds=30)).fit(Classifier(), loader(64))
    assert dp.private_step.ledger.steps == 0


def test_a_timer_with_a_duration_is_refused_before_any_release() -> None:
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"wall-clock budget.*Timer"):
        quiet_trainer(strategy=dp, max_steps=100, callbacks=[Timer(duration=dict(minutes=5))]).fit(
            Classifier(), loader(64))
    assert dp.private_step.ledger.steps == 0


class BudgetFromAConstant(pl.Callback):
    """Gives a measuring Timer a duration once training started (alike on any data: still a wall-clock budget)."""

    def __init__(self, timer: Timer) -> None:
        self.timer = timer

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer._duration = 30.0


def test_a_duration_given_to_a_timer_after_setup_is_refused_before_the_next_release() -> None:
    dp, timer = strategy(), Timer(interval="step")
    with pytest.raises(PrivacyConfigurationError, match=r"wall-clock budget"):
        quiet_trainer(strategy=dp, max_steps=6, callbacks=[timer, BudgetFromAConstant(timer)]).fit(
            Classifier(), loader(64))
    assert dp.private_step.ledger.steps == 0


def test_max_steps_and_a_measuring_timer_train() -> None:
    dp, timer = strategy(), Timer(interval="step")
    trainer = quiet_trainer(strategy=dp, max_steps=3, callbacks=[timer])
    trainer.fit(Classifier(), loader(64))
    assert dp.private_step.ledger.steps == 3 and trainer.global_step == 3
    assert timer.time_elapsed("train") > 0


def test_max_epochs_trains() -> None:
    dp = strategy()
    quiet_trainer(strategy=dp, max_epochs=1).fit(Classifier(), loader(64))
    assert dp.private_step.ledger.steps > 0
