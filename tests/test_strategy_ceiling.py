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


def _finished_run(tmp_path, steps=10, crash_at=None) -> DPStrategy:
    """A target run planned for ``steps`` steps (stopped at ``crash_at``), its last checkpoint in ``tmp_path``."""
    first = _target_strategy()
    callbacks = [ModelCheckpoint(dirpath=tmp_path, save_last=True)] + ([_CrashAt(crash_at)] if crash_at else [])
    quiet_trainer(strategy=first, max_steps=steps, enable_checkpointing=True, callbacks=callbacks).fit(
        TinyClassifier(), make_loader(n=100, batch_size=10))
    return first


class _CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.should_stop = trainer.global_step >= self.step


def _resume(tmp_path, steps, **kwargs) -> DPStrategy:
    resumed = DPStrategy(target_epsilon=EPS, target_delta=DELTA, max_grad_norm=1.0, **kwargs)
    quiet_trainer(strategy=resumed, max_steps=steps).fit(TinyClassifier(), make_loader(n=100, batch_size=10),
                                                         ckpt_path=str(tmp_path / "last.ckpt"))
    return resumed


def test_a_finished_run_resumed_with_a_longer_plan_is_refused_before_training(tmp_path):
    """The resume trap (issue 35): the budget left buys no useful step; σ would rise ~1,400× (near-pure noise)."""
    first = _finished_run(tmp_path)
    assert ledger_epsilon(first.ledger, DELTA) == pytest.approx(EPS, rel=2e-3)
    with pytest.raises(PrivacyConfigurationError, match="near-pure noise") as error:
        _resume(tmp_path, 30)
    message = str(error.value)
    assert "is left" in message and "0 more step(s) at the run's σ" in message  # how much is left
    assert "stop here" in message and "target_epsilon=<larger>" in message and "resume_privacy='new'" in message
    assert "on_budget_short='recalibrate'" in message


def test_on_budget_short_recalibrate_trains_the_longer_plan_within_the_target(tmp_path, monkeypatch):
    first = _finished_run(tmp_path)
    said: list[str] = []  # the strategy's log lines (other tests may silence Lightning's loggers)
    monkeypatch.setattr(strategy_module, "rank_zero_info", lambda message, *a, **k: said.append(message))
    resumed = _resume(tmp_path, 30, on_budget_short="recalibrate")
    assert resumed.ledger.steps == 30
    spent = ledger_epsilon(resumed.ledger, DELTA)
    assert spent <= EPS and spent > 0.99 * EPS  # within the target, the remaining budget used
    assert resumed.noise_multiplier > 3 * first.noise_multiplier
    assert sum("σ recalibrated" in line and "on_budget_short='recalibrate'" in line for line in said) == 1


def test_a_crashed_run_resumed_with_a_somewhat_longer_plan_recalibrates_without_asking(tmp_path):
    """σ* within 3× σ_ref: a moderate rise is applied (logged), not refused."""
    first = _finished_run(tmp_path, steps=30, crash_at=10)
    resumed = _resume(tmp_path, 40)
    assert resumed.ledger.steps == 40
    assert first.noise_multiplier < resumed.noise_multiplier < 3 * first.noise_multiplier
    assert ledger_epsilon(resumed.ledger, DELTA) <= EPS


def test_on_budget_short_takes_only_its_two_values():
    with pytest.raises(ValueError, match="on_budget_short"):
        DPStrategy(target_epsilon=EPS, target_delta=DELTA, on_budget_short="ignore")


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


def test_the_ceilings_stop_is_said_once_with_epsilon_delta_and_the_step():
    """min_steps makes Lightning go on after the stop: the ceiling refuses every later step, and says so once."""
    import warnings

    strategy = _target_strategy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(strategy=strategy, max_steps=40, min_steps=40, callbacks=[_LowerSigma()]).fit(
            TinyClassifier(), make_loader(n=100, batch_size=10))
    said = [str(w.message) for w in caught if "training stops" in str(w.message)]
    assert len(said) == 1, said
    steps = strategy.ledger.steps
    assert f"training stops at step {steps}" in said[0] and "δ = 1e-05" in said[0]
    assert f"ε = {ledger_epsilon(strategy.ledger, DELTA):.4g} spent" in said[0]


def test_a_fast_dev_run_with_a_target_warns_that_it_spends_the_budget_and_the_next_fit_says_why():
    """qa12 b14/b15: fast_dev_run calibrated σ for its one step and spent the whole target ε; the real fit of the same
    module was then refused without naming the smoke run."""
    model = TinyClassifier()
    smoke = quiet_trainer(strategy=DPStrategy(target_epsilon=3.0, target_delta=1e-3, max_grad_norm=1.0), fast_dev_run=True)
    with pytest.warns(UserWarning, match=r"fast_dev_run with target_epsilon=3\.0: σ is calibrated for this 1-step"):
        smoke.fit(model, make_loader())
    assert smoke.strategy.ledger.steps == 1
    real = quiet_trainer(strategy=DPStrategy(target_epsilon=3.0, target_delta=1e-3, max_grad_norm=1.0), max_epochs=2)
    with pytest.raises(PrivacyConfigurationError, match="a fast_dev_run smoke test too"):
        real.fit(model, make_loader())


def test_a_fit_without_fast_dev_run_does_not_warn_of_it(recwarn):
    quiet_trainer(strategy=DPStrategy(target_epsilon=3.0, target_delta=1e-3, max_grad_norm=1.0), max_steps=2).fit(
        TinyClassifier(), make_loader())
    assert not [w for w in recwarn if "fast_dev_run" in str(w.message)]
