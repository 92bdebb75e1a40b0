"""Scale-then-privatize's request: s_t = 1/(sqrt(v_{t-1}) + eps_s), uniform at t = 1 (docs/algorithms.md §4)."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.privacy.release import Release
from lightning_dp.optim import DPAdagrad, DPAdam


def _release(params, scale, noise_std=0.1):
    return Release(noise_std=noise_std, expected_batch_size=10.0, noise_multiplier=1.0, max_grad_norm=1.0,
                   scale=scale)


def test_first_scale_is_uniform_then_follows_raw_v():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2, dtype=torch.float64)), torch.nn.Parameter(torch.randn(4))]
    eps_s, b2 = 0.01, 0.9
    opt = DPAdam(params, betas=(0.5, b2), variant="scale_then_privatize", eps_s=eps_s)
    request = opt.mechanism_request()
    assert not request.second_moment and not request.clean_mean
    for p in params:
        torch.testing.assert_close(request.scale[p], torch.full_like(p, 1 / eps_s))
    v = [torch.zeros_like(p) for p in params]
    for _ in range(5):
        for k, p in enumerate(params):
            p.grad = torch.randn_like(p)
            v[k] = b2 * v[k] + (1 - b2) * p.grad**2  # the raw Adam v (no bias correction)
        opt.observe_release(_release(params, request.scale))
        opt.step()
        request = opt.mechanism_request()
        assert opt.mechanism_request().scale[params[0]] is request.scale[params[0]]  # idempotent within a step
        for k, p in enumerate(params):
            torch.testing.assert_close(request.scale[p], 1 / (v[k].sqrt() + eps_s))


def test_update_is_plain_adam_on_the_unscaled_gradient():
    torch.manual_seed(1)
    a = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    b = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.Adam([a], lr=0.01)
    opt = DPAdam([b], lr=0.01, variant="scale_then_privatize")
    for _ in range(5):
        g = torch.randn(6, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        opt.observe_release(_release([b], opt.mechanism_request().scale))
        ref.step()
        opt.step()
    torch.testing.assert_close(b, a, atol=1e-12, rtol=0)


def test_refresh_every_keeps_the_scale_fixed_for_tau_steps():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = DPAdam([p], variant="scale_then_privatize", eps_s=0.1, refresh_every=3)
    scales = []
    for t in range(7):
        scales.append(opt.mechanism_request().scale[p].clone())
        p.grad = torch.full((3,), float(t + 1))
        opt.observe_release(_release([p], {p: scales[-1]}))
        opt.step()
    assert all(torch.equal(s, scales[0]) for s in scales[:3])  # t = 0, 1, 2: uniform
    assert all(torch.equal(s, scales[3]) for s in scales[3:6])
    assert not torch.equal(scales[3], scales[0]) and not torch.equal(scales[6], scales[3])
    torch.testing.assert_close(scales[0], torch.full((3,), 10.0))


def test_adagrad_scale_uses_the_accumulator():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = DPAdagrad([p], initial_accumulator_value=0.25, variant="scale_then_privatize", eps_s=0.5)
    torch.testing.assert_close(opt.mechanism_request().scale[p], torch.full((2,), 1 / (0.5 + 0.5)))
    p.grad = torch.tensor([1.0, 2.0])
    opt.observe_release(_release([p], opt.mechanism_request().scale))
    opt.step()
    torch.testing.assert_close(opt.mechanism_request().scale[p], 1 / (torch.tensor([1.25, 4.25]).sqrt() + 0.5))


@pytest.mark.parametrize("bad", [dict(eps_s=0.0), dict(refresh_every=0), dict(refresh_every=1.5)])
def test_bad_hparams_are_refused(bad):
    with pytest.raises(ValueError):
        DPAdam([torch.nn.Parameter(torch.zeros(1))], variant="scale_then_privatize", **bad)
