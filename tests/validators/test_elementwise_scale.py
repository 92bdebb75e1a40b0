"""validators/elementwise_scale.py: which layer outputs are verified as w ⊙ y + b, from autograd's record alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_dp.grad_sample.capture.activations import ActivationCapture
from lightning_dp.grad_sample.elementwise_scale import call_grads, scale_layer_grads, scale_served
from lightning_dp.validators.elementwise_scale import WALK_LIMIT, scale_candidate, scaled_operand

sys.path.insert(0, str(Path(__file__).parents[1] / "zoo"))

import zoo  # noqa: E402

SERVED, REFUSED = ["plain", "right", "view", "shifted", "doubled", "column"], ["twice", "negated"]


def _call(module: nn.Module, x: torch.Tensor):
    out = module(x)
    return scaled_operand(module.weight, out, [x]), out


@pytest.mark.parametrize("kind", SERVED + REFUSED)
def test_only_the_weight_times_an_operand_free_of_it_is_served(kind):
    """``column`` (the weight broadcast along the second-to-last dimension of ``yᵀy``) is served with that layout;
    ``doubled`` with the factor 2 among y's factors."""
    torch.manual_seed(0)
    norm = zoo.ScaleNorm(kind).double()
    x = torch.randn(3, 4, zoo.D, dtype=torch.float64, requires_grad=True)
    op, out = _call(norm, x)
    assert (op is not None) == (kind in SERVED)
    if op is not None:
        normalised = x.detach() * torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-6)  # ScaleNorm's y
        want = (normalised.transpose(1, 2) @ normalised if kind == "column" else 2 * normalised if kind == "doubled"
                else normalised)
        torch.testing.assert_close(op.y, want, rtol=0, atol=0)
        assert not op.y.requires_grad and op.bias is None
        assert op.weight_shape == ((zoo.D, 1) if kind == "column" else (1, 1, zoo.D) if kind == "view" else (zoo.D,))


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
    for layer in (nn.LayerNorm(5), nn.Linear(5, 5, bias=False), nn.Linear(5, 5)):  # candidates, not that form
        assert scale_candidate(layer) is not None and scaled_operand(scale_candidate(layer), layer(x), [x]) is None
    assert scale_candidate(nn.LSTMCell(5, 5)) is None  # four parameters
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


def _assert_exact(op, out: torch.Tensor, params: list[torch.Tensor], name: str) -> None:
    """The verified form's per-example gradients (call_grads) equal autograd's, example by example."""
    assert op is not None, name
    d = torch.randn_like(out)
    got = call_grads(op, d)
    for i in range(out.shape[0]):
        want = torch.autograd.grad((out[i] * d[i]).sum(), params, retain_graph=True, allow_unused=True)
        for p, w in zip(params, want):
            g = got[p][i].view(p.shape) if p in got else torch.zeros_like(p)
            torch.testing.assert_close(g, torch.zeros_like(p) if w is None else w, rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")


def test_only_shifts_of_derivative_one_pass_through():
    """(w + c) ⊙ y and (w − c) ⊙ y have the weight's gradient Σ δ ⊙ y, 2w ⊙ y the factor 2 in y; (c − w) ⊙ y (−1),
    (c + 2w) ⊙ y (α = 2) and (w + w) ⊙ y are not served."""
    w = nn.Parameter(torch.randn(4, dtype=torch.float64))
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    c = torch.ones(4, dtype=torch.float64)
    served = {"w + c": (w + c) * x, "w - c": (w - 3.0) * x, "c + w": (c + w) * x, "2w": (2 * w) * x}
    refused = {"c - w": torch.sub(c, w) * x, "c + 2w": torch.add(c, w, alpha=2) * x, "w + w": (w + w) * x}
    for name, out in served.items():
        _assert_exact(scaled_operand(w, out, [x]), out, [w], name)
    for name, out in refused.items():
        assert scaled_operand(w, out, [x]) is None, name


def _normalised(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global layer norm's (x − μ, σ) over every dimension but the examples'."""
    mean = x.mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)
    var = (x - mean).pow(2).mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)
    return x - mean, torch.pow(var + 1e-8, 0.5)


C, L = 4, 6


def _affine_forms(w, b, w_flat, b_flat, x):
    """Elementwise-affine forms of published layers, all served: Conv-TasNet's gLN (γ, β [1, C, 1]), DPRNN's
    (weight, bias [C, 1]), channel vectors broadcast by indexing or views, and rsqrt instead of a division."""
    u, s = _normalised(x)
    return {
        "gLN γ·(x−μ)/σ + β": w * u / s + b,
        "gLN β + (x−μ)/σ·γ": b + u / s * w,
        "gLN vectors [:, None]": w_flat[:, None] * (u / s) + b_flat[:, None],
        "gLN vectors view": (u * torch.rsqrt(s * s)) * w_flat.view(1, C, 1) + b_flat.view(1, C, 1),
        "gLN no bias": w * u / s,
        "weight ⊙ x + bias": x * w + b,
    }


def _refused_forms(w, b, w_flat, b_flat, x):
    """Forms whose gradient is not Σ δ ⊙ y, or that the walk cannot prove: a parameter inside a factor or divisor,
    a subtracted bias, the weight along the examples, two terms, a transposed output."""
    u, s = _normalised(x)
    return {
        "bias subtracted": (w * u / s - b, [w, b]),
        "weight in the divisor": (w * u / (s * w.abs().mean()), [w, b]),
        "bias inside the term": (w * (u + b) / s + b, [w, b]),
        "weight in a factor": (w * u * torch.sigmoid(w) + b, [w, b]),
        "two terms": (w * u + b * x, [w, b]),
        "the weight along the examples": (w_flat.view(C, 1, 1) * x + b, [w_flat, b]),
        "the bias along the examples": (w * x + b_flat.view(C, 1, 1), [w, b_flat]),
        "transposed": ((w_flat * u.transpose(1, 2) + b_flat).transpose(1, 2), [w_flat, b_flat]),
        "divided by the weight": (u / w, [w, b]),
        "the weight's square": (w * w * u, [w]),
    }


def test_elementwise_affine_forms_are_served_exactly():
    torch.manual_seed(0)
    x = torch.randn(C, C, L, dtype=torch.float64, requires_grad=True)  # n = C examples: shapes cannot tell them apart
    w, b = (nn.Parameter(torch.randn(1, C, 1, dtype=torch.float64)) for _ in range(2))
    w_flat, b_flat = (nn.Parameter(torch.randn(C, dtype=torch.float64)) for _ in range(2))
    for name, out in _affine_forms(w, b, w_flat, b_flat, x).items():
        params = [w, b] if "vectors" not in name else [w_flat, b_flat]
        op = scaled_operand(params, out, [x])
        _assert_exact(op, out, params, name)
    for name, (out, params) in _refused_forms(w, b, w_flat, b_flat, x).items():
        assert scaled_operand(params, out, [x]) is None, name


def test_a_frozen_weight_leaves_the_bias_alone_served():
    torch.manual_seed(0)
    x = torch.randn(3, C, L, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, C, 1, dtype=torch.float64)  # frozen: a constant in the graph
    b = nn.Parameter(torch.randn(C, 1, dtype=torch.float64))
    u, s = _normalised(x)
    out = w * u / s + b
    op = scaled_operand([b], out, [x])
    assert op is not None and op.weight is None and op.bias is b
    _assert_exact(op, out, [b], "frozen weight")


def test_an_rms_norm_on_an_input_that_does_not_require_grad_is_verified():
    """nn.RMSNorm on the data itself (issue 37): autograd does not save the weight's operand when y needs no gradient;
    its shape comes from the autograd record instead of an AttributeError."""
    norm = nn.RMSNorm(zoo.D).double()
    x = torch.randn(3, 4, zoo.D, dtype=torch.float64)
    op = scaled_operand(norm.weight, norm(x), [x])
    assert op is not None
    torch.testing.assert_close(op.y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps))


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_an_rms_norm_over_the_data_trains_exactly(engine):
    zoo.assert_exact(zoo.NormOnTheData, zoo.vector_data(), per_sample=engine)
