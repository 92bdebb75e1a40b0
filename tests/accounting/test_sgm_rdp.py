"""The vectorised sampled-Gaussian RDP equals Opacus' compute_rdp (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
from opacus.accountants.analysis.rdp import compute_rdp

from lightning_dp.accounting.rdp import RDP_ORDERS, rdp_to_epsilon
from lightning_dp.accounting.sgm_rdp import (
    check_curve,
    sampled_gaussian_rdp,
    sampled_gaussian_rdp_upper,
    sampled_gaussian_rdp_upper_many,
)

EXTRA_ORDERS = (1.01, 1.5, 2.5, 20.5, 63.7, 100.0, 128.0, 256.0)


def _opacus(sigma: float, q: float, orders) -> np.ndarray:
    return np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders)), dtype=float)


def _assert_close(ours: np.ndarray, oracle: np.ndarray) -> None:
    finite = np.isfinite(oracle)
    assert np.array_equal(np.isfinite(ours), finite)
    np.testing.assert_allclose(ours[finite], oracle[finite], rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_equals_opacus_on_random_settings(seed: int) -> None:
    rng = np.random.default_rng(seed)
    orders = RDP_ORDERS + EXTRA_ORDERS
    for _ in range(6):
        sigma = float(np.exp(rng.uniform(np.log(0.3), np.log(30.0))))
        q = float(np.exp(rng.uniform(np.log(1e-6), np.log(0.5))))
        _assert_close(sampled_gaussian_rdp(sigma, q, orders), _opacus(sigma, q, orders))


@pytest.mark.parametrize("sigma,q", [(1.1, 0.004), (0.5, 0.01), (0.8, 0.2), (4.0, 0.9), (2.0, 1e-5)])
def test_equals_opacus_on_typical_settings(sigma: float, q: float) -> None:
    _assert_close(sampled_gaussian_rdp(sigma, q, RDP_ORDERS), _opacus(sigma, q, RDP_ORDERS))


def test_long_series_orders_converge_like_opacus() -> None:
    # large σ and q = 1/2: the fractional series needs hundreds of terms (several chunks)
    orders = (1.1, 1.5, 2.5, 5.5)
    _assert_close(sampled_gaussian_rdp(20.0, 0.5, orders), _opacus(20.0, 0.5, orders))


def test_edge_cases() -> None:
    orders = (1.5, 2.0, 32.0)
    assert np.all(sampled_gaussian_rdp(1.0, 0.0, orders) == 0.0)
    assert np.all(np.isinf(sampled_gaussian_rdp(0.0, 0.1, orders)))
    np.testing.assert_allclose(sampled_gaussian_rdp(2.0, 1.0, orders), np.array(orders) / 8.0)
    assert np.isinf(sampled_gaussian_rdp(1.0, 0.1, (float("inf"),))[0])


def test_monotone_in_sigma_and_q() -> None:
    base = sampled_gaussian_rdp(1.0, 0.01, RDP_ORDERS)
    assert np.all(sampled_gaussian_rdp(0.9, 0.01, RDP_ORDERS) > base)
    assert np.all(sampled_gaussian_rdp(1.0, 0.02, RDP_ORDERS) > base)


@pytest.mark.parametrize("bad", [dict(sigma=-1.0, q=0.1), dict(sigma=1.0, q=1.5), dict(sigma=1.0, q=-0.1)])
def test_bad_parameters_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        sampled_gaussian_rdp(bad["sigma"], bad["q"], RDP_ORDERS)


def test_orders_at_most_one_are_refused() -> None:
    with pytest.raises(ValueError, match="orders must be > 1"):
        sampled_gaussian_rdp(1.0, 0.1, (1.0, 2.0))


@pytest.mark.parametrize("seed", range(3))
def test_chord_is_an_upper_bound_exact_at_integer_orders(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    orders = np.array(RDP_ORDERS)
    integer = orders == np.floor(orders)
    for _ in range(5):
        sigma = float(np.exp(rng.uniform(np.log(0.5), np.log(10.0))))
        q = float(np.exp(rng.uniform(np.log(1e-4), np.log(0.3))))
        exact, upper = sampled_gaussian_rdp(sigma, q, orders), sampled_gaussian_rdp_upper(sigma, q, orders)
        assert np.all(upper >= exact * (1 - 1e-12))
        np.testing.assert_allclose(upper[integer], exact[integer], rtol=1e-12)


@pytest.mark.parametrize("sigma,q,steps", [(1.0, 0.036, 300), (1.0, 0.004, 14000), (0.8, 0.01, 1000)])
def test_chord_epsilon_is_within_two_percent(sigma: float, q: float, steps: int) -> None:
    exact = rdp_to_epsilon(steps * sampled_gaussian_rdp(sigma, q, RDP_ORDERS), RDP_ORDERS, 1e-5)
    upper = rdp_to_epsilon(steps * sampled_gaussian_rdp_upper(sigma, q, RDP_ORDERS), RDP_ORDERS, 1e-5)
    assert exact <= upper <= 1.02 * exact


def test_chord_for_many_pairs_equals_one_at_a_time_including_edge_cases() -> None:
    rng = np.random.default_rng(7)
    sigmas = list(np.exp(rng.uniform(np.log(0.4), np.log(20.0), 9))) + [1.0, 0.0, 2.0]
    qs = list(np.exp(rng.uniform(np.log(1e-5), np.log(0.9), 9))) + [0.0, 0.1, 1.0]  # q = 0, σ = 0, q = 1
    rows = sampled_gaussian_rdp_upper_many(sigmas, qs, RDP_ORDERS)
    assert rows.shape == (12, len(RDP_ORDERS))
    for row, sigma, q in zip(rows, sigmas, qs):
        alone = sampled_gaussian_rdp_upper(sigma, q, RDP_ORDERS) if 0 < q < 1 and sigma > 0 else sampled_gaussian_rdp(sigma, q, RDP_ORDERS)
        np.testing.assert_allclose(row, alone, rtol=1e-12)
    assert np.all(rows[-3] == 0.0) and np.all(np.isinf(rows[-2]))
    np.testing.assert_allclose(rows[-1], np.array(RDP_ORDERS) / 8.0)
    assert sampled_gaussian_rdp_upper_many([], [], RDP_ORDERS).shape == (0, len(RDP_ORDERS))
    with pytest.raises(ValueError, match="as many"):
        sampled_gaussian_rdp_upper_many([1.0, 2.0], [0.1], RDP_ORDERS)
    with pytest.raises(ValueError):
        sampled_gaussian_rdp_upper_many([1.0], [1.5], RDP_ORDERS)


def test_chord_is_monotone_in_sigma_and_q() -> None:
    # what lets a bound at a (σ_min, q_max) corner cover every step inside a box (BudgetReservation)
    rng = np.random.default_rng(3)
    for _ in range(10):
        sigma, q = float(rng.uniform(0.5, 5.0)), float(rng.uniform(1e-4, 0.5))
        base = sampled_gaussian_rdp_upper(sigma, q, RDP_ORDERS)
        assert np.all(sampled_gaussian_rdp_upper(sigma * 0.99, q, RDP_ORDERS) >= base)
        assert np.all(sampled_gaussian_rdp_upper(sigma, q * 1.01, RDP_ORDERS) >= base)


def test_unknown_curve_is_refused() -> None:
    with pytest.raises(ValueError, match="curve"):
        check_curve("fast")
