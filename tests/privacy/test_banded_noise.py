"""Banded-Toeplitz DP-MF noise (docs/algorithms.md §7): covariance C⁻¹C⁻ᵀ, b = 1 ≡ Gaussian, Φ_t, state."""

import io
import math

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.optimize import approx_fprime
from torch import nn

from lightning_dp.accounting.banded import strategy_matrix
from lightning_dp.privacy.noise import GaussianNoise, NoiseMechanism
from lightning_dp.privacy.privatizer import Privatizer
from lightning_dp.privacy.release import MechanismRequest
from lightning_dp.accounting.banded_coefficients import (
    _error_and_gradient,
    fichtenberger_coefficients,
    inverse_coefficients,
    is_stable,
    optimize_banded_coefficients,
    prefix_sum_error,
)
from lightning_dp.privacy.banded_noise import BandedToeplitzNoise
from lightning_dp.grad_sample import ClippedBatch


class ScriptedNoise(NoiseMechanism):
    """Unit-noise source replaying given draws (to compare streams draw for draw)."""

    def __init__(self, draws):
        self.draws = list(draws)

    def sample(self, like):
        return [z.clone() for z in self.draws.pop(0)]


def _stream(noise, steps, d):
    return torch.stack([noise.sample([torch.zeros(d, dtype=torch.float64)])[0] for _ in range(steps)])


# ---------------------------------------------------------------- coefficients


def test_fichtenberger_coefficients_are_the_square_root_of_the_prefix_sum_matrix():
    n = 12
    c = fichtenberger_coefficients(n)
    assert c[:4] == pytest.approx([1.0, 0.5, 0.375, 0.3125])
    assert all(c[j] == pytest.approx(math.comb(2 * j, j) / 4**j) for j in range(n))
    C = strategy_matrix(c, n)
    np.testing.assert_allclose(C @ C, np.tril(np.ones((n, n))), atol=1e-12)


def test_inverse_coefficients_invert_the_banded_matrix():
    c = [1.0, 0.6, 0.3, -0.1]
    n = 15
    C = strategy_matrix(c, n)
    np.testing.assert_allclose(np.linalg.inv(C)[:, 0], inverse_coefficients(c, n), atol=1e-12)


def test_prefix_sum_error_matches_dense_matrices():
    for c in (fichtenberger_coefficients(5), np.array([2.0, 0.5, 0.1])):
        n = 20
        dense = np.linalg.norm(np.tril(np.ones((n, n))) @ np.linalg.inv(strategy_matrix(c, n)), "fro") ** 2
        assert prefix_sum_error(c, n) == pytest.approx((c @ c) * dense / n, rel=1e-10)
    assert prefix_sum_error([1.0], 30) == pytest.approx(31 / 2)  # independent noise: (n + 1) / 2


def test_error_gradient_is_exact():
    tail = np.array([0.55, 0.3, 0.2, 0.12])
    value, grad = _error_and_gradient(tail, 200)
    assert value == pytest.approx(prefix_sum_error(np.concatenate(([1.0], tail)), 200))
    numeric = approx_fprime(tail, lambda x: _error_and_gradient(x, 200)[0], 1e-7)
    np.testing.assert_allclose(grad, numeric, rtol=1e-4)


def test_optimized_coefficients_beat_the_truncated_square_root():
    b, n = 8, 1000
    c = optimize_banded_coefficients(b, n)
    assert c.size == b and c[0] == 1.0 and is_stable(c)
    assert prefix_sum_error(c, n) < 0.9 * prefix_sum_error(fichtenberger_coefficients(b), n)


def test_stability_check():
    assert is_stable(fichtenberger_coefficients(64))
    assert not is_stable([1.0, 2.0])  # root at −1/2: the recursion doubles every step
    with pytest.raises(ValueError, match="unstable"):
        BandedToeplitzNoise(2, coefficients=[1.0, 2.0])


# ---------------------------------------------------------------- the mechanism


@pytest.mark.parametrize("coefficients", [None, [3.0]])
def test_one_band_reproduces_gaussian_noise_exactly(coefficients):
    like = [torch.zeros(4, 3), torch.zeros(7)]
    banded, gaussian = BandedToeplitzNoise(1, coefficients=coefficients, seed=11), GaussianNoise(seed=11)
    for _ in range(5):
        for a, b in zip(banded.sample(like), gaussian.sample(like)):
            assert torch.equal(a, b)
    assert banded.sensitivity == pytest.approx(1.0 if coefficients is None else 3.0)
    assert banded.memory_numel == 0 and banded.phi_factor(4) == 1.0


@pytest.mark.parametrize("bands,coefficients", [(4, None), (3, [1.0, 0.4, -0.2])])
def test_noise_covariance_across_steps_is_sens2_inverse_strategy_gram(bands, coefficients):
    steps, d = 10, 100_000
    noise = BandedToeplitzNoise(bands, coefficients=coefficients, seed=3)
    u = _stream(noise, steps, d).numpy()  # (steps, d): d independent copies of the stream
    empirical = u @ u.T / d
    c = noise.coefficients
    inv = np.linalg.inv(strategy_matrix(c, steps))
    expected = (c @ c) * inv @ inv.T  # sens² · C⁻¹ C⁻ᵀ
    se = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / d)
    assert np.all(np.abs(empirical - expected) < 6 * se)
    # The test can fail: without the sens² factor, or with independent noise, it would.
    assert np.any(np.abs(empirical - expected / (c @ c)) > 6 * se)
    assert np.any(np.abs(empirical - np.eye(steps)) > 6 * se)


def test_phi_factor_is_the_per_step_variance():
    noise = BandedToeplitzNoise(6, seed=5)
    steps, d = 40, 50_000
    u = _stream(noise, steps, d)
    c = noise.coefficients
    inv = np.linalg.inv(strategy_matrix(c, steps))
    lo, hi = stats.chi2.ppf([1e-5, 1 - 1e-5], d) / d
    for t in range(steps):
        assert noise.phi_factor(t) == pytest.approx((c @ c) * np.sum(inv[t] ** 2), rel=1e-10)
        assert lo < u[t].pow(2).mean().item() / noise.phi_factor(t) < hi
    assert noise.phi_factor(0) == pytest.approx(c @ c)
    assert noise.variance_factor() == noise.phi_factor(steps - 1)
    assert noise.phi_factor(0) < noise.phi_factor(steps - 1) <= noise.phi_factor(10_000)  # grows to a limit


def test_privatizer_noise_variance_is_phi_t():
    """With the privatizer unchanged, ĝ_t's noise variance is (σC/B)² · phi_factor(t) (Φ_t of §7)."""
    p = nn.Parameter(torch.zeros(40_000))
    noise = BandedToeplitzNoise(8, seed=9)
    privatizer = Privatizer(noise)
    sigma, C, B = 0.8, 2.0, 16.0
    lo, hi = stats.chi2.ppf([1e-5, 1 - 1e-5], p.numel()) / p.numel()
    for t in range(4):
        batch = ClippedBatch({p: torch.zeros_like(p)}, None, torch.zeros(0), 0)
        privatizer.privatize(batch, [p], MechanismRequest(), sigma, C, B)
        phi_t = (sigma * C / B) ** 2 * noise.phi_factor(t)
        assert lo < p.grad.double().pow(2).mean().item() / phi_t < hi


def test_prefix_sum_noise_matches_the_analytic_error():
    b, steps, d = 8, 1000, 2000
    noise = BandedToeplitzNoise(b, seed=4)
    prefix = torch.cumsum(_stream(noise, steps, d), dim=0)
    empirical = prefix.pow(2).mean().item()  # mean over t and coordinates of Var(Σ_{s≤t} u_s)
    assert empirical == pytest.approx(prefix_sum_error(noise.coefficients, steps), rel=0.1)
    assert empirical < 0.5 * (steps + 1) / 2  # far below independent noise at equal σ


@pytest.mark.parametrize("k", [2, 7])  # checkpoint with a partial (k < b − 1) and a full history
def test_state_dict_round_trip_continues_the_stream_identically(k):
    b, d = 5, 6
    gen = torch.Generator().manual_seed(0)
    draws = [[torch.randn(d, generator=gen), torch.randn(2, 3, generator=gen)] for _ in range(2 * k)]
    like = [torch.zeros(d), torch.zeros(2, 3)]
    reference = BandedToeplitzNoise(b, source=ScriptedNoise(draws))
    expected = [reference.sample(like) for _ in range(2 * k)][k:]

    first = BandedToeplitzNoise(b, source=ScriptedNoise(draws[:k]))
    for _ in range(k):
        first.sample(like)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as in a Lightning checkpoint
    buffer.seek(0)
    state = torch.load(buffer)
    assert set(state) == {"kind", "coefficients", "steps", "history"}  # no RNG state
    assert len(state["history"][0]) == min(k, b - 1)

    resumed = BandedToeplitzNoise(b, source=ScriptedNoise(draws[k:]))
    resumed.load_state_dict(state)
    assert resumed.steps == k
    for want in expected:
        for a, w in zip(resumed.sample(like), want):
            assert torch.equal(a, w)
    fresh = BandedToeplitzNoise(b, source=ScriptedNoise(draws[k:]))  # without the state: different noise
    assert not torch.equal(fresh.sample(like)[0], expected[0][0])


def test_load_state_dict_checks_coefficients_and_empty_state_restarts():
    noise = BandedToeplitzNoise(3, seed=1)
    noise.sample([torch.zeros(4)])
    with pytest.raises(ValueError, match="coefficients"):
        BandedToeplitzNoise(4, seed=1).load_state_dict(noise.state_dict())
    noise.load_state_dict({})
    assert noise.steps == 0 and noise.memory_numel == 0


def test_memory_is_b_minus_one_vectors():
    b, like = 6, [torch.zeros(10, 3), torch.zeros(5)]
    noise = BandedToeplitzNoise(b, seed=2)
    for _ in range(20):
        noise.sample(like)
    assert noise.memory_numel == (b - 1) * 35


def test_low_precision_gradients_keep_a_float32_history():
    noise = BandedToeplitzNoise(3, seed=2)
    out = noise.sample([torch.zeros(8, dtype=torch.bfloat16)])
    assert out[0].dtype == torch.bfloat16
    assert noise.state_dict()["history"][0][0].dtype == torch.float32


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="bands"):
        BandedToeplitzNoise(0)
    with pytest.raises(ValueError, match="coefficients for bands"):
        BandedToeplitzNoise(3, coefficients=[1.0, 0.5])
    with pytest.raises(ValueError, match="c_0"):
        BandedToeplitzNoise(2, coefficients=[0.0, 0.5])
    with pytest.raises(ValueError, match="either seed or source"):
        BandedToeplitzNoise(2, seed=1, source=GaussianNoise(seed=1))
    noise = BandedToeplitzNoise(3, seed=1)
    noise.sample([torch.zeros(3)])
    with pytest.raises(ValueError, match="once per step"):
        noise.sample([torch.zeros(3), torch.zeros(3)])
    with pytest.raises(ValueError, match="changed shape"):
        noise.sample([torch.zeros(4)])
    with pytest.raises(ValueError, match="step"):
        noise.phi_factor(-1)


def test_advance_keeps_non_noise_ranks_in_step():
    noisy, silent = BandedToeplitzNoise(4, seed=1), BandedToeplitzNoise(4, seed=2)
    for _ in range(5):
        noisy.sample([torch.zeros(3)])
        silent.advance()
    assert silent.variance_factor() == noisy.variance_factor() > noisy.phi_factor(0)
    with pytest.raises(RuntimeError, match="never sample"):
        noisy.advance()
