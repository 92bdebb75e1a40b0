"""DPAdagrad equals a plain re-implementation of each AdaGrad analogue (docs/algorithms.md §1–§5)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_dp.privacy.release import Release
from lightning_dp.optim import DPAdagrad

STEPS = 6
SHAPES = [(4, 2), (3,)]


def fixed_problem(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    theta0 = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    grads = [[0.3 * torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES] for _ in range(STEPS)]
    second = [[0.2 * torch.randn(s, generator=g, dtype=torch.float64) + 0.03 for s in SHAPES] for _ in range(STEPS)]
    clean = [[0.2 * torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES] for _ in range(STEPS)]
    sigma_c_b = [(1.0, 1.0 + 0.2 * (t % 2), 10.0 - t) for t in range(STEPS)]  # C and B change: Φ_t changes
    return theta0, grads, second, clean, sigma_c_b


def reference_adagrad(theta0, grads, second, clean, sigma_c_b, variant, lr, lr_decay, wd, init, eps, gamma):
    out = []
    for k, th0 in enumerate(theta0):
        theta, acc, phi_sum = th0.clone(), torch.full_like(th0, init), 0.0
        for t in range(1, STEPS + 1):
            decay = wd * theta
            g = grads[t - 1][k] + decay
            if variant == "independent_moments":
                acc = acc + second[t - 1][k]
            elif variant == "noiseless":
                acc = acc + (clean[t - 1][k] + decay) ** 2
            else:
                acc = acc + g**2
            sigma, c, b = sigma_c_b[t - 1]
            phi_sum += (sigma * c / b) ** 2
            if variant == "bias_corrected":
                denom = torch.sqrt(torch.clamp(acc - phi_sum, min=gamma))
            elif variant == "independent_moments":
                denom = torch.sqrt(torch.clamp(acc, min=gamma))
            else:
                denom = torch.sqrt(acc) + eps
            theta = theta - lr / (1 + (t - 1) * lr_decay) * g / denom
        out.append(theta)
    return out


def run(theta0, grads, second, clean, sigma_c_b, variant, gamma, **kw):
    params = [torch.nn.Parameter(t.clone()) for t in theta0]
    hp = {"gamma": gamma} if variant in ("bias_corrected", "independent_moments") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = DPAdagrad(params, variant=variant, **kw, **hp)
    for t in range(STEPS):
        for p, g in zip(params, grads[t]):
            p.grad = g.clone()
        sigma, c, b = sigma_c_b[t]
        opt.observe_release(Release(
            noise_std=sigma * c / b, expected_batch_size=b, noise_multiplier=sigma, max_grad_norm=c,
            second_moment=dict(zip(params, second[t])), clean_mean=dict(zip(params, clean[t])),
        ))
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("variant", ["post_processing", "bias_corrected", "independent_moments", "noiseless"])
@pytest.mark.parametrize("wd,init,lr_decay", [(0.0, 0.0, 0.0), (0.05, 0.1, 0.1)], ids=["plain", "decay_init"])
def test_dp_adagrad_matches_reference(variant, wd, init, lr_decay):
    problem = fixed_problem()
    expected = reference_adagrad(*problem, variant, lr=0.05, lr_decay=lr_decay, wd=wd, init=init, eps=1e-8,
                                 gamma=1e-3)
    got = run(*problem, variant, gamma=1e-3, lr=0.05, lr_decay=lr_decay, weight_decay=wd,
              initial_accumulator_value=init, eps=1e-8)
    for e, g, t0 in zip(expected, got, problem[0]):
        assert (e - t0).abs().max() > 1e-3
        torch.testing.assert_close(g, e, atol=1e-9, rtol=0)


def test_post_processing_equals_torch_adagrad():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    b = torch.nn.Parameter(a.detach().clone())
    kw = dict(lr=0.1, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.1, eps=1e-9)
    ref, ours = torch.optim.Adagrad([a], **kw), DPAdagrad([b], **kw)
    for _ in range(6):
        g = torch.randn(5, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
