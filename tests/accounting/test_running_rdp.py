"""RunningRDP: incremental total equals a from-scratch computation; resume; quantised bound."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from lightning_dp.accounting import PrivacyLedger, RunningRDP, ledger_epsilon, running_for
from lightning_dp.accounting.accountants import composed_rdp
from lightning_dp.accounting.running_rdp import AUTO_QUANTUM, _grid_down, _grid_up

DELTA = 1e-5


def _random_ledger_run(seed, n_steps=60):
    rng = random.Random(seed)
    ledger, run = PrivacyLedger(), RunningRDP(curve="exact")  # exactness is what these tests check
    sigmas = [0.8, 1.0, 1.3]
    for _ in range(n_steps):
        ledger.record(rng.choice(sigmas), rng.choice([0.01, 0.02]), steps=rng.randint(1, 3))
        run.sync(ledger)
        assert run.steps == ledger.steps
    return ledger, run


def test_running_total_equals_from_scratch():
    ledger, run = _random_ledger_run(0)
    np.testing.assert_allclose(run.total, composed_rdp(ledger.entries), rtol=1e-12)
    assert run.epsilon(DELTA) == pytest.approx(ledger_epsilon(ledger, DELTA), rel=1e-12)


def test_epsilon_after_matches_recording_the_step():
    ledger, run = _random_ledger_run(1, 10)
    predicted = run.epsilon_after(DELTA, 0.9, 0.03)
    ledger.record(0.9, 0.03)
    run.sync(ledger)
    assert run.epsilon(DELTA) == pytest.approx(predicted, rel=1e-12)


def test_state_dict_round_trip_continues_and_detects_a_foreign_ledger():
    ledger, run = _random_ledger_run(2, 20)
    resumed = RunningRDP(curve="exact")
    resumed.load_state_dict(run.state_dict())
    ledger.record(1.0, 0.01, steps=5)
    resumed.sync(ledger)
    assert resumed.epsilon(DELTA) == pytest.approx(ledger_epsilon(ledger, DELTA), rel=1e-12)
    other = PrivacyLedger()
    other.record(2.0, 0.5, steps=3)
    stale = RunningRDP(curve="exact")
    stale.load_state_dict(run.state_dict())
    stale.sync(other)  # not an extension of what was seen: rebuilt
    assert stale.steps == 3
    assert stale.epsilon(DELTA) == pytest.approx(ledger_epsilon(other, DELTA), rel=1e-12)


def test_non_private_release_is_infinite():
    ledger, run = PrivacyLedger(), RunningRDP()
    ledger.record(1.0, 0.01, steps=3)
    ledger.record(1.0, 0.01, private=False)
    run.sync(ledger)
    assert run.epsilon(DELTA) == math.inf
    assert not run.private


def test_quantised_total_is_a_tight_upper_bound():
    ledger = PrivacyLedger()
    for t in range(25):
        ledger.record(1.2 - 0.01 * t, 0.01 * (1 + 0.1 * math.sin(t)))
    exact, rounded = RunningRDP(), RunningRDP(quantum=1e-2)
    exact.sync(ledger)
    rounded.sync(ledger)
    assert exact.epsilon(DELTA) <= rounded.epsilon(DELTA) <= exact.epsilon(DELTA) * 1.05
    assert np.all(rounded.total >= exact.total)


def test_integer_running_form_matches_accountant():
    ledger, _ = _random_ledger_run(3, 10)
    run = running_for("integer_rdp", curve="exact")
    run.sync(ledger)
    assert run.epsilon(DELTA) == pytest.approx(ledger_epsilon(ledger, DELTA, "integer_rdp"), rel=1e-12)
    assert running_for("pld") is None


def _drifting_ledger(n_steps: int) -> PrivacyLedger:
    ledger = PrivacyLedger()
    for t in range(n_steps):  # a new (σ, q) every step
        ledger.record(1.0 + 0.3 * t / n_steps, 0.02 * (1.0 + 0.1 * ((t * 7919) % 101) / 101))
    return ledger


def test_auto_curve_is_exact_for_the_first_keys_then_a_tight_upper_bound():
    ledger = _drifting_ledger(60)
    exact, chord = RunningRDP(curve="exact"), RunningRDP(curve="chord")
    auto = RunningRDP(curve="auto", exact_keys=20)
    for run in (exact, chord, auto):
        run.sync(ledger)
    np.testing.assert_allclose(exact.total, composed_rdp(ledger.entries), rtol=1e-12)
    assert np.all(chord.total >= exact.total * (1 - 1e-12))
    assert np.all(auto.total >= exact.total * (1 - 1e-12)) and np.any(auto.total > exact.total)
    eps_exact, eps_auto, eps_chord = (r.epsilon(DELTA) for r in (exact, auto, chord))
    assert eps_exact <= eps_auto < 1.03 * eps_exact and eps_exact <= eps_chord < 1.03 * eps_exact
    # the first 20 (σ, q) exactly, the other 40 by the chord at σ rounded down, q rounded up
    head = RunningRDP(curve="exact")
    head.sync(_prefix(ledger, 20))
    bound = RunningRDP(curve="chord")
    tail = sum(
        bound.one_step(_grid_down(e.noise_multiplier, AUTO_QUANTUM), _grid_up(e.sample_rate, AUTO_QUANTUM))
        for e in ledger.entries[20:]
    )
    np.testing.assert_allclose(auto.total, head.total + tail, rtol=1e-12)


def test_auto_curve_shares_grid_cells_between_drifting_settings():
    run = RunningRDP(exact_keys=0)
    run.add(1.0, 0.01)
    first = run.one_step(1.0, 0.01)
    assert run.one_step(1.0 + 0.2 * AUTO_QUANTUM, 0.01) is first  # same cell: no new evaluation
    assert run.one_step(1.0 + 2.0 * AUTO_QUANTUM, 0.01) is not first


def _prefix(ledger: PrivacyLedger, k: int) -> PrivacyLedger:
    out = PrivacyLedger()
    for e in ledger.entries[:k]:
        out.record(e.noise_multiplier, e.sample_rate, steps=e.steps, private=e.private)
    return out


def test_auto_curve_rebuilds_and_resumes_to_the_same_total():
    ledger = _drifting_ledger(30)
    live = RunningRDP(exact_keys=10)
    for k in range(1, 31):  # synced step by step, with prospective queries in between
        live.sync(_prefix(ledger, k))
        live.epsilon_after(DELTA, 2.0 + k, 0.5)
    rebuilt = RunningRDP(exact_keys=10)
    rebuilt.sync(ledger)
    np.testing.assert_allclose(live.total, rebuilt.total, rtol=1e-12)
    resumed = RunningRDP(exact_keys=10)
    resumed.sync(_prefix(ledger, 15))
    state = resumed.state_dict()
    again = RunningRDP(exact_keys=10)
    again.load_state_dict(state)
    again.sync(ledger)
    np.testing.assert_allclose(again.total, rebuilt.total, rtol=1e-12)


def test_bad_curve_arguments():
    with pytest.raises(ValueError, match="curve"):
        RunningRDP(curve="fast")
    with pytest.raises(ValueError, match="exact_keys"):
        RunningRDP(exact_keys=-1)


@pytest.mark.parametrize("seed", range(3))
def test_affordable_steps_is_the_last_step_within_target(seed):
    rng = random.Random(seed)
    run = RunningRDP()
    run.add(rng.uniform(0.8, 1.5), rng.uniform(0.005, 0.05), steps=rng.randint(1, 200))
    sigma, q = rng.uniform(0.8, 1.5), rng.uniform(0.005, 0.05)
    target = run.epsilon_after(DELTA, sigma, q, 1) + rng.uniform(0.0, 2.0)
    n = run.affordable_steps(DELTA, target, run.one_step(sigma, q))
    assert n >= 1
    assert run.epsilon_after(DELTA, sigma, q, n) <= target < run.epsilon_after(DELTA, sigma, q, n + 1)
    assert run.affordable_steps(DELTA, run.epsilon(DELTA) * 0.5, run.one_step(sigma, q)) == 0


@pytest.mark.parametrize("curve,quantum", [("auto", None), ("exact", None), ("chord", None), ("auto", 1e-2)])
def test_bound_step_covers_every_charge_in_its_box(curve, quantum):
    rng = random.Random(5)
    run = RunningRDP(curve=curve, quantum=quantum, exact_keys=2)
    run.add(1.0, 0.02)  # one exact key taken
    sigma_min, q_max = 0.9, 0.03
    bound = run.bound_step(sigma_min, q_max)
    for _ in range(20):
        sigma, q = sigma_min * rng.uniform(1.0, 1.2), q_max * rng.uniform(0.7, 1.0)
        assert np.all(run.one_step(sigma, q) <= bound)
    assert np.all(run.one_step(sigma_min, q_max) <= bound)
    assert np.all(np.isinf(run.bound_step(0.0, 0.1))) and not np.any(run.bound_step(1.0, 0.0))


def test_sync_in_one_batch_equals_step_by_step_adds():
    ledger = _drifting_ledger(80)
    batched, stepwise = RunningRDP(exact_keys=3), RunningRDP(exact_keys=3)
    batched.sync(ledger)
    for e in ledger.entries:
        stepwise.add(e.noise_multiplier, e.sample_rate, e.steps)
    np.testing.assert_allclose(batched.total, stepwise.total, rtol=1e-12)
    assert batched.steps == stepwise.steps == 80


def test_exact_curve_on_the_grid_is_a_tight_cheap_bound_for_a_small_sigma_schedule():
    ledger = PrivacyLedger()
    for t in range(200):
        ledger.record(0.6 - 0.1 * t / 200, 0.007)  # σ < 1: where the chord is loosest
    exact, gridded = RunningRDP(curve="exact"), RunningRDP(curve="exact", quantum=5e-3)
    exact.sync(ledger)
    gridded.sync(ledger)
    assert np.all(gridded.total >= exact.total * (1 - 1e-12))
    assert exact.epsilon(DELTA) <= gridded.epsilon(DELTA) <= 1.02 * exact.epsilon(DELTA)
    cells = {gridded.charge_key(e.noise_multiplier, e.sample_rate) for e in ledger.entries}
    assert len(cells) <= 40  # one exact evaluation per 0.5 % of σ drift, not per step
