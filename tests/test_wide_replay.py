"""The batch check's float64 re-run (lightning_dp/wide_replay.py): the module and every float32 input computed in
float64 inside, every tensor back bit for bit afterwards, and a pass that still computed in float32 said."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.wide_replay import in_float64


def test_a_float32_model_computes_in_float64_inside_and_is_put_back_bit_for_bit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 1, 16))
    model.register_buffer("scale", torch.full((2,), 0.5))
    weight = model[0].weight
    weight.grad = torch.ones_like(weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 1, 16)  # float32, as read from the data
    with in_float64(model) as wide:
        out = model(x) * model.scale
        softmax = torch.softmax(out.float(), -1, dtype=torch.float32)  # a float32 asked for is float64 too
        out.sum().backward()
        assert weight.dtype == out.dtype == softmax.dtype == weight.grad.dtype == torch.float64
        assert torch.zeros(1).dtype == torch.float64
    assert wide.complete
    assert model[0].weight is weight and weight.dtype == torch.float32
    assert torch.equal(weight.grad, torch.ones_like(weight)), "the .grad as it was"
    for k, v in model.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    assert torch.zeros(1).dtype == torch.float32


def test_a_write_into_a_float32_tensor_kept_outside_is_not_widened_and_clears_complete():
    """An in-place write into a float32 tensor the module does not hold lands there (not in a float64 copy), and
    the pass is not float64 throughout: the caller keeps its float32 verdict."""
    model = nn.Linear(2, 2)
    kept = torch.zeros(2)
    with in_float64(model) as wide:
        kept.add_(model(torch.ones(1, 2)).detach()[0].float())
    assert not wide.complete
    assert kept.dtype == torch.float32 and bool(kept.ne(0).any())
