"""A decision made by raising (zoo13 exc1): a user's hook raises an exception the script catches ("stop once the
training loss is good enough", the model kept) — the number of releases is then a threshold of one batch's un-noised
loss. The first step's replays (validators/step_replays.py) and the decision windows (validators/decisions.py, the
real run at a later step: DecisionWindows.on_exception) run the hooks again with the loss moved or the data
exchanged: raised on the data and not on other data, or the other way round, it is refused; a hook that raises alike
on every run keeps raising its own exception."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.privacy.noise import GaussianNoise  # noqa: E402

torch.set_num_threads(1)


class TargetReached(Exception):
    """The user's own stop signal, caught by their script."""


class StopWhenLow(pl.Callback):
    """Raises once the batch's training loss is under ``threshold`` (after ``after`` batch ends)."""

    def __init__(self, threshold: float, after: int = 0) -> None:
        self.threshold, self.after, self.ends = threshold, after, 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ends += 1  # a counter: alike on every data
        if self.ends > self.after and float(outputs["loss"]) < self.threshold:
            raise TargetReached(f"loss {float(outputs['loss']):.3f}")


def test_a_stop_raised_at_batch_end_once_the_loss_is_low_is_refused_before_any_release() -> None:
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"StopWhenLow\.on_train_batch_end raised TargetReached.*"
                                                        r"did not raise it on the data.*EarlyStopping"):
        quiet_trainer(strategy=dp, max_steps=8, callbacks=[StopWhenLow(0.05)]).fit(Classifier(), loader(64))
    assert dp.private_step.ledger.steps == 0


def test_a_stop_raised_at_batch_end_on_the_data_itself_is_refused_before_any_release() -> None:
    """The other way round: the loss is under the threshold already, the loss moved far is not."""
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"raised TargetReached.*raised it on the data, and not"):
        quiet_trainer(strategy=dp, max_steps=8, callbacks=[StopWhenLow(50.0)]).fit(Classifier(), loader(64))
    assert dp.private_step.ledger.steps == 0


def test_a_stop_raised_at_a_later_batch_end_is_refused_in_place_of_the_exception() -> None:
    """The first step's replays see only the counter (alike); the real run raises at the end of step 4: its window
    runs the hooks again, the loss moved far does not raise — refused, not the user's TargetReached."""
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"StopWhenLow\.on_train_batch_end raised TargetReached.*"
                                                        r"at the end of step 4.*raised it on the data") as caught:
        quiet_trainer(strategy=dp, max_steps=8, callbacks=[StopWhenLow(50.0, after=3)]).fit(Classifier(), loader(64))
    assert isinstance(caught.value.__cause__, TargetReached)
    assert dp.private_step.ledger.steps == 4


class StopAtBatchStart(pl.Callback):
    """Evaluates the batch's training loss as it starts and raises once it is under ``threshold``."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        x, y = batch
        with torch.no_grad():
            loss = float(F.cross_entropy(pl_module(x), y))
        if loss < self.threshold:
            raise TargetReached(f"loss {loss:.3f}")


@pytest.mark.parametrize("threshold, releases", [(0.72, 0), (0.6, 4)])
def test_a_stop_raised_at_batch_start_from_the_batch_loss_is_refused_in_place_of_the_exception(
        threshold: float, releases: int) -> None:
    """Raised as the first step starts (before any release), or as a later one does: the batch-start hooks run again
    on the batch exchanged do not raise. (The noise seeded: when the loss crosses 0.6, after four releases, depends
    on it.)"""
    dp = strategy(noise=GaussianNoise(seed=0))
    with pytest.raises(PrivacyConfigurationError, match=r"StopAtBatchStart\.on_train_batch_start raised "
                                                        r"TargetReached.*at the start of step") as caught:
        quiet_trainer(strategy=dp, max_steps=8, callbacks=[StopAtBatchStart(threshold)]).fit(Classifier(), loader(64))
    assert isinstance(caught.value.__cause__, TargetReached)
    assert dp.private_step.ledger.steps == releases


class Boom(Exception):
    pass


class AlwaysRaises(pl.Callback):
    """Raises at every batch end from the ``after``-th on, whatever the data: not a decision from it."""

    def __init__(self, after: int = 0) -> None:
        self.after, self.ends = after, 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ends += 1
        if self.ends > self.after:
            raise Boom("a bug in the user's callback")


@pytest.mark.parametrize("after", [0, 3])
def test_a_hook_that_raises_alike_on_every_run_keeps_its_own_exception(after: int) -> None:
    dp = strategy()
    with pytest.raises(Boom, match="a bug"):
        quiet_trainer(strategy=dp, max_steps=8, callbacks=[AlwaysRaises(after)]).fit(Classifier(), loader(64))
    assert dp.private_step.ledger.steps == after + 1  # as the loop runs: raised at the end of that step
