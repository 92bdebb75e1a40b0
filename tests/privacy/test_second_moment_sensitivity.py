"""Independent moments (docs/algorithms.md §3, per-example form): the second statistic
Σ_i clip_C(g_i)² is noised for sensitivity C². An adversarial search over neighbouring
batches (one example added) must never move it by more than C², and must get close."""

import torch

from lightning_dp.grad_sample import clip_and_sum_materialised


def _square_sum(samples, C):
    p = torch.nn.Parameter(torch.zeros(samples.shape[1:]))
    return clip_and_sum_materialised([p], [samples], C, with_squares=True).square_sums[p]


def test_adversarial_neighbours_never_exceed_c_squared():
    torch.manual_seed(0)
    C, d = 0.7, 16
    base = torch.randn(8, d) * 3
    without = _square_sum(base, C)
    worst = 0.0
    # Random candidates of every shape: dense, sparse, huge, tiny.
    for scale in (1e-3, 0.1, 1.0, 100.0):
        for k in (1, 2, 4, d):
            g = torch.zeros(200, d)
            g[:, :k] = torch.randn(200, k) * scale
            for row in g:
                diff = _square_sum(torch.cat([base, row[None]]), C) - without
                worst = max(worst, diff.norm().item())
    # Gradient ascent on the added example's direction (the adversary's best response).
    x = torch.randn(d, requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.05)
    for _ in range(300):
        clipped = x * torch.clamp(C / (x.norm() + 1e-6), max=1.0)
        loss = -(clipped**2).norm()
        opt.zero_grad()
        loss.backward()
        opt.step()
    diff = _square_sum(torch.cat([base, x.detach()[None]]), C) - without
    worst = max(worst, diff.norm().item())
    assert worst <= C**2 * (1 + 1e-5)
    assert worst >= 0.99 * C**2  # the bound is tight: a one-hot example attains it


def test_the_batch_average_form_would_need_more():
    """The paper's form ḡ² of the clipped mean has sensitivity (2B−1)C²/B², not C²/B: the search finds it."""
    C, B, d = 1.0, 4, 3
    same = torch.zeros(B - 1, d)
    same[:, 0] = C  # B−1 examples with gradient C·e_1
    added = torch.zeros(1, d)
    added[0, 0] = C
    mean_without = same.sum(0) / B
    mean_with = torch.cat([same, added]).sum(0) / B
    change = (mean_with**2 - mean_without**2).norm().item()
    assert abs(change - (2 * B - 1) * C**2 / B**2) < 1e-6
    assert change > C**2 / B  # per-example form's sensitivity after dividing by B
