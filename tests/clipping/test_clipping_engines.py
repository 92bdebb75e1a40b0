"""Every engine against explicit per-example and per-user loops, for every clipping policy (issue #39).

The reference differentiates each example alone (its own forward and backward, no engine attached), forms each
unit's mean gradient and applies the policy's formula written out here (not the library's factors):
flat min(1, C/‖g‖), per-layer min(1, C_p/‖g_p‖), automatic C/(‖g‖ + γ).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.grad_sample import make_engine
from lightning_dp.clipping import (
    AdaptiveClipping,
    AutomaticClipping,
    ClipRule,
    FlatClipping,
    PerLayerClipping,
)

ENGINES = ["ghost", "vmap", "opacus_hooks"]
N, T, V = 7, 5, 13
GROUPS = torch.tensor([0, 0, 0, 1, 2, 2, 3])  # users of 3, 1, 2 and 1 records


class TokenNet(nn.Module):
    """Embedding → Linear on every token (ghost: low-rank and lookup forms) → LayerNorm → head; optionally the
    head tied to the embedding (ghost: cross terms between owners)."""

    def __init__(self, tied: bool = False, width: int = 48) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, width)
        self.mix = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.mix(self.emb(x))))).mean(1)


class ConvNet(nn.Module):
    """A convolution with bias (ghost's convolution rule keeps its weight part apart) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3)
        self.head = nn.Linear(8, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean(2))


def _data(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 3, 9, generator=g, dtype=torch.float64) if isinstance(model, ConvNet) else torch.randint(0, V, (N, T), generator=g)
    return x, torch.randint(0, V, (N,), generator=g)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return ConvNet() if kind == "conv" else TokenNet(tied=kind == "tied")


def per_example_grads(model: nn.Module, x, y) -> list[list[torch.Tensor]]:
    """Each example's gradient from its own forward and backward (the explicit loop)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(len(y)):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
        out.append([g.detach().double() for g in grads])
    return out


def explicit_clipped_sum(grads, policy: str, C: float, groups=None, gamma: float = 0.01, budgets=None):
    """Σ_u clip(g_u) with g_u the mean of unit u's per-example gradients, the policy written out."""
    labels = list(range(len(grads))) if groups is None else groups.tolist()
    P = len(grads[0])
    total = [torch.zeros_like(g) for g in grads[0]]
    for unit in sorted(set(labels)):
        members = [i for i, u in enumerate(labels) if u == unit]
        g = [sum(grads[i][k] for i in members) / len(members) for k in range(P)]
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g))
        for k in range(P):
            if policy == "flat":
                factor = min(1.0, C / (norm + 1e-6))
            elif policy == "automatic":
                factor = C / (norm + gamma)
            else:  # per-layer
                bound = C / math.sqrt(P) if budgets is None else budgets[k]
                factor = min(1.0, bound / (float(g[k].norm()) + 1e-6))
            total[k] += factor * g[k]
    return total


def engine_sums(engine_name: str, model: nn.Module, x, y, rule: ClipRule):
    engine = make_engine(engine_name)
    engine.attach(model)
    try:
        engine.begin_step(len(y))
        F.cross_entropy(model(x), y).backward()
        params = [p for p in model.parameters() if p.requires_grad]
        batch = engine.clip_and_sum(params, rule)
        return [batch.sums[p].double() for p in params], batch
    finally:
        engine.detach()
        model.zero_grad(set_to_none=True)


def _policy(name: str, C: float, names=None):
    if name == "flat":
        return FlatClipping(C)
    if name == "automatic":
        return AutomaticClipping(C, gamma=0.01)
    if name == "adaptive":  # at its current bound the adaptive policy clips flat
        return AdaptiveClipping(initial_norm=C)
    policy = PerLayerClipping(C)
    policy.bind(names)
    return policy


def _close(got, want):
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * max(1.0, float(b.norm()))), float((a - b).norm())


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["tokens", "tied", "conv"])
@pytest.mark.parametrize("policy", ["flat", "per_layer", "automatic", "adaptive"])
@pytest.mark.parametrize("users", [False, True])
def test_clipped_sum_equals_the_explicit_loop(engine, kind, policy, users):
    if engine == "opacus_hooks" and kind == "tied":
        pytest.skip("Opacus' hooks do not serve tied weights (refused by the engine)")
    model = _model(kind).double()
    x, y = _data(model)
    grads = per_example_grads(model, x, y)
    norms = sorted(math.sqrt(sum(float(t.pow(2).sum()) for t in g)) for g in grads)
    C = norms[len(norms) // 2] / 2  # clips most examples and users, leaves a few alone
    names = [n for n, p in model.named_parameters()]
    groups = GROUPS if users else None
    got, batch = engine_sums(engine, model, x, y, ClipRule(_policy(policy, C, names), groups))
    formula = "flat" if policy == "adaptive" else policy
    _close(got, explicit_clipped_sum(grads, formula, C, groups))
    assert batch.norms.numel() == (4 if users else N) and batch.batch_size == N


def test_automatic_clipping_equals_sum_of_c_g_over_norm_plus_gamma():
    """The issue's wording: Σ_i C·g_i/(‖g_i‖ + γ), for a γ large enough to matter."""
    model = _model("tokens").double()
    x, y = _data(model)
    grads = per_example_grads(model, x, y)
    C, gamma = 0.7, 0.5
    want = [sum(C * g[k] / (math.sqrt(sum(float(t.pow(2).sum()) for t in g)) + gamma) for g in grads)
            for k in range(len(grads[0]))]
    for engine in ENGINES:
        got, _ = engine_sums(engine, model, x, y, ClipRule(AutomaticClipping(C, gamma=gamma)))
        _close(got, want)


@pytest.mark.parametrize("engine", ENGINES)
def test_per_layer_named_budgets_are_each_tensors_bound(engine):
    model = _model("tokens").double()
    x, y = _data(model)
    names = [n for n, _ in model.named_parameters()]
    raw = {n: float(i + 1) for i, n in enumerate(names)}
    scale = 0.05 / math.sqrt(sum(v * v for v in raw.values()))
    budgets = {n: v * scale for n, v in raw.items()}
    policy = PerLayerClipping(0.05, budgets=budgets)
    policy.bind(names)
    got, _ = engine_sums(engine, model, x, y, ClipRule(policy))
    _close(got, explicit_clipped_sum(per_example_grads(model, x, y), "per_layer", 0.05,
                                     budgets=[budgets[n] for n in names]))


@pytest.mark.parametrize("engine", ENGINES)
def test_per_layer_sensitivity_is_at_most_c_in_all_and_c_over_root_p_per_tensor(engine):
    """One example alone, gradients far above the bound: its clipped contribution is ≤ C/√P in every tensor and ≤ C
    in all (the sensitivity of the sum: removing the example removes exactly this)."""
    model = _model("tokens").double()
    x, y = _data(model)
    C = 1e-3
    P = len(list(model.parameters()))
    for i in range(3):
        got, _ = engine_sums(engine, model, x[i:i + 1], y[i:i + 1], ClipRule(_policy("per_layer", C, [
            n for n, _ in model.named_parameters()])))
        assert all(float(t.norm()) <= C / math.sqrt(P) * (1 + 1e-9) for t in got)
        assert math.sqrt(sum(float(t.pow(2).sum()) for t in got)) <= C * (1 + 1e-9)
        assert all(float(t.norm()) > 0.99 * C / math.sqrt(P) for t in got if float(t.norm()) > 0)  # clipped to C_p


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", ["flat", "per_layer", "automatic"])
def test_removing_all_records_of_one_user_moves_the_sum_by_at_most_c(engine, policy):
    model = _model("tokens").double()
    x, y = _data(model)
    x[0:3] = x[0]  # user 0: three copies of one record, so its mean gradient is far above C
    C = 1e-2
    names = [n for n, _ in model.named_parameters()]
    full, _ = engine_sums(engine, model, x, y, ClipRule(_policy(policy, C, names), GROUPS))
    rest = GROUPS[3:] - 1  # users 1, 2, 3 renumbered 0, 1, 2
    without, _ = engine_sums(engine, model, x[3:], y[3:], ClipRule(_policy(policy, C, names), rest))
    moved = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(full, without)))
    assert 0.5 * C < moved <= C * (1 + 1e-9)


def test_a_users_gradient_is_the_mean_of_its_records():
    """Unclipped (C = ∞), a user of two copies of one record contributes that record's gradient once."""
    model = _model("tokens").double()
    x, y = _data(model)
    x[1], y[1] = x[0], y[0]
    for engine in ENGINES:
        grouped, _ = engine_sums(engine, model, x[:2], y[:2], ClipRule(FlatClipping(1e9), torch.tensor([0, 0])))
        single, _ = engine_sums(engine, model, x[:1], y[:1], ClipRule(FlatClipping(1e9)))
        _close(grouped, single)
