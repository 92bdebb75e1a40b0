"""Layers whose per-example gradients are held whole, clipped in one pass (issue 38): the same norms and clipped sums
as layer by layer and as a per-example loop."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_dp.grad_sample.dense_pool as dense_pool
import lightning_dp.grad_sample.ghost as ghost
from lightning_dp.grad_sample import make_engine
from lightning_dp.grad_sample.dense_pool import DenseGrads
from lightning_dp.grad_sample.rules import LayerRule, registered_rules


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                         nn.Conv2d(4, 6, 3, padding=1, bias=False), nn.LayerNorm([6, 6, 6]), nn.Tanh(),
                         nn.Flatten(), nn.Linear(216, 3))


def _clipped(model, x, y, C, monkeypatch, pooled: bool):
    seen = []
    real = ghost.DenseGrads
    monkeypatch.setattr(ghost, "DenseGrads", lambda members, n: seen.append(real(members, n)) or seen[-1])
    if not pooled:
        for cls in {LayerRule, *(type(r) for r in registered_rules())}:  # every rule's own stats instead
            if "dense" in cls.__dict__:
                monkeypatch.setattr(cls, "dense", lambda self, calls, wanted, n: None)
    engine = make_engine("ghost")
    engine.attach(model)
    engine.begin_step(len(x))
    F.cross_entropy(model(x), y).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    out = engine.clip_and_sum(params, C)
    engine.detach()
    monkeypatch.undo()
    return params, out, seen


@pytest.mark.parametrize("pooled_limit", [dense_pool.POOLED, 0])  # joined into one matrix, or each tensor alone
def test_pooled_layers_give_the_per_layer_sums_and_norms(pooled_limit, monkeypatch):
    model = _cnn()
    x, y = torch.randn(5, 1, 6, 6), torch.randint(0, 3, (5,))
    monkeypatch.setattr(dense_pool, "POOLED", pooled_limit)
    params, pooled, seen = _clipped(model, x, y, 0.05, monkeypatch, pooled=True)
    assert len(seen) == 1 and len(seen[0].pools) == (2 if pooled_limit else 0)  # k = n (convolutions), k = 1 (norms)
    assert {id(p) for _, _, ps, _ in seen[0].pools for p in ps} | {id(p) for p, _, _ in seen[0].alone} == {
        id(p) for m in (model[0], model[1], model[3], model[4]) for p in m.parameters()}
    _, alone, none = _clipped(model, x, y, 0.05, monkeypatch, pooled=False)
    assert not none
    torch.testing.assert_close(pooled.norms, alone.norms, rtol=1e-5, atol=1e-7)
    for p in params:
        assert pooled.sums[p].shape == p.shape
        torch.testing.assert_close(pooled.sums[p], alone.sums[p], rtol=1e-5, atol=1e-7)


def test_pooled_layers_match_a_per_example_loop(monkeypatch):
    model = _cnn()
    x, y = torch.randn(4, 1, 6, 6), torch.randint(0, 3, (4,))
    C = 0.05
    params, out, seen = _clipped(model, x, y, C, monkeypatch, pooled=True)
    assert seen  # the pooled path ran
    expected = [torch.zeros_like(p) for p in params]
    for i in range(4):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        torch.testing.assert_close(out.norms[i], norm, rtol=1e-5, atol=1e-7)
        for e, g in zip(expected, grads):
            e.add_(g * min(1.0, C / (float(norm) + 1e-6)))
    for p, e in zip(params, expected):
        torch.testing.assert_close(out.sums[p], e, rtol=1e-4, atol=1e-7)


def test_the_sums_are_the_members_own_slices():
    """Each parameter's sum is its own columns of the pooled product, k applied per pool."""
    n = 3
    a, b, big = torch.zeros(2, 3), torch.zeros(4), torch.zeros(2)
    ga, gb, gbig = torch.randn(n, 2, 3), torch.randn(n, 4), torch.randn(n, 2)
    members = [(a, ga, 2.0), (b, gb, 1.0), (big, gbig, 2.0)]
    pool = DenseGrads(members, n)
    c = torch.tensor([0.5, 1.0, 0.25])
    sums = pool.sums(c)
    for p, g, k in members:
        torch.testing.assert_close(sums[p], torch.einsum("n,n...->...", c * k, g))
    sq = sum(k * k * g.reshape(n, -1).pow(2).sum(1) for _, g, k in members)
    torch.testing.assert_close(pool.sq_norms.reshape(-1, n).sum(0), sq)
