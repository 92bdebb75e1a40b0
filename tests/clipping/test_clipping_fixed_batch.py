"""Clipping policies on padded batches (fixed_batch_size) and on ghost's stacked small layers.

Padding rows get the factor exactly 0 under every policy, so the clipped sum, the norms and the count of a padded
batch are those of its examples alone; stacked small layers (one whole norm per example) serve the policies that
take one factor per example from the whole norm, and never the per-parameter ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_dp.grad_sample.ghost as ghost
from lightning_dp.grad_sample import make_engine
from lightning_dp.clipping import AdaptiveClipping, AutomaticClipping, ClipRule, FlatClipping, PerLayerClipping
from lightning_dp.grad_sample.base import clip_from_parts

ENGINES = ["ghost", "vmap", "opacus_hooks"]
N, PAD = 6, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(8, 3)).double()


def _policy(name: str, C: float, names):
    if name == "flat":
        return FlatClipping(C)
    if name == "automatic":
        return AutomaticClipping(C, gamma=0.01)
    if name == "adaptive":
        return AdaptiveClipping(initial_norm=C)
    policy = PerLayerClipping(C)
    policy.bind(names)
    return policy


def _sums(engine_name, model, x, y, rule, padding=0):
    """The engine's clipped sums of a batch whose last ``padding`` rows are padding (loss: the mean over every
    row, as the strategy's padded step takes it)."""
    engine = make_engine(engine_name)
    engine.attach(model)
    try:
        engine.begin_step(len(y))
        loss = F.cross_entropy(model(x), y, reduction="sum") / len(y)
        loss.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        engine.padding_rows = padding
        batch = engine.clip_and_sum(params, rule)
        return [batch.sums[p] for p in params], batch
    finally:
        engine.padding_rows = 0
        engine.detach()
        model.zero_grad(set_to_none=True)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", ["flat", "per_layer", "automatic", "adaptive"])
def test_padding_rows_add_nothing_under_every_policy(engine, policy):
    """A batch of N examples and PAD zeroed padding rows (the loss a mean over the N + PAD rows, as the strategy's
    padded step takes it) gives the clipped sum, norms and count of the N examples alone."""
    model = _model()
    x, y = _data()
    names = [n for n, _ in model.named_parameters()]
    C = 0.05
    alone, ref = _sums(engine, model, x, y, ClipRule(_policy(policy, C, names)))
    xp = torch.cat([x, torch.zeros(PAD, 8, dtype=x.dtype)])
    yp = torch.cat([y, torch.zeros(PAD, dtype=y.dtype)])
    # (the engine's per-example gradient is its row count times the mean loss's: each example's own gradient)
    padded, got = _sums(engine, model, xp, yp, ClipRule(_policy(policy, C, names)), padding=PAD)
    assert got.batch_size == ref.batch_size == N
    assert got.norms.shape == ref.norms.shape == (N,)
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-12, atol=1e-15)
    for a, b in zip(padded, alone):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_padding_is_refused_with_units_of_several_examples():
    model = _model()
    x, y = _data()
    rule = ClipRule(FlatClipping(0.05), torch.tensor([0, 0, 1, 1, 2, 2]))
    for engine in ENGINES:
        with pytest.raises(Exception, match="padding rows"):
            _sums(engine, model, x, y, rule, padding=2)


def test_clip_from_parts_takes_the_policys_factors_in_float64():
    parts = [torch.tensor([0.25, 4.0, 0.0, 9.0]), torch.tensor([[0.0, 5.0, 0.0, 7.0], [0.0, 0.0, 0.0, 0.0]])]
    norms, c = clip_from_parts(parts, ClipRule(AutomaticClipping(2.0, gamma=0.5)), padding=1)
    want = torch.tensor([0.5, 3.0, 0.0, 4.0])
    torch.testing.assert_close(norms, want)
    torch.testing.assert_close(c[:3], 2.0 / (want[:3] + 0.5))
    assert c[3].item() == 0.0  # padding: exactly 0
    with pytest.raises(ValueError, match="clip_and_sum_by_rule"):
        clip_from_parts(parts, ClipRule(PerLayerClipping(1.0)))


@pytest.mark.parametrize("policy", ["automatic", "adaptive", "per_layer"])
def test_stacked_small_layers_serve_whole_norm_policies_only(policy, monkeypatch):
    """Ghost stacks small layers for a policy taking one factor per example from its whole norm (automatic,
    adaptive) with the same sums as layer by layer; a per-parameter policy never reaches the stacking."""
    model = _model()
    x, y = _data()
    names = [n for n, _ in model.named_parameters()]
    calls = []
    real = ghost.stack_small_layers
    monkeypatch.setattr(ghost, "stack_small_layers", lambda c, n: calls.append(real(c, n)) or calls[-1])
    stacked, a = _sums("ghost", model, x, y, ClipRule(_policy(policy, 0.05, names)))
    if policy == "per_layer":
        assert calls == []
    else:
        assert calls and calls[0][0]  # groups were formed
    monkeypatch.setattr(ghost, "stack_small_layers", lambda c, n: ([], set()))
    alone, b = _sums("ghost", model, x, y, ClipRule(_policy(policy, 0.05, names)))
    reference, _ = _sums("vmap", model, x, y, ClipRule(_policy(policy, 0.05, names)))
    torch.testing.assert_close(a.norms, b.norms, rtol=1e-10, atol=1e-14)
    for s, t, r in zip(stacked, alone, reference):
        torch.testing.assert_close(s, t, rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(s, r, rtol=1e-8, atol=1e-12)
