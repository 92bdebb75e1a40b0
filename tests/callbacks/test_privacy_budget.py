"""PrivacyBudget inside a Lightning run with DPStrategy: logging, stop-before-exceed, resume."""

from __future__ import annotations

import math
import warnings

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.accounting import PrivacyLedger, epsilon, ledger_epsilon
from lightning_dp.callbacks.privacy_budget import PrivacyBudget, default_delta
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.strategy import DPStrategy

N, BATCH, SIGMA, DELTA = 64, 8, 1.0, 1e-5
Q = BATCH / N


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=BATCH)


def _trainer(callbacks, max_steps, tmp_path=None, sigma=SIGMA, strategy=None, **kw) -> pl.Trainer:
    kw.setdefault("logger", False)
    kw.setdefault("enable_progress_bar", False)
    return pl.Trainer(
        strategy=strategy if strategy is not None else DPStrategy(noise_multiplier=sigma, max_grad_norm=1.0,
                                                                  public_state=["Seen"]),  # the test's observer
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks,
        enable_checkpointing=False, enable_model_summary=False,
        default_root_dir=tmp_path, **kw,
    )


def _fit(trainer, ckpt_path=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), _loader(), ckpt_path=ckpt_path)
    return trainer


def _target_between(k: int) -> float:
    """A target with ε(k steps) ≤ target < ε(k + 1 steps)."""
    lo, hi = epsilon(SIGMA, Q, k, DELTA), epsilon(SIGMA, Q, k + 1, DELTA)
    assert lo < hi
    return 0.5 * (lo + hi)


class Seen(Callback):
    def __init__(self) -> None:
        self.eps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.eps.append(float(trainer.callback_metrics["privacy/epsilon"]))


class Capture(Logger):
    name, version, experiment = "capture", 0, None

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []
        self.steps: list[int] = []

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))
        self.steps.append(step)

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_logs_epsilon_and_parameters():
    seen, capture = Seen(), Capture()
    budget = PrivacyBudget(delta=DELTA, log_every_n_steps=1)
    trainer = _fit(_trainer([budget, seen], max_steps=5, logger=capture))
    rows = [r for r in capture.rows if "privacy/steps" in r]
    assert [r["privacy/steps"] for r in rows] == [1, 2, 3, 4, 5]
    assert seen.eps == sorted(seen.eps) and seen.eps[0] > 0
    assert seen.eps[-1] == pytest.approx(epsilon(SIGMA, Q, 5, DELTA), rel=1e-6)
    assert budget.epsilon == pytest.approx(ledger_epsilon(trainer.strategy.ledger, DELTA), rel=1e-12)
    last = rows[-1]
    assert last["privacy/epsilon"] == pytest.approx(seen.eps[-1], rel=1e-6)
    assert last["privacy/delta"] == pytest.approx(DELTA)
    assert last["privacy/noise_multiplier"] == pytest.approx(SIGMA)
    assert last["privacy/sample_rate"] == pytest.approx(Q)
    assert "privacy/epsilon" in trainer.progress_bar_metrics


def test_logging_period_defaults_to_the_trainers():
    capture = Capture()
    _fit(_trainer([PrivacyBudget(delta=DELTA)], max_steps=7, logger=capture, log_every_n_steps=3))
    assert [r["privacy/steps"] for r in capture.rows if "privacy/steps" in r] == [1, 3, 6]


@pytest.mark.parametrize("boundary", [1, 6])
def test_stops_at_the_exact_boundary_step(boundary):
    budget = PrivacyBudget(target_epsilon=_target_between(boundary), delta=DELTA)
    trainer = _fit(_trainer([budget], max_steps=50))
    assert trainer.strategy.ledger.steps == boundary == trainer.global_step
    assert budget.epsilon <= budget.target_epsilon


def test_budget_too_small_for_one_step_fails_before_any_step():
    trainer = _trainer([PrivacyBudget(target_epsilon=0.5 * epsilon(SIGMA, Q, 1, DELTA), delta=DELTA)], max_steps=5)
    with pytest.raises(ValueError, match="one step"):
        _fit(trainer)
    assert trainer.strategy.ledger.steps == 0


def test_resume_continues_the_count_and_stops_at_the_same_step(tmp_path):
    target = _target_between(9)
    first = _fit(_trainer([PrivacyBudget(target_epsilon=target, delta=DELTA)], max_steps=4, tmp_path=tmp_path))
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    budget = PrivacyBudget(target_epsilon=target, delta=DELTA)
    resumed = _fit(_trainer([budget], max_steps=50, tmp_path=tmp_path), ckpt_path=str(ckpt))
    assert resumed.strategy.ledger.steps == 9 == resumed.global_step
    assert budget.epsilon == pytest.approx(epsilon(SIGMA, Q, 9, DELTA), rel=1e-12)
    # resuming a spent budget takes no further step
    resumed.save_checkpoint(tmp_path / "spent.ckpt")
    again = _fit(_trainer([PrivacyBudget(target_epsilon=target, delta=DELTA)], max_steps=60, tmp_path=tmp_path),
                 ckpt_path=str(tmp_path / "spent.ckpt"))
    assert again.strategy.ledger.steps == 9


def test_default_delta_is_announced(caplog):
    budget = PrivacyBudget()
    with caplog.at_level("INFO"):
        _fit(_trainer([budget], max_steps=2))
    assert budget.delta == pytest.approx(default_delta(N)) and budget.delta < 1 / N
    assert "1/N^1.1" in caplog.text


def test_refuses_a_strategy_without_ledger():
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[PrivacyBudget(delta=DELTA)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="DPStrategy"):
        _fit(trainer)


class FakeStrategy:
    def __init__(self) -> None:
        self.ledger, self.noise_multiplier, self.sample_rate, self.num_samples = PrivacyLedger(), SIGMA, Q, N


class FakeTrainer:
    def __init__(self) -> None:
        self.strategy, self.should_stop, self.loggers, self.global_step = FakeStrategy(), False, [], 0
        self.log_every_n_steps = 1


class NullModule:
    def log(self, *a, **k):
        pass

    def log_dict(self, *a, **k):
        pass


def test_non_private_ledger_reports_infinity_with_one_warning():
    trainer, budget = FakeTrainer(), PrivacyBudget(delta=DELTA)
    budget.on_train_start(trainer, NullModule())
    trainer.strategy.ledger.record(SIGMA, Q, private=False)
    with pytest.warns(UserWarning, match="NON-PRIVATE") as record:
        budget.on_train_batch_end(trainer, NullModule(), None, None, 0)
        trainer.strategy.ledger.record(SIGMA, Q, private=False)
        budget.on_train_batch_end(trainer, NullModule(), None, None, 1)
    assert budget.epsilon == math.inf
    assert sum("NON-PRIVATE" in str(w.message) for w in record) == 1


@pytest.mark.parametrize("curve", ["exact", "auto"])
def test_changing_sigma_every_step_is_accounted_incrementally(curve):
    trainer, budget = FakeTrainer(), PrivacyBudget(delta=DELTA, rdp_curve=curve)
    budget.on_train_start(trainer, NullModule())
    for t in range(12):
        trainer.strategy.ledger.record(1.0 + 0.05 * t, Q)
        budget.on_train_batch_end(trainer, NullModule(), None, None, t)
    exact = ledger_epsilon(trainer.strategy.ledger, DELTA)
    if curve == "exact":
        assert budget.epsilon == pytest.approx(exact, rel=1e-12)
    else:  # 4 exact (σ, q), then the chord bound on a 0.5 % grid: an upper bound within 3 %
        assert exact < budget.epsilon < 1.03 * exact


@pytest.mark.slow
def test_tighter_stop_accountant_goes_further_but_stays_within_target():
    """stop_accountant="prv": RDP refuses first, PRV still certifies some more steps."""
    target = _target_between(30)
    steps = {}
    for stop in ("rdp", "prv"):
        trainer, budget = FakeTrainer(), PrivacyBudget(target_epsilon=target, delta=DELTA, stop_accountant=stop)
        budget.on_train_start(trainer, NullModule())
        while not trainer.should_stop:
            trainer.strategy.ledger.record(SIGMA, Q)
            budget.on_train_batch_end(trainer, NullModule(), None, None, 0)
        steps[stop] = trainer.strategy.ledger.steps
        assert ledger_epsilon(trainer.strategy.ledger, DELTA, stop) <= target
    assert steps["rdp"] == 30 and steps["prv"] > 30


@pytest.mark.parametrize("kwargs", [dict(target_epsilon=-1.0), dict(delta=1.0), dict(accountant="x"),
                                    dict(every_n_steps=0), dict(stop_accountant="y")])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        PrivacyBudget(**kwargs)


# ------------------------------------------ δ and the accountant: the strategy's (issue 22, item 2)
def _target_strategy(**kwargs) -> DPStrategy:
    return DPStrategy(target_epsilon=3.0, target_delta=DELTA, max_grad_norm=1.0, **kwargs)


def test_delta_comes_from_the_strategy(caplog):
    """The reproduced bug: PrivacyBudget() under DPStrategy(target_epsilon=3, target_delta=1e-5)
    reported ε at a silent δ = N^-1.1 (ε ≈ 2 here); at the strategy's δ the ledger is ε = 3."""
    budget = PrivacyBudget()
    with caplog.at_level("INFO"):
        trainer = _fit(_trainer([budget], max_steps=6, strategy=_target_strategy()))
    assert budget.delta == DELTA and budget.accountant == "rdp"
    spent = ledger_epsilon(trainer.strategy.ledger, DELTA)
    assert spent == pytest.approx(3.0, abs=0.02)  # σ was calibrated for exactly these 6 steps
    assert budget.epsilon == pytest.approx(spent, rel=1e-9)
    assert "δ = 1e-05 (the strategy's target_delta)" in caplog.text


def test_accountant_comes_from_the_strategy():
    budget = PrivacyBudget(delta=DELTA)
    strategy = DPStrategy(noise_multiplier=SIGMA, max_grad_norm=1.0, accountant="prv")
    trainer = _fit(_trainer([budget], max_steps=4, strategy=strategy))
    assert budget.accountant == "prv"
    expected = ledger_epsilon(trainer.strategy.ledger, DELTA, "prv")
    assert expected < 0.95 * ledger_epsilon(trainer.strategy.ledger, DELTA, "rdp")  # the two are told apart
    assert budget.epsilon == pytest.approx(expected, rel=1e-9)
    assert float(trainer.callback_metrics["privacy/epsilon"]) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("given, named", [(dict(delta=1e-6), ("delta=1e-06", "target_delta=1e-05")),
                                          (dict(accountant="pld"), ("accountant='pld'", "accountant='rdp'"))])
def test_a_different_delta_or_accountant_is_refused_naming_both(given, named):
    trainer = _trainer([PrivacyBudget(**given)], max_steps=3, strategy=_target_strategy())
    with pytest.raises(PrivacyConfigurationError) as error:
        _fit(trainer)
    message = str(error.value)
    assert all(text in message for text in named) and "allow_mismatch=True" in message, message
    assert trainer.strategy.ledger.steps == 0  # refused at setup, before any step


def test_a_mismatch_marked_as_meant_is_used_and_named_in_the_log(caplog):
    budget = PrivacyBudget(delta=1e-6, allow_mismatch=True)
    with caplog.at_level("INFO"):
        trainer = _fit(_trainer([budget], max_steps=3, strategy=_target_strategy()))
    assert budget.delta == 1e-6
    assert budget.epsilon == pytest.approx(ledger_epsilon(trainer.strategy.ledger, 1e-6), rel=1e-9)
    assert "allow_mismatch=True: the strategy's target_delta is 1e-05" in caplog.text


def test_without_target_delta_the_given_delta_is_used_and_named(caplog):
    budget = PrivacyBudget(delta=DELTA)
    with caplog.at_level("INFO"):
        _fit(_trainer([budget], max_steps=2))
    assert budget.delta == DELTA
    assert "δ = 1e-05 (delta (the strategy has no target_delta))" in caplog.text


def test_epsilon_is_written_once_per_logged_step():
    """Lightning's logger connector and the callback both wrote privacy/epsilon (twice per step)."""
    capture = Capture()
    trainer = _fit(_trainer([PrivacyBudget(delta=DELTA)], max_steps=5, logger=capture, log_every_n_steps=2))
    written = [step for step, row in zip(capture.steps, capture.rows) if "privacy/epsilon" in row]
    assert written == [1, 2, 4, 5]  # 1 and the due steps; 5: the end of training (not logged before)
    final = [row["privacy/epsilon"] for row in capture.rows if "privacy/epsilon" in row][-1]
    assert final == pytest.approx(ledger_epsilon(trainer.strategy.ledger, DELTA), rel=1e-12)


# ------------------------------------------------ ε shown is ε spent (issue 23, item 3)
@pytest.mark.parametrize("length", [dict(max_steps=11), dict(max_steps=-1, max_epochs=2)])
def test_epsilon_shown_at_the_end_is_the_ledgers(length):
    """log_every_n_steps (50) > the run's steps: the last logged ε is step 1's, the end must show
    the ledger's (stopped by max_steps mid-epoch, or by max_epochs)."""
    from pytorch_lightning.callbacks import TQDMProgressBar
    from tqdm import tqdm

    bar = TQDMProgressBar()
    trainer = _fit(_trainer([PrivacyBudget(), bar], strategy=_target_strategy(), log_every_n_steps=50,
                            enable_progress_bar=True, **length))
    spent = ledger_epsilon(trainer.strategy.ledger, DELTA)
    assert trainer.strategy.ledger.steps == (11 if length["max_steps"] == 11 else 16)
    assert spent == pytest.approx(3.0, abs=0.02)
    assert float(trainer.callback_metrics["privacy/epsilon"]) == pytest.approx(spent, rel=1e-12)
    assert trainer.progress_bar_metrics["privacy/epsilon"] == pytest.approx(spent, rel=1e-12)
    assert f"privacy/epsilon={tqdm.format_num(spent)}" in bar.train_progress_bar.postfix  # what was on screen


# ------------------------------------ the PLD/PRV stop path, small and fast (issue 22, item 5)
@pytest.mark.parametrize("stop", ["pld", "prv"])
def test_tighter_stop_accountant_takes_exactly_the_steps_it_certifies(stop):
    """The default-suite twin of the slow test above: without subsampling (q = 1) a PLD/PRV call
    takes ~0.1 s. RDP refuses after k steps; the tighter accountant certifies a few more, and the
    run ends at its exact boundary, reporting ε by that accountant."""
    sigma, q, k = 8.0, 1.0, 16
    target = 0.5 * (epsilon(sigma, q, k, DELTA) + epsilon(sigma, q, k + 1, DELTA))
    trainer = FakeTrainer()
    trainer.strategy.noise_multiplier, trainer.strategy.sample_rate = sigma, q
    budget = PrivacyBudget(target_epsilon=target, delta=DELTA, accountant=stop, stop_accountant=stop)
    budget.on_train_start(trainer, NullModule())
    while not trainer.should_stop and trainer.global_step < 100:
        trainer.strategy.ledger.record(sigma, q)
        trainer.global_step += 1
        budget.on_train_batch_end(trainer, NullModule(), None, None, 0)
    steps = trainer.strategy.ledger.steps
    assert steps > k  # RDP alone stops at k
    assert ledger_epsilon(trainer.strategy.ledger, DELTA, stop) <= target < epsilon(sigma, q, steps + 1, DELTA, stop)
    budget.on_train_end(trainer, NullModule())
    assert budget.epsilon == pytest.approx(ledger_epsilon(trainer.strategy.ledger, DELTA, stop), rel=1e-12)


# ------------------------------------- the stop is said, and decided with the released σ (issues 34, 35)
def _fit_recording_warnings(trainer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Tiny(), _loader())
    return [str(w.message) for w in caught]


def test_a_budget_stop_is_said_once_with_epsilon_delta_and_the_step():
    """The README Quickstart stopped at step 137 of 155 without a line. min_steps makes Lightning go on after the
    stop: every later step is refused at its release (nothing spent), and the stop is still said once."""
    trainer = _trainer([PrivacyBudget(target_epsilon=_target_between(6), delta=DELTA)], max_steps=50, min_steps=9)
    said = [m for m in _fit_recording_warnings(trainer) if "training stops" in m]
    assert len(said) == 1, said
    assert "PrivacyBudget: training stops after step 6" in said[0] and "δ = 1e-05" in said[0]
    assert f"ε = {epsilon(SIGMA, Q, 6, DELTA):.4g} spent" in said[0]
    assert trainer.strategy.ledger.steps == 6  # min_steps does not buy releases past the budget


class LowerSigmaBefore(Callback):
    """A σ schedule that lowers σ right before step ``at``, after PrivacyBudget checked the step before."""

    def __init__(self, at: int, sigma: float) -> None:
        self.at, self.sigma = at, sigma

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            trainer.strategy.private_step.noise_multiplier = self.sigma


def test_the_stop_is_decided_with_the_sigma_of_the_step_being_released():
    """Issue 34, class 7: the check after step 5 allowed step 6 at σ = 1; σ = 0.5 was set before its release,
    which then spent past the target. The release's own σ decides now."""
    k, low = 5, 0.5
    target = epsilon(SIGMA, Q, k + 1, DELTA) * (1 + 1e-6)
    from lightning_dp.accounting import LedgerEntry

    assert ledger_epsilon((LedgerEntry(SIGMA, Q, k), LedgerEntry(low, Q, 1)), DELTA) > target  # it would overspend
    trainer = _trainer([PrivacyBudget(target_epsilon=target, delta=DELTA), LowerSigmaBefore(k, low)], max_steps=20)
    said = [m for m in _fit_recording_warnings(trainer) if "training stops" in m]
    assert trainer.strategy.ledger.steps == k
    assert ledger_epsilon(trainer.strategy.ledger, DELTA) <= target
    assert len(said) == 1 and f"step {k}" in said[0] and "σ = 0.5" in said[0] and "PrivacyBudget's" in said[0]
