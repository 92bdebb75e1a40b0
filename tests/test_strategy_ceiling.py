"""target_epsilon is a ceiling at target_delta: no plan, resume or schedule makes a run spend more (issue 23)."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

import lightning_dp._strategy_glue as strategy_module  # the strategies' shared hooks log from here
from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.accounting import ledger_epsilon

EPS, DELTA = 2.0, 1e-5


def _target_strategy() -> DPStrategy:
    return DPStrategy(target_epsilon=EPS, target_delta=DELTA, max_grad_norm=1.0)


def test_lightning_s_implicit_1000_epochs_is_not_a_plan():
    trainer = quiet_trainer(strategy=_target_strategy())  # neither max_epochs nor max_steps
    with pytest.raises(PrivacyConfigurationError, match="max_epochs=1000"):
        trainer.fit(TinyClassifier(), make_loader(n=100, batch_size=10))


def test_a_resumed_longer_plan_recalibrates_sigma_and_stays_within_the_target(tmp_path, monkeypatch):
    first = _target_strategy()
    quiet_trainer(strategy=first, max_steps=10, enable_checkpointing=True,
                  callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(
        TinyClassifier(), make_loader(n=100, batch_size=10))
    assert ledger_epsilon(first.ledger, DELTA) == pytest.approx(EPS, rel=2e-3)
    resumed = _target_strategy()
    said: list[str] = []  # the strategy's log lines (other tests may silence Lightning's loggers)
    monkeypatch.setattr(strategy_module, "rank_zero_info", lambda message, *a, **k: said.append(message))
    quiet_trainer(strategy=resumed, max_steps=30).fit(TinyClassifier(), make_loader(n=100, batch_size=10),
                                                      ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.ledger.steps == 30
    spent = ledger_epsilon(resumed.ledger, DELTA)
    assert spent <= EPS and spent > 0.99 * EPS  # within the target, the remaining budget used
    assert resumed.noise_multiplier > first.noise_multiplier
    assert sum("σ recalibrated" in line for line in said) == 1


class _AdamClassifier(TinyClassifier):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class _LowerSigma(Callback):
    """A schedule bug: σ lowered by 20 % after calibration (the plan would then spend far more than the target)."""

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.private_step.noise_multiplier *= 0.8


@pytest.mark.parametrize("variant", [None, "bias_corrected"])
def test_the_ceiling_stops_a_run_before_any_release_beyond_the_target(variant):
    from lightning_dp import AdamVariant

    strategy = _target_strategy()
    callbacks = [_LowerSigma()] + ([AdamVariant(variant)] if variant else [])
    module = _AdamClassifier() if variant else TinyClassifier()
    with pytest.warns(UserWarning, match="would spend more than target_epsilon"):
        quiet_trainer(strategy=strategy, max_steps=40, callbacks=callbacks).fit(
            module, make_loader(n=100, batch_size=10))
    assert 0 < strategy.ledger.steps < 40
    assert ledger_epsilon(strategy.ledger, DELTA) <= EPS


def test_without_the_ceiling_the_same_bug_would_overspend():
    """Guards the test above: the lowered σ over the full plan is far above the target."""
    strategy = _target_strategy()
    trainer = quiet_trainer(strategy=strategy, max_steps=1)
    trainer.fit(TinyClassifier(), make_loader(n=100, batch_size=10))
    from lightning_dp.accounting import epsilon

    assert epsilon(strategy.noise_multiplier * 0.8, strategy.sample_rate, 40, DELTA) > 1.2 * EPS


class _SummedLoss(TinyClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y, reduction="sum")


def test_a_summed_loss_is_caught_at_the_first_step_naming_the_fix():
    with pytest.raises(PrivacyConfigurationError, match="reduction='mean'"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=2).fit(
            _SummedLoss(), make_loader(n=100, batch_size=10))


def test_the_noiseless_baseline_with_a_target_trains_its_whole_plan(tmp_path):
    """The non-private research baseline (ε = ∞ from its first release, with a warning) has no guarantee
    for the ceiling to protect: it is not cut off, fresh or resumed."""
    from lightning_dp import AdamVariant
    from lightning_dp.optim import NotPrivateWarning

    first = _target_strategy()
    with pytest.warns(NotPrivateWarning):
        quiet_trainer(strategy=first, max_steps=6, enable_checkpointing=True, callbacks=[
            AdamVariant("noiseless"), ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(
            _AdamClassifier(), make_loader(n=100, batch_size=10))
    resumed = _target_strategy()
    with pytest.warns(NotPrivateWarning):
        quiet_trainer(strategy=resumed, max_steps=12, callbacks=[AdamVariant("noiseless")]).fit(
            _AdamClassifier(), make_loader(n=100, batch_size=10), ckpt_path=str(tmp_path / "last.ckpt"))
    assert first.ledger.steps == 6 and resumed.ledger.steps == 12 and not resumed.ledger.is_private
