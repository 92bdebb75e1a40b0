"""DPAdam without Lightning: the docstring's plain loop runs with a hand-built Release."""

from __future__ import annotations

import torch

from lightning_dp.privacy.release import Release
from lightning_dp.optim import DPAdam


def test_plain_loop_with_a_hand_built_release_learns():
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0]) + 0.1
    model = torch.nn.Linear(4, 1)
    opt = DPAdam(model.parameters(), lr=0.1, variant="bias_corrected")  # floor γ' = 0.1·Φ̄
    sigma, c, b = 0.5, 1.0, 32
    loss0 = torch.nn.functional.mse_loss(model(x).squeeze(1), y).item()
    for _ in range(40):
        idx = torch.nonzero(torch.rand(256) < b / 256).squeeze(1)  # Poisson sampling
        opt.zero_grad()
        assert not opt.mechanism_request().second_moment
        per_example = [torch.autograd.grad(torch.nn.functional.mse_loss(model(x[i:i + 1]).squeeze(1), y[i:i + 1]),
                                           list(model.parameters())) for i in idx.tolist()]
        norms = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in per_example])
        factors = (c / (norms + 1e-6)).clamp(max=1.0)
        for k, p in enumerate(model.parameters()):
            s = sum(f * gs[k] for f, gs in zip(factors, per_example))
            p.grad = (s + sigma * c * torch.randn_like(p)) / b
        opt.observe_release(Release(noise_std=sigma * c / b, expected_batch_size=b, noise_multiplier=sigma,
                                    max_grad_norm=c))
        opt.step()
    assert torch.nn.functional.mse_loss(model(x).squeeze(1), y).item() < 0.5 * loss0
