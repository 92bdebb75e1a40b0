"""The vectorised sampled-Gaussian RDP equals Opacus' compute_rdp (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
from opacus.accountants.analysis.rdp import compute_rdp

from lightning_dp.accounting.rdp import RDP_ORDERS, rdp_to_epsilon
from lightning_dp.accounting.sgm_rdp import check_curve, sampled_gaussian_rdp, sampled_gaussian_rdp_upper

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


def test_unknown_curve_is_refused() -> None:
    with pytest.raises(ValueError, match="curve"):
        check_curve("fast")
