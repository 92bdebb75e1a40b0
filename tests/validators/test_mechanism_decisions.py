"""σ and C are decisions (rule 3 of docs/release_boundary.md; validators/mechanism_settings.mechanism_settings): a clipping
bound set from the batch's losses, a noise multiplier lowered once the training loss crosses a threshold — in the
step, at a batch's end, at an epoch's end — steer the next release by un-noised data and are refused when made; σ or C
set from the step count or the epoch number, and a policy that moves C privately (AdaptiveClipping), train."""

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
from lightning_dp.clipping import AdaptiveClipping  # noqa: E402


def _fit(module: pl.LightningModule, callbacks: list, steps: int | None = None, epochs: int | None = None,
         **strategy_kwargs: Any) -> pl.Trainer:
    limits = {"max_steps": steps} if steps is not None else {"max_epochs": epochs}
    trainer = quiet_trainer(strategy=strategy(**strategy_kwargs), callbacks=callbacks, **limits)
    trainer.fit(module, loader(64))
    return trainer


class ClipFromTheLoss(pl.Callback):
    """Hand-rolled 'adaptive' clipping: C follows the batch's loss once it is low (not at the first step)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = float(outputs["loss"])
        if loss < 0.6:
            trainer.strategy.private_step.max_grad_norm = max(0.1, loss)


def test_a_clipping_bound_set_from_the_batch_loss_at_batch_end_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"privacy clipping.*"):
        _fit(Classifier(), [ClipFromTheLoss()], steps=60)


class LessNoiseWhenLow(pl.Callback):
    """'Noise annealing' keyed on the training loss."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if float(outputs["loss"]) < 0.6:
            trainer.strategy.private_step.noise_multiplier = 0.5


def test_a_noise_multiplier_lowered_when_the_loss_crosses_a_threshold_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"privacy noise_multiplier"):
        _fit(Classifier(), [LessNoiseWhenLow()], steps=60)


class ClipInTheStep(Classifier):
    """Sets C from the batch's own per-example losses inside training_step, at a step no first-step replay reaches:
    that step would clip, noise and release with it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        if self.global_step == 20:
            self.trainer.strategy.private_step.max_grad_norm = float(losses.detach().median().clamp(0.1, 10))
        return losses.mean()


@pytest.mark.parametrize("verify", ["sampled", "every_step"])
def test_a_clipping_bound_set_in_training_step_is_refused_before_that_step_releases(verify: str) -> None:
    """``every_step``: a batch check at the step that writes C ran training_step on the batch first, and the write
    it left was taken for the step's starting state (the release went through; seen as a load-dependent flake under
    ``sampled``)."""
    module = ClipInTheStep()
    with pytest.raises(PrivacyConfigurationError, match=r"within the step.*privacy clipping"):
        _fit(module, [], steps=24, verify=verify)
    assert module.trainer.strategy.private_step.ledger.steps == 20  # step 20 released nothing


class MoveThePolicyInTheStep(Classifier):
    """Moves the adaptive policy's own bound from the batch's losses inside training_step (not by its private rule)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        if self.global_step == 20:
            self.trainer.strategy.private_step.clipping._bound = float(losses.detach().median().clamp(0.1, 10))
        return losses.mean()


@pytest.mark.parametrize("verify", ["sampled", "every_step"])
def test_an_adaptive_policy_moved_in_training_step_is_refused_before_that_step_releases(verify: str) -> None:
    module = MoveThePolicyInTheStep()
    with pytest.raises(PrivacyConfigurationError, match=r"within the step.*privacy clipping state"):
        _fit(module, [], steps=24, max_grad_norm=None, clipping=AdaptiveClipping(initial_norm=1.0), verify=verify)
    assert module.trainer.strategy.private_step.ledger.steps == 20  # step 20 released nothing


class DecideInTheStep(Classifier):
    """Sets σ, or stops training, from the batch's own losses inside training_step at step 20 (no first-step replay
    reaches it)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        if self.global_step == 20:
            median = float(losses.detach().median())
            if self.what == "noise_multiplier":
                self.trainer.strategy.private_step.noise_multiplier = 1.0 + median
            else:
                self.trainer.should_stop = median < 100.0
        return losses.mean()


@pytest.mark.parametrize("verify", ["sampled", "every_step"])
@pytest.mark.parametrize("what, named", [("noise_multiplier", "privacy noise_multiplier"),
                                         ("should_stop", "trainer should_stop")])
def test_a_sigma_or_a_stop_set_in_training_step_is_refused_before_that_step_releases(verify: str, what: str,
                                                                                    named: str) -> None:
    """The siblings of C above: under ``every_step`` the batch check at step 20 runs training_step on the batch
    first and does not put σ or ``trainer.should_stop`` back; taken after it, the step's starting state would hold
    the write and the release go through."""
    module = DecideInTheStep(what)
    with pytest.raises(PrivacyConfigurationError, match=r"within the step.*" + named):
        _fit(module, [], steps=24, verify=verify)
    assert module.trainer.strategy.private_step.ledger.steps == 20  # step 20 released nothing


class LoggedLoss(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss


class ClipFromTheEpochLoss(pl.Callback):
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        x, y = trainer.train_dataloader.dataset.tensors
        with torch.no_grad():
            loss = float(F.cross_entropy(pl_module(x), y))
        if trainer.current_epoch >= 1:
            trainer.strategy.private_step.max_grad_norm = max(0.1, loss)


def test_a_clipping_bound_set_from_the_training_set_at_epoch_end_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"privacy clipping"):
        _fit(Classifier(), [ClipFromTheEpochLoss()], epochs=4)


class NoiseByEpoch(pl.Callback):
    """A public schedule: σ from the epoch number only."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.private_step.noise_multiplier = 1.0 + 0.5 * (trainer.current_epoch + 1)


def test_a_noise_schedule_from_the_epoch_number_trains_and_is_charged() -> None:
    trainer = _fit(Classifier(), [NoiseByEpoch()], epochs=3)
    sigmas = {entry.noise_multiplier for entry in trainer.strategy.private_step.ledger.entries}
    assert sigmas == {1.0, 1.5, 2.0}


class ClipOnce(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.private_step.max_grad_norm = 0.5


def test_a_constant_bound_set_at_train_start_trains() -> None:
    trainer = _fit(Classifier(), [ClipOnce()], steps=6)
    assert trainer.strategy.private_step.max_grad_norm == 0.5


class RateByStep(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = 1.0 / (1 + trainer.global_step)


def test_adaptive_clipping_moves_c_privately_beside_a_batch_end_hook() -> None:
    trainer = _fit(Classifier(), [RateByStep()], steps=12, max_grad_norm=None,
                   clipping=AdaptiveClipping(initial_norm=1.0))
    assert trainer.strategy.private_step.ledger.steps == 12  # nothing was refused
    assert trainer.strategy.private_step.max_grad_norm != 1.0  # C moved with the releases


class QuantileFromTheLoss(pl.Callback):
    """'Clip harder while the loss is high': the adaptive policy's target quantile set from the batch's loss."""

    def __init__(self, policy: AdaptiveClipping, setting: str, high: float, low: float) -> None:
        self.policy, self.setting, self.high, self.low = policy, setting, high, low

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        setattr(self.policy, self.setting, self.high if float(outputs["loss"]) > 0.7 else self.low)


@pytest.mark.parametrize("setting, high, low", [("target_quantile", 0.9, 0.5), ("learning_rate", 1.0, 0.05)])
def test_an_adaptive_policys_setting_from_the_batch_loss_is_refused(setting: str, high: float, low: float) -> None:
    """The policy is judged by its configuration too (``ClippingPolicy.settings``): its own moves of C are its
    releases', a target quantile or a learning rate set from the loss are the data's."""
    policy = AdaptiveClipping(initial_norm=1.0)
    with pytest.raises(PrivacyConfigurationError, match=r"privacy clipping"):
        _fit(Classifier(), [QuantileFromTheLoss(policy, setting, high, low)], steps=12, max_grad_norm=None,
             clipping=policy)


class QuantileOnce(pl.Callback):
    def __init__(self, policy: AdaptiveClipping) -> None:
        self.policy = policy

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.policy.target_quantile = 0.7


def test_an_adaptive_policys_setting_from_a_constant_trains() -> None:
    policy = AdaptiveClipping(initial_norm=1.0)
    trainer = _fit(Classifier(), [QuantileOnce(policy)], steps=6, max_grad_norm=None, clipping=policy)
    assert trainer.strategy.private_step.ledger.steps == 6 and policy.target_quantile == 0.7


class QuantileAtTheSecondBatch(pl.Callback):
    """The quantile set from the loss at batch_idx 1 only (the first step's replays run batch_idx 0 and the epoch's
    last): the batch-end window judges it, each run from the policy as the window opened."""

    def __init__(self, policy: AdaptiveClipping) -> None:
        self.policy = policy

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx == 1 and float(outputs["loss"]) > 0.01:
            self.policy.target_quantile = 0.9


def test_an_adaptive_policys_setting_made_in_a_later_window_is_refused_when_made() -> None:
    policy = AdaptiveClipping(initial_norm=1.0)
    with pytest.raises(PrivacyConfigurationError, match=r"at the end of step 2 .*privacy clipping"):
        _fit(Classifier(), [QuantileAtTheSecondBatch(policy)], steps=6, max_grad_norm=None, clipping=policy)
