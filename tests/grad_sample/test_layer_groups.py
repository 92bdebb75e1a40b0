"""Small layers of one shape clipped together (issue 38): the same clipped sums and norms as layer by layer."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_dp.grad_sample.ghost as ghost
from lightning_dp.grad_sample import make_engine
from lightning_dp.grad_sample.layer_groups import LinearGroup, NormGroup


def _model(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(5) for m in (nn.Linear(8, 8, bias=bias), nn.LayerNorm(8), nn.GELU())]
    return nn.Sequential(*layers, nn.Linear(8, 3), nn.LayerNorm(3), nn.Linear(3, 3))  # odd ones out: alone


def _clipped(model, x, y, C, stacked: bool, monkeypatch):
    if not stacked:
        monkeypatch.setattr(ghost, "stack_small_layers", lambda candidates, n: ([], set()))
    engine = make_engine("ghost")
    engine.attach(model)
    engine.begin_step(len(x))
    F.cross_entropy(model(x), y).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    out = engine.clip_and_sum(params, C)
    engine.detach()
    monkeypatch.undo()
    return params, out


@pytest.mark.parametrize("bias", [True, False])
def test_stacked_layers_give_the_per_layer_sums_and_norms(bias, monkeypatch):
    model = _model(bias)
    model[3].weight.requires_grad_(False)  # a frozen weight: that layer's bias alone (not stacked with the others)
    x, y = torch.randn(7, 8), torch.randint(0, 3, (7,))
    groups = []
    real = ghost.stack_small_layers
    monkeypatch.setattr(ghost, "stack_small_layers", lambda c, n: groups.append(real(c, n)) or groups[-1])
    params, stacked = _clipped(model, x, y, 0.05, True, monkeypatch)
    assert {type(g) for g in groups[0][0]} == {LinearGroup, NormGroup}  # the stacked path did run
    _, alone = _clipped(model, x, y, 0.05, False, monkeypatch)
    torch.testing.assert_close(stacked.norms, alone.norms, rtol=1e-5, atol=1e-7)
    for p in params:
        torch.testing.assert_close(stacked.sums[p], alone.sums[p], rtol=1e-5, atol=1e-7)


def test_stacked_layers_match_a_per_example_loop(monkeypatch):
    model = _model()
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    C = 0.05
    params, out = _clipped(model, x, y, C, True, monkeypatch)
    expected = [torch.zeros_like(p) for p in params]
    for i in range(5):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        torch.testing.assert_close(out.norms[i], norm, rtol=1e-5, atol=1e-7)
        for e, g in zip(expected, grads):
            e.add_(g * min(1.0, C / (float(norm) + 1e-6)))
    for p, e in zip(params, expected):
        torch.testing.assert_close(out.sums[p], e, rtol=1e-4, atol=1e-7)
