"""validators/elementwise_scale.py: which layer outputs are verified as weight ⊙ y, from autograd's record alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_dp.mechanism.capture import ActivationCapture
from lightning_dp.mechanism.grad_sample.elementwise_scale import scale_layer_grads, scale_served
from lightning_dp.mechanism.validators.elementwise_scale import WALK_LIMIT, scale_candidate, scaled_operand

sys.path.insert(0, str(Path(__file__).parents[2] / "zoo"))

import zoo  # noqa: E402

SERVED, REFUSED = ["plain", "right", "view", "shifted"], ["twice", "negated", "doubled", "column"]


def _call(module: nn.Module, x: torch.Tensor):
    out = module(x)
    return scaled_operand(module.weight, out, [x]), out


@pytest.mark.parametrize("kind", SERVED + REFUSED)
def test_only_the_weight_times_an_operand_free_of_it_is_served(kind):
    torch.manual_seed(0)
    norm = zoo.ScaleNorm(kind).double()
    x = torch.randn(3, 4, zoo.D, dtype=torch.float64, requires_grad=True)
    y, out = _call(norm, x)
    assert (y is not None) == (kind in SERVED)
    if y is not None:
        normalised = x.detach() * torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-6)  # ScaleNorm's y
        torch.testing.assert_close(y, normalised, rtol=0, atol=0)
        assert not y.requires_grad


def test_a_cast_weight_is_followed_and_a_bias_or_second_parameter_is_not():
    class Cast(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(5))

        def forward(self, x):
            return self.weight.double() * x.double()

    x = torch.randn(2, 3, 5, requires_grad=True)
    cast = Cast()
    assert scaled_operand(cast.weight, cast(x), [x]) is not None
    assert scale_candidate(nn.LayerNorm(5)) is None  # two parameters (closed form elsewhere)
    assert scale_candidate(nn.Linear(5, 5, bias=False)) is None  # 2-D weight
    frozen = zoo.ScaleNorm("plain")
    frozen.weight.requires_grad_(False)
    assert scale_candidate(frozen) is None


def test_a_history_longer_than_the_walk_limit_counts_as_reaching_the_weight():
    class Long(nn.Module):
        def __init__(self, steps):
            super().__init__()
            self.steps, self.weight = steps, nn.Parameter(torch.ones(4))

        def forward(self, x):
            y = x
            for _ in range(self.steps):
                y = y * 1.0001
            return self.weight * y

    x = torch.randn(2, 3, 4, requires_grad=True)
    short, long = Long(10), Long(WALK_LIMIT + 5)
    assert scaled_operand(short.weight, short(x), [x]) is not None
    assert scaled_operand(long.weight, long(x), [x]) is None


def test_the_rule_equals_one_backward_per_example():
    """Captured calls (two per step) served by the rule, against autograd example by example."""
    torch.manual_seed(1)
    model = zoo.ScaledTokens("plain").double()
    x, _ = zoo.token_data()[:]
    capture = ActivationCapture()
    capture.attach([("norm", model.norm)])
    capture.begin_step(len(x))
    target = torch.randn(len(x), x.shape[1], zoo.D, dtype=torch.float64)

    def forward(xs, t):
        return (model.norm(torch.tanh(model.mid(model.norm(model.emb(xs))))) * t).sum((1, 2))

    forward(x, target).mean().backward()
    calls = capture.completed()[id(model.norm)]
    capture.detach()
    assert scale_served(calls) and len(calls.records) == 2
    got = scale_layer_grads(calls, [("weight", model.norm.weight)], len(x))["weight"]
    for i in range(len(x)):
        want, = torch.autograd.grad(forward(x[i:i + 1], target[i:i + 1]).sum(), [model.norm.weight])
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)


def test_only_shifts_of_derivative_one_pass_through():
    """(w + c) ⊙ y and (w − c) ⊙ y have the weight's gradient Σ δ ⊙ y; (c − w) ⊙ y (−1) and (c + 2w) ⊙ y (2) do not."""
    w = nn.Parameter(torch.randn(4))
    x = torch.randn(2, 3, 4, requires_grad=True)
    c = torch.ones(4)
    served = {"w + c": (w + c) * x, "w - c": (w - 3.0) * x, "c + w": (c + w) * x}
    refused = {"c - w": torch.sub(c, w) * x, "c + 2w": torch.add(c, w, alpha=2) * x, "2w": (2 * w) * x,
               "w + w": (w + w) * x}
    for name, out in served.items():
        assert scaled_operand(w, out, [x]) is not None, name
    for name, out in refused.items():
        assert scaled_operand(w, out, [x]) is None, name


def test_an_rms_norm_on_an_input_that_does_not_require_grad_is_verified():
    """nn.RMSNorm on the data itself (issue 37): autograd does not save the weight's operand when y needs no gradient;
    its shape comes from the autograd record instead of an AttributeError."""
    norm = nn.RMSNorm(zoo.D).double()
    x = torch.randn(3, 4, zoo.D, dtype=torch.float64)
    y = scaled_operand(norm.weight, norm(x), [x])
    assert y is not None
    torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps))


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_an_rms_norm_over_the_data_trains_exactly(engine):
    zoo.assert_exact(zoo.NormOnTheData, zoo.vector_data(), per_sample=engine)
