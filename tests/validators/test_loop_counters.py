"""The number of releases steered through the fit loop's own counters (zoo36 T19-T21): a batch-end hook that moves
``global_step``'s counter, cuts ``fit_loop.max_batches``, ends the epoch through the batch progress, or raises
``KeyboardInterrupt`` once the batch's label rate is high decides how many releases the fit makes from un-noised
data. The decision windows (validators/decisions.py) and the replays compare the loop's counters
(validators/loop_counters.py) and run the hooks again on the batch exchanged: refused. The same writes made from the
step count, and Lightning's own stops (EarlyStopping on a validation metric, a Timer, limit_train_batches, max_epochs),
train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import EarlyStopping, Timer
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torch.set_num_threads(1)


def labelled(n: int = 64, seed: int = 0) -> TensorDataset:
    """Features and labels, about nine in ten labels 1: every batch's label rate is high, its exchange's low."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), (torch.rand(n, generator=g) < 0.9).long())


def loader(n: int = 64) -> DataLoader:
    return DataLoader(labelled(n), batch_size=16)


def rate(batch: Any) -> float:
    return float(batch[1].float().mean()) if len(batch[1]) else 0.0


class Validated(Classifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))


def fit(model: pl.LightningModule, callbacks: Any = (), **trainer_kwargs: Any) -> Any:
    dp = strategy()
    trainer_kwargs.setdefault("max_steps", 8)
    quiet_trainer(strategy=dp, callbacks=list(callbacks), **trainer_kwargs).fit(model, loader())
    return dp


class StepsFromRate(Classifier):
    """zoo36 T21: five optimizer steps counted at once when the batch's label rate is high (max_steps sooner)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1 and rate(batch) > 0.55:
            self.trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed += 5


class BatchesFromRate(Classifier):
    """zoo36 T20 (max_batches only): the epoch cut to three batches when the batch's label rate is high."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1 and rate(batch) > 0.55:
            self.trainer.fit_loop.max_batches = 3


class LastBatchFromRate(Classifier):
    """The epoch ended through the batch progress when the batch's label rate is high."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1 and rate(batch) > 0.55:
            self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True


class StepsFromRateAtStart(Classifier):
    """T21 at a batch's start: the counter moved before the step, judged by the batch-start replays."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1 and rate(batch) > 0.55:
            self.trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed += 5


class InterruptFromRate(Classifier):
    """zoo36 T19: a KeyboardInterrupt once the batch's label rate is high (Lightning ends the fit gracefully)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step >= 3 and rate(batch) > 0.55:
            raise KeyboardInterrupt


@pytest.mark.parametrize("model, names", [(StepsFromRate, "trainer optimizer steps"),
                                          (BatchesFromRate, "trainer fit_loop.max_batches"),
                                          (LastBatchFromRate, "trainer batch progress")])
def test_the_loops_counters_written_from_the_batch_are_refused(model: type, names: str) -> None:
    with pytest.raises(PrivacyConfigurationError, match=rf"at the end of step 2 \(on_train_batch_end\).*{names}"):
        fit(model(), max_steps=-1, max_epochs=2)


def test_the_step_counter_written_from_the_batch_as_it_starts_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"in on_train_batch_start, from the batch.*optimizer steps"):
        fit(StepsFromRateAtStart(), max_steps=-1, max_epochs=2)


def test_a_keyboard_interrupt_raised_from_the_batch_is_refused_not_taken_for_the_users() -> None:
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, max_epochs=2)
    with pytest.raises(PrivacyConfigurationError, match=r"InterruptFromRate\.on_train_batch_end raised "
                                                        r"KeyboardInterrupt.*raised it on the data") as caught:
        trainer.fit(InterruptFromRate(), loader())
    assert isinstance(caught.value.__cause__, KeyboardInterrupt)


class InterruptInStep(Classifier):
    """A KeyboardInterrupt from training_step once the batch's label rate is high: the first step's probe runs it
    on a few of its records; that pass fails (refused), the fit is not ended as by the user's interrupt."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if rate(batch) > 0.55:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


def test_a_keyboard_interrupt_in_the_probes_pass_is_refused_not_an_interrupt() -> None:
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"probe ran training_step.*KeyboardInterrupt"):
        quiet_trainer(strategy=dp, max_steps=4).fit(InterruptInStep(), loader())
    assert dp.private_step.ledger.steps == 0


def test_a_keyboard_interrupt_in_a_run_again_is_a_failed_run_not_an_interrupt() -> None:
    from lightning_dp.replays.runs_again import InterruptedRun, interrupts_failed, run_once

    def interrupted() -> None:
        raise KeyboardInterrupt

    assert run_once(interrupted) is None  # a failed run again: the caller refuses what it cannot judge
    with pytest.raises(InterruptedRun) as caught, interrupts_failed():
        raise SystemExit(3)
    assert isinstance(caught.value.__cause__, SystemExit)


class CountersFromSteps(Classifier):
    """The same writes decided from the step count: alike on every data."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            self.trainer.fit_loop.max_batches = 3
        if self.trainer.global_step >= 5:
            self.trainer.should_stop = True


def test_the_loops_counters_written_from_the_step_count_train() -> None:
    assert fit(CountersFromSteps(), max_steps=-1, max_epochs=3).private_step.ledger.steps == 5


@pytest.mark.parametrize("callbacks, kwargs, steps", [
    ([], {"max_steps": -1, "max_epochs": 2}, 8),
    ([], {"limit_train_batches": 2, "max_steps": -1, "max_epochs": 2}, 4),
    ([Timer()], {}, 8),
    ([EarlyStopping("val_loss", patience=0, min_delta=1e9)], {"max_steps": -1, "max_epochs": 4}, 8),
])
def test_lightnings_own_stops_train(callbacks: list, kwargs: dict, steps: int) -> None:
    model = Validated()
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, callbacks=callbacks, **{"max_steps": 8, **kwargs})
    trainer.fit(model, loader(), DataLoader(labelled(32, seed=1), batch_size=16))
    assert dp.private_step.ledger.steps == steps
