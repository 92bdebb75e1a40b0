"""An example whose gradient holds an inf or a NaN adds nothing to the clipped sum (docs/algorithms.md, "Non-finite
gradients"): the release stays finite whether or not it was sampled, so it does not show that it was.

Each case differentiates a batch with one record made non-finite (an inf, a NaN, a huge finite value that overflows
in the forward) and the same batch without it: every clipped sum must be finite and the two must differ by at most
C (the record's own clipped contribution, 0 or a function of its own rows), on every engine and clipping rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.clipping.automatic import AutomaticClipping
from lightning_dp.clipping.flat import FlatClipping
from lightning_dp.clipping.per_layer import PerLayerClipping
from lightning_dp.clipping.rule import ClipRule, finite_only
from lightning_dp.grad_sample import make_engine

ENGINES = ["ghost", "vmap", "opacus_hooks"]
VALUES = [float("inf"), float("-inf"), float("nan"), 3e38, 1e20]
CULPRIT = 3


class Tabular(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16) if norm else nn.Tanh(), nn.ReLU(),
                                 nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x):  # x: [B, 4] viewed as a 2x2 image, upsampled
        img = F.interpolate(x.view(-1, 1, 2, 2), scale_factor=2)
        return self.head(F.relu(self.gn(self.conv(img))).flatten(1))


class Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):  # tokens from the first features, the record's value scales them
        tokens = (x.abs().nan_to_num(0.0, 0.0, 0.0) * 3).long().clamp(0, 9)
        h = self.emb(tokens) * x[:, :1, None]
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h.mean(1))


MODELS = {"mlp": Tabular, "layernorm": lambda: Tabular(norm=True), "conv": Conv, "attention": Sequence}


def _clipped(engine_name: str, factory, x: torch.Tensor, y: torch.Tensor, rule):
    torch.manual_seed(1)
    model = factory()
    engine = make_engine(engine_name)
    engine.attach(model)
    engine.begin_step(len(x))
    F.cross_entropy(model(x), y).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    batch = engine.clip_and_sum(params, rule)
    engine.detach()
    return [batch.sums[p] for p in params]


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)


def _assert_left_out(engine_name: str, factory, value: float, rule, bound: float) -> None:
    x, y = _data()
    culprit = x.clone()
    culprit[CULPRIT, 0] = value
    keep = [i for i in range(len(x)) if i != CULPRIT]
    with_it = _clipped(engine_name, factory, culprit, y, rule)
    without = _clipped(engine_name, factory, x[keep], y[keep], rule)
    assert all(bool(torch.isfinite(s).all()) for s in with_it), "a non-finite record made the clipped sum non-finite"
    moved = sum(float((a - b).double().pow(2).sum()) for a, b in zip(with_it, without)) ** 0.5
    assert moved <= bound * (1 + 1e-4) + 1e-5, f"the record moved the clipped sum by {moved} > {bound}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("value", VALUES, ids=["inf", "-inf", "nan", "3e38", "1e20"])
@pytest.mark.parametrize("model", ["mlp", "layernorm", "conv"])
def test_a_non_finite_record_adds_at_most_its_clipped_share(engine, value, model):
    _assert_left_out(engine, MODELS[model], value, 1.0, 1.0)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 3e38], ids=["inf", "nan", "3e38"])
def test_attention_over_a_non_finite_record(engine, value):
    _assert_left_out(engine, MODELS["attention"], value, 1.0, 1.0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", [AutomaticClipping(1.0), PerLayerClipping(1.0)], ids=["automatic", "per-layer"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_other_policies_leave_the_record_out_too(engine, policy, value):
    _assert_left_out(engine, MODELS["mlp"], value, ClipRule(policy), 1.0)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_user_with_a_non_finite_record(engine, value):
    """Units of several examples (user-level DP): the user's summed gradient is not finite, the user adds nothing.
    Records 2 and 3 are one user's; the comparison leaves both out."""
    groups = torch.tensor([0, 1, 2, 2, 3, 4, 5, 6])
    rule = ClipRule(FlatClipping(1.0), groups)
    x, y = _data()
    culprit = x.clone()
    culprit[CULPRIT, 0] = value
    keep = [i for i in range(8) if i not in (2, 3)]
    with_it = _clipped(engine, MODELS["mlp"], culprit, y, rule)
    without = _clipped(engine, MODELS["mlp"], x[keep], y[keep], ClipRule(FlatClipping(1.0),
                                                                         torch.arange(len(keep))))
    assert all(bool(torch.isfinite(s).all()) for s in with_it)
    moved = sum(float((a - b).double().pow(2).sum()) for a, b in zip(with_it, without)) ** 0.5
    assert moved <= 1.0 + 1e-4


def test_finite_only_zeroes_exactly_the_non_finite_units():
    norms = torch.tensor([0.5, float("inf"), float("nan"), 4.0])
    factors = FlatClipping(1.0).factors(norms)
    out = finite_only(factors, norms)
    assert out.tolist()[1:3] == [0.0, 0.0]
    assert torch.equal(out[[0, 3]], factors[[0, 3]])
