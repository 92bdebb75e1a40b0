"""PrivateStandardizer (data/private_standardizer.py): the Gaussian mechanism's noise at σ·Δ with Δ derived for
add/remove of one clipped record, the clipping bound, the ledger charged (RDP α/(2σ²) per release, composed with the
training's, kept by a resume), and clear errors on bad input."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.accounting import RDP_ORDERS, PrivacyLedger, ledger_epsilon, rdp_to_epsilon, step_rdp
from lightning_dp.data import PrivateStandardizer
from lightning_dp.data.private_standardizer import centred_sums

LOWER = torch.tensor([-1.0, 0.0, 2.0, -10.0, 0.0], dtype=torch.float64)
UPPER = torch.tensor([1.0, 4.0, 3.0, 10.0, 0.5], dtype=torch.float64)


def _features(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return LOWER + (UPPER - LOWER) * torch.rand(n, len(LOWER), generator=g, dtype=torch.float64)


def test_sensitivities_are_the_formulas_and_are_reached_by_one_record_and_never_exceeded():
    d_s, d_q, d_n = PrivateStandardizer(LOWER, UPPER, 1.0).sensitivities()
    assert (d_s, d_q, d_n) == pytest.approx((math.sqrt(5), math.sqrt(5) / 2, 1.0))
    x = _features(50)
    s, q = centred_sums(x, LOWER, UPPER)
    g = torch.Generator().manual_seed(1)
    records = [UPPER, LOWER, (LOWER + UPPER) / 2, UPPER + 100, LOWER - 100,
               *(LOWER + (UPPER - LOWER) * torch.rand(len(LOWER), generator=g, dtype=torch.float64) * 3 - 1
                 for _ in range(200))]
    moved = []
    for r in records:  # add one record (removing it is the same difference)
        s2, q2 = centred_sums(torch.cat([x, r[None]]), LOWER, UPPER)
        moved.append((float((s2 - s).norm()), float((q2 - q).norm())))
    assert max(m for m, _ in moved) <= d_s * (1 + 1e-12) and max(m for _, m in moved) <= d_q * (1 + 1e-12)
    assert moved[0][0] == pytest.approx(d_s) and moved[0][1] == pytest.approx(d_q)  # a corner reaches both
    assert moved[2][1] == pytest.approx(d_q)  # the centre: every square at its low end


def test_the_noise_has_standard_deviation_sigma_times_the_sensitivity():
    """400 releases × 5 features: the variance of S̃ − S over σ²Δ_S² is 1 to 3.2 % (one sd); a constant off by
    √2 (or a Δ of the range 2 instead of the half-range 1 per feature) is 10+ sd away."""
    x, sigma, k = _features(300), 0.7, 400
    s, q = centred_sums(x, LOWER, UPPER)
    gen = torch.Generator().manual_seed(2)
    fits = [PrivateStandardizer(LOWER, UPPER, sigma, generator=gen).fit(x, PrivacyLedger()) for _ in range(k)]
    d_s, d_q, _ = fits[0].sensitivities()
    z_s = torch.stack([(f.noisy_sum - s) / (sigma * d_s) for f in fits])
    z_q = torch.stack([(f.noisy_squares - q) / (sigma * d_q) for f in fits])
    z_n = torch.tensor([(f.noisy_count - len(x)) / sigma for f in fits])
    tol = 4 * math.sqrt(2 / z_s.numel())
    assert abs(float(z_s.var()) - 1) < tol and abs(float(z_q.var()) - 1) < tol
    assert abs(float(z_n.var()) - 1) < 4 * math.sqrt(2 / k)
    assert abs(float(z_s.mean())) < 4 / math.sqrt(z_s.numel())  # unbiased


def test_values_are_clipped_to_the_public_range_and_the_estimates_are_sane():
    x = _features(20_000, seed=3)
    outside = x.clone()
    outside[:, 0] += 50.0  # every value of feature 0 far above its upper bound
    scaler = PrivateStandardizer(LOWER, UPPER, 1.0, generator=torch.Generator().manual_seed(4)).fit(outside,
                                                                                                PrivacyLedger())
    noise = 1.0 * math.sqrt(5) / len(x)  # σ·Δ_S·h / n, the mean's noise (h = 1 for feature 0)
    assert scaler.mean[0] == pytest.approx(1.0, abs=6 * noise)  # the clipped values: all at hi
    assert 0.01 * 2.0 <= scaler.std[0] < 0.1  # no spread left but the noise's; the floor min_std·(hi − lo) below
    low = PrivateStandardizer(LOWER, UPPER, 1.0, generator=torch.Generator().manual_seed(5)).fit(
        torch.zeros(3, 5) + LOWER, PrivacyLedger())
    assert torch.all(low.std >= 0.01 * (UPPER - LOWER)) and torch.all(low.std <= (UPPER - LOWER) / 2)
    assert torch.all(low.mean >= LOWER) and torch.all(low.mean <= UPPER)  # 3 records: noise dominates, clamped
    truth_mean, truth_std = x.mean(0)[1:], x.std(0, correction=0)[1:]
    assert torch.allclose(scaler.mean[1:], truth_mean, atol=0.02 * float((UPPER - LOWER).max()))
    assert torch.allclose(scaler.std[1:], truth_std, rtol=0.05)
    z = scaler.transform(outside)
    assert z.dtype == torch.float64 and torch.allclose(z[:, 0], (1.0 - scaler.mean[0]) / scaler.std[0])
    assert scaler.transform(np.zeros((3, 5))).dtype == torch.float32


def test_the_ledger_is_charged_one_gaussian_release_each_at_q_1_with_rdp_alpha_over_2_sigma_squared():
    sigma = 3.0
    ledger = PrivacyLedger()
    PrivateStandardizer(LOWER, UPPER, sigma).fit(_features(100), ledger)
    assert [(e.noise_multiplier, e.sample_rate, e.steps) for e in ledger.entries] == [(sigma, 1.0, 3)]
    public = PrivacyLedger()
    PrivateStandardizer(LOWER, UPPER, sigma, count=100).fit(_features(100), public)
    assert public.steps == 2  # the public count is not released
    closed = np.array([a / (2 * sigma**2) for a in RDP_ORDERS])
    assert np.allclose(step_rdp(sigma, 1.0), closed, rtol=1e-9)
    assert ledger_epsilon(ledger, 1e-5, "rdp") == pytest.approx(rdp_to_epsilon(3 * closed, RDP_ORDERS, 1e-5))


def test_a_fit_after_it_reports_the_composed_epsilon_and_a_resume_keeps_it(tmp_path):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(100, 4, generator=g) * 3 + 1
    y = (x[:, 0] > 1).long()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    scaler = PrivateStandardizer(-8.0, 10.0, 4.0)
    features = scaler.fit_transform(x, strategy)
    loader = DataLoader(TensorDataset(features, y), batch_size=10)
    quiet_trainer(strategy=strategy, max_epochs=1, enable_checkpointing=True,
                  callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(TinyClassifier(), loader)
    first, *training = strategy.ledger.entries
    assert (first.noise_multiplier, first.sample_rate, first.steps, first.run) == (4.0, 1.0, 3, scaler.run)
    assert training and all(e.sample_rate == pytest.approx(0.1) for e in training)
    alone = ledger_epsilon(training, 1e-5)
    assert ledger_epsilon(strategy.ledger, 1e-5) > alone + 0.05
    resumed = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=resumed, max_epochs=2).fit(TinyClassifier(), loader, ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.ledger.entries[0] == first
    assert ledger_epsilon(resumed.ledger, 1e-5) >= ledger_epsilon(strategy.ledger, 1e-5)
    other = PrivacyLedger()
    scaler.charge(other)  # a second model trained on the same features spends them too
    assert other.entries == (first,)


@pytest.mark.parametrize("make, fit_on, match", [
    (lambda: PrivateStandardizer(1.0, 1.0, 1.0), None, "lower < upper"),
    (lambda: PrivateStandardizer([0.0, 2.0], [1.0, 1.0], 1.0), None, "lower < upper"),
    (lambda: PrivateStandardizer(0.0, 1.0, 0.0), None, "noise_multiplier"),
    (lambda: PrivateStandardizer(0.0, 1.0, -1.0), None, "noise_multiplier"),
    (lambda: PrivateStandardizer(0.0, 1.0, float("nan")), None, "noise_multiplier"),
    (lambda: PrivateStandardizer(0.0, float("inf"), 1.0), None, "finite"),
    (lambda: PrivateStandardizer(0.0, 1.0, 1.0), torch.tensor([[0.5, float("nan")]]), "NaN"),
    (lambda: PrivateStandardizer(0.0, 1.0, 1.0), torch.zeros(0, 2), "empty"),
    (lambda: PrivateStandardizer(0.0, 1.0, 1.0, count=5), torch.zeros(4, 2), "public count"),
])
def test_bad_input_is_a_clear_error(make, fit_on, match):
    ledger = PrivacyLedger()
    with pytest.raises(PrivacyConfigurationError, match=match):
        make().fit(torch.zeros(4, 2) if fit_on is None else fit_on, ledger)
    assert ledger.steps == 0  # nothing charged, nothing released


def test_the_charge_must_be_a_ledger_per_example():
    with pytest.raises(PrivacyConfigurationError, match="PrivacyLedger"):
        PrivateStandardizer(0.0, 1.0, 1.0).fit(torch.zeros(4, 2), None)
    per_user = PrivacyLedger()
    per_user.unit = "user"
    with pytest.raises(PrivacyConfigurationError, match="per user"):
        PrivateStandardizer(0.0, 1.0, 1.0).fit(torch.zeros(4, 2), per_user)


def test_a_noise_multiplier_set_to_zero_after_init_is_refused_at_fit():
    scaler = PrivateStandardizer(0.0, 1.0, noise_multiplier=1.0)
    scaler.noise_multiplier = 0.0
    with pytest.raises(PrivacyConfigurationError, match="noise_multiplier must be a finite number > 0"):
        scaler.fit(torch.rand(10, 2), PrivacyLedger())


def test_a_seeded_generator_warns_known_seed_and_is_refused_where_that_is_an_error():
    """zoo28 p07: noise from ``manual_seed(0)`` is re-drawn by whoever knows the seed (the exact mean and deviation
    follow), as DPStrategy's seeded noise: KnownSeedWarning naming secure mode; an error where the user made it one."""
    from lightning_dp.errors import KnownSeedWarning

    x = _features(100)
    with pytest.warns(KnownSeedWarning, match="secure_mode"):
        PrivateStandardizer(LOWER, UPPER, 1.0, generator=torch.Generator().manual_seed(0)).fit(x, PrivacyLedger())
    with warnings.catch_warnings():
        warnings.simplefilter("error", KnownSeedWarning)
        with pytest.raises(PrivacyConfigurationError, match="KnownSeedWarning is an error"):
            PrivateStandardizer(LOWER, UPPER, 1.0, generator=torch.Generator().manual_seed(0)).fit(x, PrivacyLedger())
        PrivateStandardizer(LOWER, UPPER, 1.0).fit(x, PrivacyLedger())  # the OS's CSPRNG: nothing to say
