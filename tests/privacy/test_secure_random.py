"""Secure mode, the checks test_csprng.py leaves open (each one mutation-checked):

- ``add_noise_`` gives every coordinate its own fresh draw (no two tensors, chunks or steps share
  one), with t ← scale_by · t + std · z exactly;
- the secure noise and sampler are not reproducible from torch's global seed;
- the secure sampler really takes its uniforms from the CSPRNG (:func:`csprng.secure_uniform`),
  and each example's inclusion count over many steps is Binomial(steps it is eligible, q_g).
"""

from __future__ import annotations

import math

import torch
from scipy import stats

from lightning_dp.privacy import csprng, min_sep_sampling
from lightning_dp.privacy.min_sep_sampling import MinSepPoissonBatchSampler


def _chi2_variance_ok(z: torch.Tensor, sigma: float) -> bool:
    """E[z²] = σ² at two-sided level 1e-7 (a 10 % error in σ fails for ≥ 10⁴ coordinates)."""
    ratio = float(z.double().pow(2).mean()) / sigma**2
    lo, hi = stats.chi2.ppf([5e-8, 1 - 5e-8], z.numel()) / z.numel()
    return lo < ratio < hi


def _like() -> list[torch.Tensor]:
    """float64, two equal tensors, one longer than 2¹⁶, one non-contiguous; values in [-1, 1].

    The test recovers z = (t − 2b)/0.5 from t = fl(2b + 0.5 z), so z comes back on a grid of 2·ulp(t): two
    independent draws then collide with probability ≈ grid/(2√π) per pair. With the values 0…29,999 this test first
    had (|t| up to 2¹⁶: a grid of 2⁻³⁶ for 13,616 coordinates) that was ≈ 1e-3 per run: the flaky failure of
    ``torch.unique``. In [-1, 1] (|t| < 8 unless |z| > 12: a grid ≤ 2⁻⁴⁹) the 106,000 coordinates' 5.6e9
    pairs collide with probability ≤ 5.6e9 · 2⁻⁴⁹ · 0.28 ≈ 3e-6 per run. A draw shared between the two equal
    tensors (or any two coordinates with one b) still comes back bit for bit equal: refused with certainty."""
    return [
        torch.arange(3000, dtype=torch.float64) / 3000,
        torch.arange(3000, dtype=torch.float64) / 3000,
        torch.linspace(-1, 1, 70_000, dtype=torch.float64),
        (torch.arange(200 * 150, dtype=torch.float64) / 30_000).view(200, 150).t(),
    ]


def test_add_noise_is_scale_plus_fresh_draw_per_coordinate():
    """False failure per run: chi² 1e-7, mean and correlation 2e-9 each (6σ), uniqueness ≈ 3e-6 (:func:`_like`).
    Power: σ off by 10 % fails the chi² band (ratio 0.81 or 1.23 against ±0.023) with certainty; a draw reused by
    the two equal tensors fails uniqueness (and the correlation) with certainty."""
    std, scale_by = 0.5, 2.0
    tensors = _like()
    before = [t.clone() for t in tensors]
    csprng.SecureGaussianNoise().add_noise_(tensors, std=std, scale_by=scale_by)
    z = torch.cat([((t - scale_by * b) / std).flatten() for t, b in zip(tensors, before)])
    assert _chi2_variance_ok(z, 1.0)
    assert not _chi2_variance_ok(z / 0.9, 1.0) and not _chi2_variance_ok(z / 1.1, 1.0)
    assert abs(float(z.mean())) < 6 / math.sqrt(z.numel())
    assert torch.unique(z).numel() == z.numel()  # no coordinate shares a draw with another
    first, second = (z[:3000], z[3000:6000])
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 6 / math.sqrt(3000)


def test_noise_is_fresh_each_step_and_not_reproducible_from_torch_seed():
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        tensors = [torch.zeros(10_000, dtype=torch.float64)]
        csprng.SecureGaussianNoise().add_noise_(tensors, std=1.0)
        draws.append(tensors[0])
    assert torch.unique(torch.cat(draws)).numel() == 20_000
    assert abs(float(torch.corrcoef(torch.stack(draws))[0, 1])) < 6 / math.sqrt(10_000)


def test_secure_sampler_takes_its_uniforms_from_the_csprng(monkeypatch):
    calls = []
    original = min_sep_sampling.secure_uniform
    monkeypatch.setattr(min_sep_sampling, "secure_uniform", lambda n: calls.append(n) or original(n))
    batches = list(MinSepPoissonBatchSampler(101, 0.5, 4, bands=2, secure=True))
    assert calls == [51, 50, 51, 50]
    assert all(i % 2 == t % 2 for t, batch in enumerate(batches) for i in batch)
    calls.clear()
    list(MinSepPoissonBatchSampler(101, 0.5, 4, bands=2, seed=0))
    assert calls == []  # the default path is untouched


def test_secure_sampler_is_not_reproducible_from_torch_seed():
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(list(MinSepPoissonBatchSampler(1000, 0.5, 3, bands=1, secure=True)))
    assert runs[0] != runs[1]  # equal with probability 2⁻³⁰⁰⁰


def test_secure_sampler_inclusion_counts_are_binomial_per_example():
    num, q, bands, steps = 1000, 0.2, 2, 200
    counts = torch.zeros(num)
    for batch in MinSepPoissonBatchSampler(num, q, steps, bands=bands, secure=True):
        counts[batch] += 1
    eligible = steps // bands  # each example is in the active group every b-th step
    total = float(counts.sum())
    assert stats.binomtest(int(total), num * eligible, q).pvalue > 1e-7
    # per-example dispersion: Σ (c − mq)² / (mq(1 − q)) ~ χ²(N) if every step draws anew
    dispersion = float(((counts - eligible * q) ** 2).sum()) / (eligible * q * (1 - q))
    assert stats.chi2.sf(dispersion, num) > 1e-7 and stats.chi2.cdf(dispersion, num) > 1e-7
