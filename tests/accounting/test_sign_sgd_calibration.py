"""Per-worker σ calibration for DP-SignSGD: ours vs the seed paper's integer grid (docs/algorithms.md §6)."""

from __future__ import annotations

import math

import pytest
from lightning_dp.accounting.sign_sgd_calibration import (
    PAPER_ORDERS,
    calibrate_worker_sigma,
    compare_worker_sigmas,
    epsilon_paper_grid,
    epsilon_rdp,
    worker_epsilon,
)

# local q and T small enough that each RDP evaluation is cheap
Q, T, DELTA = 0.1, 200, 40**-1.1


def _paper_eq8(alpha: int, q: float, sigma: float) -> float:
    """The seed's eq. (8), written out independently (binomial sum at integer α)."""
    terms = [math.comb(alpha, k) * (1 - q) ** (alpha - k) * q**k * math.exp((k * k - k) / (2 * sigma**2))
             for k in range(alpha + 1)]
    return math.log(sum(terms)) / (alpha - 1)


def test_paper_grid_epsilon_is_the_papers_formula() -> None:
    sigma = 1.3
    expected = min(T * _paper_eq8(a, Q, sigma) + math.log(1 / DELTA) / (a - 1) for a in PAPER_ORDERS)
    assert epsilon_paper_grid(sigma, Q, T, DELTA) == pytest.approx(expected, rel=1e-9)


TOL = 1e-2  # bisection tolerance in tests (each fractional-order RDP evaluation costs ~0.1 s)


@pytest.fixture(scope="module")
def sigmas() -> dict[tuple[float, str], float]:
    return {(eps, m): calibrate_worker_sigma(eps, DELTA, Q, T, m, rel_tol=TOL)  # type: ignore[arg-type]
            for eps in (10.0, 1.0) for m in ("rdp", "paper_grid")}


@pytest.mark.parametrize("target", [10.0, 1.0])
def test_calibrated_sigma_achieves_target_and_is_tight(sigmas: dict, target: float) -> None:
    sigma = sigmas[(target, "rdp")]
    assert epsilon_rdp(sigma, Q, T, DELTA) <= target
    assert epsilon_rdp((1 - TOL) * sigma, Q, T, DELTA) > target  # not wastefully large


@pytest.mark.parametrize("target", [10.0, 1.0])
def test_paper_grid_needs_more_sigma_than_the_proper_accountant(sigmas: dict, target: float) -> None:
    ours, grid = sigmas[(target, "rdp")], sigmas[(target, "paper_grid")]
    assert epsilon_paper_grid(grid, Q, T, DELTA) <= target
    assert epsilon_paper_grid((1 - TOL) * grid, Q, T, DELTA) > target
    assert grid > ours * (1 + 2 * TOL)


def test_two_c_sensitivity_doubles_sigma_and_the_papers_sigma_overstates_privacy() -> None:
    c = compare_worker_sigmas(5.0, DELTA, Q, T, rel_tol=TOL)
    assert c.paper_grid_2c == pytest.approx(2 * c.paper_grid, rel=2 * TOL)
    assert c.paper_actual_epsilon > 5.0  # the paper's σ with its 2C statistic misses its ε
    assert worker_epsilon(c.paper_grid_2c, Q, T, DELTA, "paper_grid", sensitivity_factor=2.0) <= 5.0
    assert c.prv is None


def test_sensitivity_factor_scales_the_noise_multiplier() -> None:
    assert worker_epsilon(3.0, Q, T, DELTA, sensitivity_factor=2.0) == pytest.approx(epsilon_rdp(1.5, Q, T, DELTA))
    assert worker_epsilon(0.0, Q, T, DELTA) == math.inf


@pytest.mark.parametrize("sigma", [0.8, 2.0, 6.0])
def test_proper_accountant_gives_smaller_epsilon_at_equal_sigma(sigma: float) -> None:
    """Fractional orders + the Balle et al. conversion never lose to integer α + Mironov."""
    eps = epsilon_rdp(sigma, Q, T, DELTA)
    assert 0 < eps < epsilon_paper_grid(sigma, Q, T, DELTA)
    assert epsilon_rdp(1.2 * sigma, Q, T, DELTA) < eps  # decreasing in σ (bisection relies on it)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"steps": 0}, "steps"),
        ({"method": "moments"}, "method"),
    ],
)
def test_bad_input_is_refused(kwargs: dict, match: str) -> None:
    args = {"target_epsilon": 1.0, "delta": DELTA, "sample_rate": Q, "steps": T} | kwargs
    with pytest.raises(ValueError, match=match):
        calibrate_worker_sigma(**args)


@pytest.mark.slow
def test_prv_needs_no_more_sigma_than_rdp() -> None:
    ours = calibrate_worker_sigma(2.0, DELTA, Q, T, "rdp")
    prv = calibrate_worker_sigma(2.0, DELTA, Q, T, "prv", rel_tol=1e-2)
    assert prv <= ours * 1.02
