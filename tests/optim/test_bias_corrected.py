"""Φ of DP-AdamBC (docs/algorithms.md §2): per-coordinate under a scale, back-filled when switched on late."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_dp.privacy.release import Release
from lightning_dp.optim import DPAdagrad, DPAdam, to_dp_optimizer


def release(noise_std, scale=None):
    return Release(noise_std=noise_std, expected_batch_size=16.0, noise_multiplier=1.0, max_grad_norm=1.0,
                   scale=scale)


def test_phi_is_per_coordinate_under_a_scale():
    """With release.scale, the noise in the unscaled ĝ has variance (noise_std / s)² per coordinate."""
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    s = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    g = torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64)
    opt = DPAdam([p], lr=0.1, betas=(0.9, 0.99), variant="bias_corrected", gamma=1e-6)
    p.grad = g.clone()
    opt.observe_release(release(0.2, {p: s}))
    opt.step()
    v_hat, phi = g**2, (0.2 / s) ** 2  # t = 1: v̂ = ĝ², Φ̄ = Φ
    expected = -0.1 * g / torch.sqrt(torch.clamp(v_hat - phi, min=1e-6))
    torch.testing.assert_close(p.detach(), expected, atol=1e-12, rtol=0)
    assert torch.unique(p.detach()).numel() == 3  # the scale made the coordinates differ


def test_switching_on_late_backfills_phi():
    """Post-processing for 3 steps, bias correction from step 4: Φ̄ must equal the constant Φ, not a cold EMA."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    theta, m, v = p.detach().clone(), torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    lr, b1, b2, eps, gamma, noise_std = 0.01, 0.9, 0.99, 1e-8, 1e-4, 0.3
    opt = DPAdam([p], lr=lr, betas=(b1, b2), eps=eps)
    for t in range(1, 7):
        if t == 4:
            opt = to_dp_optimizer(opt, "bias_corrected", gamma=gamma)
        g = torch.randn(5, dtype=torch.float64)
        p.grad = g.clone()
        opt.observe_release(release(noise_std))
        opt.step()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g**2
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        denom = torch.sqrt(v_hat) + eps if t < 4 else torch.sqrt(torch.clamp(v_hat - noise_std**2, min=gamma))
        theta = theta - lr * m_hat / denom
    torch.testing.assert_close(p.detach(), theta, atol=1e-10, rtol=0)


def test_adagrad_backfill_is_t_minus_one_times_phi():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = DPAdagrad([p], lr=0.1)
    for t in range(1, 5):
        if t == 3:
            opt = to_dp_optimizer(opt, "bias_corrected")
        p.grad = torch.ones(2, dtype=torch.float64)
        opt.observe_release(release(0.5))
        opt.step()
    assert float(opt.state[p]["phi"]) == pytest.approx(4 * 0.25)


def test_gamma_must_be_positive():
    with pytest.raises(ValueError, match="gamma"):
        DPAdam([torch.nn.Parameter(torch.zeros(1))], variant="bias_corrected", gamma=0.0)


def test_the_default_floor_is_relative_to_phi():
    """Without gamma, γ' = 0.1·Φ̄: a coordinate with v̂ − Φ̄ below it is divided by √(0.1 Φ̄), one above by
    √(v̂ − Φ̄) (issue 35: the absolute 1e-8 was ~1e-5 of the digits job's Φ)."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    g = torch.tensor([0.2, 0.5], dtype=torch.float64)  # v̂ = ĝ² at t = 1: 0.04 and 0.25 against Φ = 0.04
    opt = DPAdam([p], lr=0.1, variant="bias_corrected")
    p.grad = g.clone()
    opt.observe_release(release(0.2))
    opt.step()
    denom = torch.sqrt(torch.tensor([0.1 * 0.04, 0.25 - 0.04], dtype=torch.float64))
    torch.testing.assert_close(p.detach(), -0.1 * g / denom, atol=1e-12, rtol=0)
    assert opt.state_dict()["dp_variant"]["hparams"] == {"gamma_phi": 0.1}


def _largest_step(steps: int = 40, **hparams) -> float:
    """The largest |Δθ| / lr of DP-AdamBC on gradients that are DP noise alone (Φ of the digits job, 7e-4)."""
    torch.manual_seed(0)
    std = 0.0268  # σC/B = 1.716 · 1 / 64
    p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float64))
    opt = DPAdam([p], lr=0.01, variant="bias_corrected", **hparams)
    largest = 0.0
    for _ in range(steps):
        before = p.detach().clone()
        p.grad = std * torch.randn(1000, dtype=torch.float64)
        opt.observe_release(release(std))
        opt.step()
        largest = max(largest, float((p.detach() - before).abs().max()) / 0.01)
    return largest


def test_steps_on_noise_stay_near_the_learning_rate_by_default_and_explode_with_a_tiny_absolute_gamma():
    assert _largest_step() < 5  # relative floor: ≤ 1/√(0.1·1.1) ≈ 3 at t = 1 (m̂ = ĝ), ≈ 0.7 typical later
    with pytest.warns(UserWarning, match="explo|diverge"):
        assert _largest_step(gamma=1e-8) > 100  # the README's old example: ~2,000× lr at the floor


def test_an_explosive_absolute_gamma_is_warned_once_and_a_safe_one_not_at_all():
    with pytest.warns(UserWarning, match=r"bias_corrected: gamma = 1e-08 is 1\.4e-05 of the noise variance") as caught:
        _largest_step(steps=3, gamma=1e-8)
    assert len([w for w in caught if "bias_corrected: gamma" in str(w.message)]) == 1
    with pytest.warns(UserWarning, match="gamma_phi = 0.001"):
        DPAdam([torch.nn.Parameter(torch.zeros(1))], variant="bias_corrected", gamma_phi=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _largest_step(steps=3, gamma=1e-5)  # 1.4e-2 of Φ: above the warning's threshold (1e-2)
        _largest_step(steps=3, gamma_phi=0.01)


def test_gamma_phi_must_be_positive():
    with pytest.raises(ValueError, match="gamma_phi must be > 0"):
        DPAdam([torch.nn.Parameter(torch.zeros(1))], variant="bias_corrected", gamma_phi=0.0)
