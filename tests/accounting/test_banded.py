"""Banded DP-MF accounting (docs/algorithms.md §7): sensitivity by brute force, ⌈T/b⌉ rounds, error at equal ε."""

import math

import numpy as np
import pytest

from lightning_dp.accounting import calibrate_noise, epsilon
from lightning_dp.accounting.banded import (
    banded_epsilon,
    banded_rounds,
    brute_force_sensitivity,
    calibrate_banded_noise,
    column_norm_sensitivity,
    multi_participation_sensitivity,
    participation_patterns,
    rounds_charged_at,
    strategy_matrix,
)
from lightning_dp.accounting.banded_coefficients import (
    fichtenberger_coefficients,
    optimize_banded_coefficients,
    prefix_sum_error,
)
from lightning_dp.privacy.banded_noise import BandedToeplitzNoise

COEFFICIENTS = {
    "fichtenberger-3": fichtenberger_coefficients(3),
    "fichtenberger-4": fichtenberger_coefficients(4),
    "mixed-signs": np.array([1.0, 0.4, -0.2]),
}


@pytest.mark.parametrize("name", sorted(COEFFICIENTS))
@pytest.mark.parametrize("n", [6, 9])
def test_sensitivity_matches_brute_force(name, n):
    c = COEFFICIENTS[name]
    b = c.size
    C = strategy_matrix(c, n)
    # One participation: the max column norm, which is ‖c‖ — what the mechanism divides out.
    single = brute_force_sensitivity(C, b, max_participations=1)
    assert single == pytest.approx(column_norm_sensitivity(C)) == pytest.approx(np.linalg.norm(c))
    assert single == pytest.approx(BandedToeplitzNoise(b, coefficients=c).sensitivity)
    # With separation ≥ b, participations hit disjoint rows: ‖C u‖² is additive over them ...
    for steps in participation_patterns(n, b):
        u = np.zeros(n)
        u[list(steps)] = 1.0
        assert np.linalg.norm(C @ u) ** 2 == pytest.approx(sum(np.linalg.norm(C[:, s]) ** 2 for s in steps))
    # ... so the worst pattern is 0, b, 2b, … (the closed form), and after normalising by ‖c‖
    # every participation has sensitivity ≤ 1: one Gaussian step with multiplier σ each.
    assert brute_force_sensitivity(C, b) == pytest.approx(multi_participation_sensitivity(c, n, b))
    assert column_norm_sensitivity(strategy_matrix(c / np.linalg.norm(c), n)) == pytest.approx(1.0)


def test_min_separation_is_necessary():
    """Participations closer than b overlap: the additive decomposition (and the accounting) breaks."""
    c, n = fichtenberger_coefficients(4), 8
    C = strategy_matrix(c, n)
    u = np.zeros(n)
    u[[0, 1]] = 1.0  # separation 1 < b
    assert np.linalg.norm(C @ u) ** 2 > np.linalg.norm(C[:, 0]) ** 2 + np.linalg.norm(C[:, 1]) ** 2 + 0.5
    assert brute_force_sensitivity(C, 1) > brute_force_sensitivity(C, 4) + 0.5


def test_patterns_respect_the_separation():
    patterns = list(participation_patterns(7, 3))
    assert (0, 3, 6) in patterns and (0, 2) not in patterns
    assert all(b - a >= 3 for p in patterns for a, b in zip(p, p[1:]))
    assert len(list(participation_patterns(5, 1))) == 2**5 - 1


@pytest.mark.parametrize("bands", [1, 3, 8])
def test_ledger_charges_add_up_to_ceil_t_over_b(bands):
    for steps in range(0, 30):
        assert sum(rounds_charged_at(t, bands) for t in range(steps)) == banded_rounds(steps, bands)
        assert banded_rounds(steps, bands) == math.ceil(steps / bands)


def test_banded_epsilon_is_ceil_t_over_b_sampled_gaussian_steps():
    sigma, qg, T, b, delta = 1.1, 0.08, 1000, 8, 1e-5
    eps = banded_epsilon(sigma, qg, T, b, delta)
    assert eps == pytest.approx(epsilon(sigma, qg, 125, delta))
    assert banded_epsilon(sigma, qg, T + 1, b, delta) == pytest.approx(epsilon(sigma, qg, 126, delta))
    assert banded_epsilon(sigma, 0.01, T, 1, delta) == pytest.approx(epsilon(sigma, 0.01, T, delta))
    # would fail if the T steps were all counted
    assert eps < 0.5 * epsilon(sigma, qg, T, delta)


def test_calibration_hits_the_target():
    target, delta, qg, T, b = 4.0, 1e-5, 0.05, 800, 4
    sigma = calibrate_banded_noise(target, delta, qg, T, b, rtol=1e-3)
    assert banded_epsilon(sigma, qg, T, b, delta) <= target
    assert banded_epsilon(sigma * 0.99, qg, T, b, delta) > target
    with pytest.raises(ValueError, match="steps"):
        calibrate_banded_noise(target, delta, qg, 0, b)
    with pytest.raises(ValueError, match="bands"):
        banded_epsilon(1.0, qg, T, 0, delta)


def test_prefix_sum_error_is_lower_than_independent_noise_at_equal_epsilon():
    """A long run (T = 2000 steps, 20 epochs at B = 500 of N = 50 000), ε = 8: analytic errors.

    Independent noise: σ₁ for (q, T); the mean prefix-sum variance is σ₁²(T + 1)/2 (units C²).
    Banded: σ_b for (q_g = b·q, ⌈T/b⌉ rounds); the error is σ_b² · sens² · ‖A C⁻¹‖²_F / T. The
    formula for the banded error is checked against the simulated stream in test_banded_noise.
    """
    N, B, T, eps, delta, b = 50_000, 500, 2000, 8.0, 1e-5, 8
    q = B / N
    sigma_independent = calibrate_noise(eps, delta, q, T, rtol=1e-3)
    sigma_banded = calibrate_banded_noise(eps, delta, b * q, T, b, rtol=1e-3)
    assert sigma_banded > sigma_independent  # weaker amplification costs noise ...
    independent = sigma_independent**2 * (T + 1) / 2
    banded = sigma_banded**2 * prefix_sum_error(fichtenberger_coefficients(b), T)
    assert banded < 0.6 * independent  # ... but cancellation more than pays for it
    optimized = sigma_banded**2 * prefix_sum_error(optimize_banded_coefficients(b, T), T)
    assert optimized < banded


def test_strategy_matrix_shape_and_bands():
    C = strategy_matrix([1.0, 0.5, 0.25], 5)
    assert C.shape == (5, 5)
    assert np.allclose(np.triu(C, 1), 0) and np.allclose(np.tril(C, -3), 0)
    assert np.allclose(np.diag(C, -1), 0.5)
