"""DPAdam equals a plain re-implementation of each variant's formula (docs/algorithms.md §1–§5).

The reference below is written from the formulas, with python loops over the
steps and no code shared with the package. Gradients and releases are fixed.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lightning_dp.privacy.release import Release
from lightning_dp.optim import DPAdam

STEPS = 7
SHAPES = [(3, 4), (5,)]


def fixed_problem(seed: int = 0):
    """Initial params, per-step gradients, releases (noise std ~ gradient size so floors bite)."""
    g = torch.Generator().manual_seed(seed)
    theta0 = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    grads = [[0.4 * torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES] for _ in range(STEPS)]
    second = [[0.3 * torch.randn(s, generator=g, dtype=torch.float64) + 0.05 for s in SHAPES] for _ in range(STEPS)]
    clean = [[0.2 * torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES] for _ in range(STEPS)]
    sigma_c_b = [(1.0 + 0.1 * t, 1.0, 8.0) for t in range(STEPS)]  # σ changes: Φ_t changes
    return theta0, grads, second, clean, sigma_c_b


def reference_adam(theta0, grads, second, clean, sigma_c_b, variant, lr, b1, b2, eps, wd, decoupled, gamma):
    """Adam written from docs/algorithms.md, per parameter, with explicit sums for Φ̄."""
    out = []
    for k, th0 in enumerate(theta0):
        theta, m, v, phis = th0.clone(), torch.zeros_like(th0), torch.zeros_like(th0), []
        for t in range(1, STEPS + 1):
            g = grads[t - 1][k]
            if decoupled:
                theta = theta * (1 - lr * wd)
                decay = 0.0
            else:
                decay = wd * theta
                g = g + decay
            m = b1 * m + (1 - b1) * g
            if variant == "independent_moments":
                x = second[t - 1][k]
            elif variant == "noiseless":
                x = (clean[t - 1][k] + decay) ** 2
            else:
                x = g**2
            v = b2 * v + (1 - b2) * x
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            sigma, c, b = sigma_c_b[t - 1]
            phis.append((sigma * c / b) ** 2)
            if variant == "bias_corrected":
                phi_bar = sum((1 - b2) * b2 ** (t - s) * phis[s - 1] for s in range(1, t + 1)) / (1 - b2**t)
                denom = torch.sqrt(torch.clamp(v_hat - phi_bar, min=gamma))
            elif variant == "independent_moments":
                denom = torch.sqrt(torch.clamp(v_hat, min=gamma))
            else:
                denom = torch.sqrt(v_hat) + eps
            theta = theta - lr * m_hat / denom
        out.append(theta)
    return out


def run_dp_adam(theta0, grads, second, clean, sigma_c_b, variant, **kw):
    params = [torch.nn.Parameter(t.clone()) for t in theta0]
    gamma = kw.pop("gamma")
    hp = {"gamma": gamma} if variant in ("bias_corrected", "independent_moments") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = DPAdam(params, variant=variant, **kw, **hp)
    for t in range(STEPS):
        for p, g in zip(params, grads[t]):
            p.grad = g.clone()
        sigma, c, b = sigma_c_b[t]
        opt.observe_release(Release(
            noise_std=sigma * c / b, expected_batch_size=b, noise_multiplier=sigma, max_grad_norm=c,
            second_moment={p: s for p, s in zip(params, second[t])},
            clean_mean={p: s for p, s in zip(params, clean[t])},
        ))
        opt.step()
    return [p.detach() for p in params]


VARIANTS = ["post_processing", "bias_corrected", "independent_moments", "noiseless"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("wd,decoupled", [(0.0, False), (0.05, False), (0.1, True)], ids=["adam", "adam_l2", "adamw"])
def test_dp_adam_matches_reference(variant, wd, decoupled):
    problem = fixed_problem()
    hp = dict(lr=0.01, b1=0.9, b2=0.95, eps=1e-6, wd=wd, decoupled=decoupled, gamma=1e-3)
    expected = reference_adam(*problem, variant, **hp)
    got = run_dp_adam(*problem, variant, lr=0.01, betas=(0.9, 0.95), eps=1e-6, weight_decay=wd,
                      decoupled_weight_decay=decoupled, gamma=1e-3)
    for e, g, t0 in zip(expected, got, problem[0]):
        assert (e - t0).abs().max() > 1e-3  # the parameters did move
        torch.testing.assert_close(g, e, atol=1e-9, rtol=0)


def test_bias_correction_floor_is_active_and_changes_the_result():
    """The fixture makes v̂ − Φ̄ negative on some coordinates: bias correction must differ from plain."""
    problem = fixed_problem()
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.0, decoupled_weight_decay=False, gamma=1e-3)
    plain = run_dp_adam(*problem, "post_processing", **dict(kw))
    corrected = run_dp_adam(*problem, "bias_corrected", **dict(kw))
    assert not torch.allclose(plain[0], corrected[0], atol=1e-4)


def test_post_processing_equals_torch_adam_and_adamw():
    torch.manual_seed(0)
    for torch_cls, kw in [(torch.optim.Adam, dict(weight_decay=0.05)),
                          (torch.optim.AdamW, dict(weight_decay=0.1))]:
        a = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))]
        b = [torch.nn.Parameter(a[0].detach().clone())]
        ref = torch_cls(a, lr=0.02, betas=(0.8, 0.99), eps=1e-7, **kw)
        ours = DPAdam(b, lr=0.02, betas=(0.8, 0.99), eps=1e-7, decoupled_weight_decay=torch_cls is torch.optim.AdamW,
                      **kw)
        for _ in range(6):
            g = torch.randn(4, 3, dtype=torch.float64)
            a[0].grad, b[0].grad = g.clone(), g.clone()
            ref.step()
            ours.step()  # post_processing needs no release
        torch.testing.assert_close(b[0], a[0], atol=1e-12, rtol=0)


def test_phi_ema_state_is_the_bias_corrected_average():
    """The checkpointed Φ EMA, divided by 1−β2^t, is Σ (1-β2) β2^{t-s} Φ_s / (1-β2^t)."""
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = DPAdam([p], betas=(0.9, 0.9), variant="bias_corrected")
    phis = []
    for t, (sigma, c, b) in enumerate([(1.0, 1.0, 10.0), (2.0, 1.0, 10.0), (1.0, 0.5, 10.0), (1.0, 1.0, 4.0)], 1):
        p.grad = torch.ones(3, dtype=torch.float64)
        opt.observe_release(Release(noise_std=sigma * c / b, expected_batch_size=b, noise_multiplier=sigma,
                                    max_grad_norm=c))
        opt.step()
        phis.append((sigma * c / b) ** 2)
        expected = sum(0.1 * 0.9 ** (t - s) * phis[s - 1] for s in range(1, t + 1)) / (1 - 0.9**t)
        assert math.isclose(float(opt.state[p]["phi"]) / (1 - 0.9**t), expected, rel_tol=1e-9)
    assert "phi" in opt.state_dict()["state"][0]
