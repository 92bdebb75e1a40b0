"""The one ε ceiling (issue 36): every target of a run is an EpsilonCeiling over the step's ledger.

Each answer is held to an exact ε computation of the ledger plus the release asked about; the strategy's target and
a PrivacyBudget target on one run stop it at the tighter of the two; a release is judged with the step's own σ, q."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyBudget
from lightning_dp.accounting import LedgerEntry, PrivacyLedger, epsilon, ledger_epsilon
from lightning_dp.accounting.ceiling import EpsilonCeiling
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep

DELTA = 1e-5


def _exact(ledger: PrivacyLedger, sigma: float, q: float, accountant: str, rounds: int = 1) -> float:
    """ε of the ledger followed by ``rounds`` releases of (σ, q), composed afresh by ``accountant``."""
    return ledger_epsilon(ledger.entries + (LedgerEntry(sigma, q, rounds),), DELTA, accountant)


def _walk(ceiling: EpsilonCeiling, schedule, accountant: str, steps: int) -> list[bool]:
    """Ask the ceiling before each release of the schedule, record what it allows; every answer against exact ε."""
    answers = []
    for t in range(steps):
        sigma, q = schedule(t)
        exact = _exact(ceiling.ledger, sigma, q, accountant)
        allowed = ceiling.allows(sigma, q)
        if abs(exact - ceiling.target_epsilon) > 1e-9 * ceiling.target_epsilon:  # clear of rounding in the sums
            assert allowed == (exact <= ceiling.target_epsilon), (t, sigma, q, exact)
            assert (ceiling.refusal(sigma, q) is None) == allowed
        answers.append(allowed)
        if allowed:
            ceiling.ledger.record(sigma, q)
    return answers


def _rdp_schedule(t: int) -> tuple[float, float]:
    """σ and q change every step (more distinct (σ, q) than RunningRDP's exact keys: the chord bound would stop early),
    with cheaper steps after expensive ones, so that a refused release may be followed by an allowed one."""
    return 1.3 - 0.002 * t + (0.4 if t % 7 == 6 else 0.0), 0.01 * (1.0 + 0.05 * (t % 5))


def test_the_ceiling_refuses_exactly_the_releases_that_would_take_rdp_epsilon_past_the_target():
    ledger = PrivacyLedger()
    for t in range(200):
        ledger.record(*_rdp_schedule(t))
    spent = ledger_epsilon(ledger, DELTA)  # after step 200 of the schedule; step 200 would add ~0.0047, 202 ~0.0004
    target = spent + 0.2 * (_exact(ledger, *_rdp_schedule(200), "rdp") - spent)
    ceiling = EpsilonCeiling(target, DELTA, PrivacyLedger())
    answers = _walk(ceiling, _rdp_schedule, "rdp", 260)
    assert answers.index(False) == 200  # the first refusal: the first release past the target
    assert any(answers[201:])  # later, cheaper releases (σ + 0.4) still fit, and are allowed
    assert ledger_epsilon(ceiling.ledger, DELTA) <= target


def test_the_chord_bound_alone_would_have_stopped_the_same_schedule_early():
    """Guards the test above: PrivacyBudget's total (its default rdp_curve) is an upper bound that stops earlier."""
    from lightning_dp.accounting import RunningRDP

    ledger = PrivacyLedger()
    for t in range(200):
        ledger.record(*_rdp_schedule(t))
    target = ledger_epsilon(ledger, DELTA) * (1 + 1e-6)
    ceiling = EpsilonCeiling(target, DELTA, PrivacyLedger(), running=RunningRDP())
    answers = []
    for t in range(200):
        answers.append(ceiling.allows(*_rdp_schedule(t)))
        if answers[-1]:
            ceiling.ledger.record(*_rdp_schedule(t))
    assert not all(answers)


def _tight_schedule(t: int) -> tuple[float, float]:
    """No subsampling (q = 1: a PLD/PRV call takes ~0.1 s); σ changes after step 12 and again after 18."""
    return (8.0 if t < 12 else 7.0 if t < 18 else 10.0), 1.0


@pytest.mark.parametrize("accountant", ["pld", "prv"])
def test_a_pld_or_prv_ceiling_refuses_exactly_the_releases_past_its_target(accountant):
    """RDP certifies the early releases (O(1)); past RDP's boundary the accountant decides, exactly."""
    target = 0.5 * (epsilon(8.0, 1.0, 18, DELTA, accountant) + epsilon(8.0, 1.0, 19, DELTA, accountant))
    ceiling = EpsilonCeiling(target, DELTA, PrivacyLedger(), accountant)
    answers = _walk(ceiling, _tight_schedule, accountant, 26)
    rdp_steps = max(k for k in range(30) if epsilon(8.0, 1.0, k, DELTA) <= target)
    assert rdp_steps < ceiling.ledger.steps  # RDP alone would have stopped earlier: the accountant decided
    assert False in answers and ledger_epsilon(ceiling.ledger, DELTA, accountant) <= target
    left = ceiling.rounds_left(10.0, 1.0)  # the count kept for (σ = 10, q = 1), against a fresh search
    assert left == EpsilonCeiling(target, DELTA, ceiling.ledger, accountant).rounds_left(10.0, 1.0)
    assert _exact(ceiling.ledger, 10.0, 1.0, accountant, left) <= target < _exact(ceiling.ledger, 10.0, 1.0,
                                                                                  accountant, left + 1)


def test_no_round_spends_nothing_and_a_non_private_ledger_allows_no_release():
    ledger = PrivacyLedger()
    ceiling = EpsilonCeiling(1.0, DELTA, ledger)
    assert ceiling.allows(0.1, 0.5, rounds=0) and not ceiling.allows(0.1, 0.5)
    assert ceiling.allows(1.0, 0.01, rounds=50) == (_exact(ledger, 1.0, 0.01, "rdp", 50) <= 1.0)
    ledger.record(1.0, 0.01, private=False)
    assert not ceiling.allows(100.0, 0.01) and "would spend more than target_epsilon = 1.0" in ceiling.refusal(
        100.0, 0.01)


# ------------------------------------------------- one run, two targets: the tighter one stops it
N, BATCH, LOW = 100, 10, 1.5
Q = BATCH / N


class _SigmaAtStart(Callback):
    """σ set to ``LOW`` once training starts (after the strategy calibrated σ for its plan): both targets are then
    reached within the plan, at steps computed exactly below."""

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.private_step.noise_multiplier = LOW


def _last_step_within(target: float) -> int:
    return max(k for k in range(1, 200) if epsilon(LOW, Q, k, DELTA) <= target)


@pytest.mark.parametrize("tighter", ["strategy", "budget"])
def test_a_strategy_target_and_a_privacy_budget_target_stop_at_the_tighter(tighter):
    strategy_target = 2.0
    k_strategy = _last_step_within(strategy_target)
    assert 8 < k_strategy < 35  # within the plan of 40 steps
    k_budget = k_strategy + (-4 if tighter == "budget" else 4)
    budget_target = 0.5 * (epsilon(LOW, Q, k_budget, DELTA) + epsilon(LOW, Q, k_budget + 1, DELTA))
    strategy = DPStrategy(target_epsilon=strategy_target, target_delta=DELTA, max_grad_norm=1.0)
    budget = PrivacyBudget(target_epsilon=budget_target, delta=DELTA)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(strategy=strategy, max_steps=40, min_steps=40, callbacks=[_SigmaAtStart(), budget]).fit(
            TinyClassifier(), make_loader(n=N, batch_size=BATCH))
    said = [str(w.message) for w in caught if "training stops" in str(w.message)]
    expected = min(k_strategy, k_budget)
    assert strategy.ledger.steps == expected  # min_steps asks for more: every later release is refused
    assert ledger_epsilon(strategy.ledger, DELTA) <= min(strategy_target, budget_target)
    assert len(said) == 1, said
    if tighter == "budget":
        assert f"PrivacyBudget: training stops after step {expected}" in said[0]
    else:  # the strategy's own ceiling refuses the release PrivacyBudget's still allows
        assert f"training stops at step {expected}" in said[0] and "than target_epsilon = 2.0" in said[0]
    assert strategy.private_step.ceilings == []  # PrivacyBudget's ceiling was the step's for this fit only


class _Spy(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # what the step holds, as plain values
        self.seen.append(tuple((type(c).__name__, c.ledger is trainer.strategy.ledger, c.target_epsilon, c.delta)
                               for c in trainer.strategy.private_step.ceilings))


def test_privacy_budget_adds_its_ceiling_to_the_step_for_the_fit():
    budget, spy = PrivacyBudget(target_epsilon=50.0, delta=DELTA), _Spy()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, public_state=["_Spy.seen"])  # the test's observer
    quiet_trainer(strategy=strategy, max_steps=3, callbacks=[budget, spy]).fit(TinyClassifier(),
                                                                               make_loader(n=N, batch_size=BATCH))
    assert spy.seen == [(("EpsilonCeiling", True, 50.0, DELTA),)] * 3  # over the strategy's ledger, at its δ
    assert strategy.private_step.ceilings == []


# ------------------------------------------------ a step is judged with its own σ and q
class _Asked:
    """A ceiling that records what it was asked and refuses nothing."""

    def __init__(self) -> None:
        self.asked: list[tuple[float, float, int]] = []

    def refusal(self, sigma: float, q: float, rounds: int = 1):
        self.asked.append((sigma, q, rounds))
        return None


def _step_near_its_target() -> PrivateStep:
    """A step calibrated for ε = 2 over 200 steps, its ledger charged up to one release before the target."""
    step = PrivateStep(None, 1.0, GaussianNoise(0), target_epsilon=2.0, target_delta=DELTA)
    step.attach(nn.Linear(3, 2))
    step.poisson_loader(DataLoader(TensorDataset(torch.randn(1000, 3)), batch_size=50))
    step.fit_target(0, 200)
    sigma, q = step.noise_multiplier, step.plan.sample_rate
    left = EpsilonCeiling(2.0, DELTA, step.ledger).rounds_left(sigma, q)
    assert left >= 200
    step.ledger.record(sigma, q, steps=left - 1)  # releases made (charged outside release(), as allowed)
    return step


def test_a_step_whose_sigma_or_q_changes_is_judged_with_its_own_sigma_and_q():
    step = _step_near_its_target()
    sigma, plan = step.noise_multiplier, step.plan
    spy = _Asked()
    step.ceilings.append(spy)
    assert step.refusal() is None and _exact(step.ledger, sigma, plan.sample_rate, "rdp") <= 2.0
    lower, wider = 0.5 * sigma, dataclasses.replace(plan, sample_rate=2 * plan.sample_rate)
    assert _exact(step.ledger, lower, plan.sample_rate, "rdp") > 2.0  # the release at σ/2 would overspend
    assert _exact(step.ledger, sigma, 2 * plan.sample_rate, "rdp") > 2.0  # and so would one at 2q
    step.noise_multiplier = lower
    reason = step.refusal()
    assert reason is not None and f"σ = {lower:.4g}" in reason and "target_epsilon = 2.0" in reason
    step.noise_multiplier, step.plan = sigma, wider
    assert step.refusal() is not None and not step.affordable()
    step.plan = plan
    assert step.refusal() is None and step.affordable()
    assert spy.asked == [(sigma, plan.sample_rate, 1)] * 2  # asked only where the step's own target allowed


def test_an_added_ceiling_refuses_with_its_own_reason():
    step = _step_near_its_target()
    tighter = EpsilonCeiling(0.5 * step._target().spent(), DELTA, step.ledger, owner="a tighter target")
    step.ceilings.append(tighter)
    reason = step.refusal()
    assert reason is not None and "a tighter target" in reason and "spent at δ = 1e-05" in reason
    step.ceilings.remove(tighter)
    assert step.refusal() is None
