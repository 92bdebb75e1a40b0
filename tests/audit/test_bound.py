"""The one-run ε lower bound (Steinke, Nasr & Jagielski 2023, Thm. 3) against mechanisms whose ε is known."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from lightning_dp.audit.bound import (
    audit_from_scores,
    count_correct,
    default_ks,
    epsilon_lower_bound,
    guesses_from_scores,
    p_value,
    rr_accuracy,
)

BETA = 0.05


def _first_rejecting_v(m: int, eps0: float, delta: float, confidence: float = 1 - BETA) -> int:
    """Smallest v (all m guessed) whose lower bound exceeds eps0 (p-value is decreasing in v)."""
    lo, hi = 0, m + 1  # p_value(lo) ≥ β, answer in (lo, hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if p_value(m, m, mid, eps0, delta) < 1 - confidence:
            hi = mid
        else:
            lo = mid
    if hi <= m:  # tie the p-value search to the reported bound itself
        assert epsilon_lower_bound(m, m, hi, confidence, delta) > eps0
        assert epsilon_lower_bound(m, m, hi - 1, confidence, delta) <= eps0 + 1e-5
    return hi


def _rr_outputs(rng: np.random.Generator, coins: np.ndarray, eps0: float, delta0: float = 0.0) -> np.ndarray:
    """(ε0, δ0)-DP per canary: reveal S_i w.p. δ0, else ε0-randomized response of S_i (±1)."""
    s = np.where(coins, 1, -1)
    truthful = rng.random(s.shape) < rr_accuracy(eps0)
    revealed = rng.random(s.shape) < delta0
    return np.where(revealed | truthful, s, -s)


def test_randomized_response_violation_rate_is_at_most_beta_and_not_far_below():
    # Exact: the audit of ε0-RR (all m guessed) refutes ε0 with probability P[Bin(m, p0) ≥ v*].
    m, eps0 = 1000, 1.0
    v_star = _first_rejecting_v(m, eps0, 0.0)
    rate = stats.binom.sf(v_star - 1, m, rr_accuracy(eps0))
    assert rate <= BETA
    assert rate > 0.5 * BETA  # RR is the worst case of Thm. 3: the bound is tight, not just valid


def test_randomized_response_simulation_through_scores():
    rng = np.random.default_rng(0)
    m, eps0, trials = 200, 1.0, 300
    above = 0
    for _ in range(trials):
        coins = rng.random(m) < 0.5
        scores = _rr_outputs(rng, coins, eps0) + 1e-3 * rng.random(m)  # random tie-break, coin-independent
        above += audit_from_scores(scores, coins, 1 - BETA).epsilon > eps0
    # P[above ≥ 27 | rate ≤ 0.05] < 0.01: a bound that over-claims would fail here.
    assert above <= 26


def test_randomized_response_bound_approaches_eps0_for_large_m():
    rng = np.random.default_rng(1)
    m, eps0 = 200_000, 2.0
    coins = rng.random(m) < 0.5
    r, v = count_correct(_rr_outputs(rng, coins, eps0), coins)
    bound = epsilon_lower_bound(m, r, v, 1 - BETA)
    assert eps0 - 0.05 < bound <= eps0 + 0.02


def test_delta_term_keeps_an_approximate_dp_mechanism_valid():
    # (ε0, δ0)-RR: W ~ Bin(m, δ0 + (1-δ0) p0). With the δ-term the refutation rate stays ≤ β;
    # ignoring δ (pure-DP bound) would refute the true claim far more often.
    m, eps0, delta0 = 1000, 1.0, 0.05
    accuracy = delta0 + (1 - delta0) * rr_accuracy(eps0)
    with_term = stats.binom.sf(_first_rejecting_v(m, eps0, delta0) - 1, m, accuracy)
    without = stats.binom.sf(_first_rejecting_v(m, eps0, 0.0) - 1, m, accuracy)
    assert with_term <= BETA
    assert without > 2 * BETA


def test_delta_simulation_valid():
    rng = np.random.default_rng(2)
    m, eps0, delta0, trials = 300, 0.5, 0.02, 300
    above = 0
    for _ in range(trials):
        coins = rng.random(m) < 0.5
        r, v = count_correct(_rr_outputs(rng, coins, eps0, delta0), coins)
        above += epsilon_lower_bound(m, r, v, 1 - BETA, delta0) > eps0
    assert above <= 26


def _theorem_rhs(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Thm. 3 written out literally: f(v) + 2mδ max_{i=1..m} (f(v-i) - f(v))/i."""
    p = math.exp(eps) / (1 + math.exp(eps))
    f = lambda u: 1.0 if u <= 0 else float(stats.binom.sf(u - 1, r, p))  # noqa: E731
    return min(1.0, f(v) + 2 * m * delta * max((f(v - i) - f(v)) / i for i in range(1, m + 1)))


@pytest.mark.parametrize("m,r,v,eps,delta", [
    (100, 40, 35, 1.0, 1e-3), (50, 50, 30, 0.2, 0.01), (200, 100, 100, 3.0, 1e-5), (30, 10, 1, 0.5, 0.05),
    (80, 60, 44, 0.0, 0.0),
])
def test_p_value_matches_theorem_as_written(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(_theorem_rhs(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


def test_lower_bound_is_the_supremum_of_rejected_epsilons():
    m, r, v, delta = 500, 200, 170, 1e-5
    eps = epsilon_lower_bound(m, r, v, 1 - BETA, delta)
    assert p_value(m, r, v, eps, delta) < BETA <= p_value(m, r, v, eps + 1e-4, delta)


def test_lower_bound_monotone_in_correct_guesses_and_delta():
    bounds = [epsilon_lower_bound(400, 200, v, 0.95) for v in (100, 130, 160, 190, 200)]
    assert bounds[0] == 0.0 and all(a < b for a, b in zip(bounds, bounds[1:]))
    assert epsilon_lower_bound(400, 200, 190, 0.95, 1e-3) < bounds[3]
    assert epsilon_lower_bound(400, 200, 190, 0.99) < bounds[3]


def test_perfect_guesses_bound_matches_closed_form():
    # δ = 0, v = r: p^r = β  ⇒  ε = -log(β^(-1/r) - 1).
    r = 100
    assert epsilon_lower_bound(1000, r, r, 1 - BETA) == pytest.approx(-math.log(BETA ** (-1 / r) - 1), abs=1e-5)


def test_guesses_and_counts():
    scores = np.array([0.9, 0.1, 0.5, 0.7, 0.2, 0.2])
    g = guesses_from_scores(scores, k_pos=2, k_neg=2)
    assert g.tolist() == [1, -1, 0, 1, -1, 0]  # tie at 0.2 broken by index
    assert count_correct(g, [True, False, False, False, False, True]) == (4, 3)


def test_audit_from_scores_pays_for_trying_several_k():
    m = 200
    coins = np.arange(m) % 2 == 0
    scores = coins.astype(float) + np.linspace(0, 0.5, m)  # perfectly separated
    one = audit_from_scores(scores, coins, 0.95, ks=[50])
    assert (one.guesses, one.correct) == (100, 100)
    assert one.epsilon == pytest.approx(epsilon_lower_bound(m, 100, 100, 0.95))
    several = audit_from_scores(scores, coins, 0.95, ks=[10, 50, 100])
    assert several.epsilon == pytest.approx(epsilon_lower_bound(m, 200, 200, 1 - 0.05 / 3))
    assert default_ks(200) == [10, 20, 50, 100]


@pytest.mark.parametrize("call", [
    lambda: p_value(10, 11, 3, 1.0),
    lambda: p_value(10, 5, 6, 1.0),
    lambda: p_value(10, 5, 3, -1.0),
    lambda: p_value(10, 5, 3, 1.0, delta=2.0),
    lambda: epsilon_lower_bound(10, 5, 3, confidence=1.0),
    lambda: guesses_from_scores([1.0, 2.0], 2, 1),
    lambda: guesses_from_scores([1.0, float("nan")], 1, 1),
    lambda: audit_from_scores([1.0, 2.0, 3.0, 4.0], [True] * 4, ks=[3]),
    lambda: count_correct([1, -1], [True]),
])
def test_bad_input_raises(call):
    with pytest.raises(ValueError):
        call()
