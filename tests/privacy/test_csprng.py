"""Secure mode (privacy/csprng.py): OS-CSPRNG uniforms, Box–Muller, the summed-Gaussian mitigation."""
# The secure generator cannot be seeded: every statistical bound here is set at a false-failure level
# of about 1e-7 (a 10 % error in σ or a wrong distribution still fails by many standard deviations).

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from lightning_dp.privacy import csprng
from lightning_dp.privacy.min_sep_sampling import MinSepPoissonBatchSampler

N = 200_000


def test_uniforms_are_in_range_with_uniform_moments():
    u = csprng.secure_uniform(N)
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / N)
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-7


def _variance_ok(z: torch.Tensor, sigma: float) -> bool:
    ratio = float(z.double().pow(2).mean()) / sigma ** 2
    lo, hi = stats.chi2.ppf([5e-8, 1 - 5e-8], z.numel()) / z.numel()
    return lo < ratio < hi


def test_secure_noise_is_n_0_sigma2_per_coordinate():
    torch.manual_seed(0)
    like = [torch.zeros(300, 300), torch.zeros(50_000)]
    z = torch.cat([t.flatten() for t in csprng.SecureGaussianNoise().sample(like)])
    assert _variance_ok(z, 1.0)
    for wrong in (0.9, 1.1):  # a 10 % error in σ fails
        assert not _variance_ok(z / wrong, 1.0)
    assert abs(float(z.mean())) < 6 / math.sqrt(z.numel())
    assert stats.kstest(z.double().numpy(), "norm").pvalue > 1e-7


def test_the_mitigation_sums_four_draws_and_keeps_the_variance(monkeypatch):
    calls = []
    original = csprng.secure_standard_normal
    monkeypatch.setattr(csprng, "secure_standard_normal", lambda c: calls.append(c) or original(c))
    z = csprng.secure_gaussian(N)
    assert calls == [csprng.SUMMED_DRAWS * N]
    assert _variance_ok(z, 1.0)


def test_two_draws_are_independent_and_add_noise_is_in_place():
    noise = csprng.SecureGaussianNoise()
    a, b = (noise.sample([torch.zeros(N)])[0] for _ in range(2))
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 6 / math.sqrt(N)
    t = torch.full((N,), 3.0)
    noise.add_noise_([t], std=0.5, scale_by=2.0)
    assert _variance_ok(t - 6.0, 0.5)
    assert noise.state_dict() == {}


def test_secure_sampler_includes_each_example_with_rate_q_and_takes_no_seed():
    sampler = MinSepPoissonBatchSampler(1000, 0.1, 50, 1, secure=True)
    counts = torch.zeros(1000)
    for batch in sampler:
        counts[batch] += 1
    total = float(counts.sum())
    assert abs(total - 1000 * 0.1 * 50) < 5 * math.sqrt(1000 * 50 * 0.1 * 0.9)
    with pytest.raises(ValueError, match="no seed"):
        MinSepPoissonBatchSampler(1000, 0.1, 50, 1, seed=0, secure=True)
