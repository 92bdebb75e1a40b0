"""The norms are summed over layers in float64 and nowhere else wider (issue 38, "norms without waste")."""

import torch
from torch import nn

from lightning_dp.grad_sample import make_engine
from lightning_dp.grad_sample.base import clip_from_parts


def test_the_sum_over_parts_is_taken_in_float64():
    """10⁴ parts of 10⁻⁸ after a part of 1: each is lost beside 1 in float32 (eps 6·10⁻⁸), not in float64."""
    parts = [torch.ones(3)] + [torch.full((3,), 1e-8)] * 10_000
    norms, factors = clip_from_parts(parts, max_grad_norm=0.5)
    assert norms.dtype == factors.dtype == torch.float32
    expected = torch.tensor(1.0001, dtype=torch.float64).sqrt()
    assert torch.allclose(norms.double(), expected.expand(3), rtol=1e-7, atol=0)
    assert torch.allclose(factors.double(), (0.5 / (expected + 1e-6)).expand(3), rtol=1e-7, atol=0)


def test_a_deep_model_is_clipped_to_c():
    """300 layers: every example's clipped gradient has norm ≤ C(1 + 10⁻⁶) (ghost engine, float32)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(300)])
    x = torch.randn(6, 4) * 100
    engine = make_engine("ghost")
    engine.attach(model)
    params = [p for p in model.parameters() if p.requires_grad]
    C = 1e-3
    for i in range(6):
        engine.begin_step(1)
        model(x[i:i + 1]).square().mean().backward()
        out = engine.clip_and_sum(params, C)
        norm = torch.sqrt(sum(s.double().pow(2).sum() for s in out.sums.values()))
        assert out.norms[0] > 10 * C and norm <= C * (1 + 1e-6)
    engine.detach()


def test_flat_factors_in_place_are_the_policys():
    """clip_from_parts takes flat clipping's factors in place (issue 38): the very values of the policy's
    min(1, C/(‖g‖ + ε)) with finite_only, non-finite norms (0) and C = ∞ (1, or 0 for a non-finite norm) included."""
    from lightning_dp.clipping.rule import as_rule, finite_only

    torch.manual_seed(0)
    for C in (1.0, 0.37, 3e-4, float("inf")):
        for trial in range(50):
            parts = [torch.rand(9) * 10 ** float(torch.randint(-6, 6, ())) for _ in range(3)] + [torch.rand(2, 9)]
            if trial % 2:
                parts[0][1], parts[1][2], parts[2][3] = float("inf"), float("nan"), float("-inf")
            norms, factors = clip_from_parts(parts, C)
            sq = torch.cat([p.reshape(-1, 9) for p in parts]).sum(0, dtype=torch.float64).clamp_min(0).sqrt()
            policy = as_rule(C).policy
            assert torch.equal(factors, finite_only(policy.factors(sq), sq).float())
            kept = ~sq.isnan()
            assert torch.equal(norms.isnan(), ~kept) and torch.equal(norms[kept], sq[kept].float())
