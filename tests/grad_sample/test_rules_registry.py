"""The per-layer rules' registry (grad_sample/rules.py): every built-in layer family is served by a registered rule
from its own file, in the documented precedence, and a rule registered for a new layer class is what both per-layer
engines (ghost, vmap) take for that layer, with no other change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_dp.grad_sample.functorch_vmap as functorch_vmap
import lightning_dp.grad_sample.ghost as ghost
from lightning_dp.grad_sample import rules
from lightning_dp.grad_sample.attention_projections import AttentionProjectionsRule
from lightning_dp.grad_sample.base import clip_factors, make_engine
from lightning_dp.grad_sample.capture.activations import ActivationCapture, LayerCalls, Record
from lightning_dp.grad_sample.conv_rules import ConvRule
from lightning_dp.grad_sample.elementwise_scale import ElementwiseScaleRule
from lightning_dp.grad_sample.embedding_rule import EmbeddingRule
from lightning_dp.grad_sample.linear_rule import LinearRule
from lightning_dp.grad_sample.norm_rule import NormRule
from lightning_dp.grad_sample.prelu_rule import PReLURule
from lightning_dp.grad_sample.recurrent_rule import RecurrentRule
from lightning_dp.grad_sample.rules import LayerRule, register_rule, registered_rules, rule_for, rule_for_calls

N, C = 6, 0.4


# ------------------------------------------------------------------------------------- a new layer family
class TanhProjection(nn.Module):
    """y = tanh(x) W, W ∈ R^{in×out}: no built-in rule serves it (the per-example replay would)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in ** 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x) @ self.weight


class TanhProjectionRule(LayerRule):
    """Example i's gradient n · tanh(x_i) δ_iᵀ, one call at a time (the mean loss's 1/n undone); ``factor`` scales
    it (1: the correct closed form; another value: a rule an engine's result must show)."""

    name = "tanh_projection"
    factor = 1.0
    calls: list[str] = []

    def serves(self, m: nn.Module) -> bool:
        return isinstance(m, TanhProjection)

    def record_grads(self, m: nn.Module, rec: Record) -> dict[str, Tensor]:
        type(self).calls.append("record_grads")
        x, d = rec.args[0].to(rec.grad_out.dtype), rec.grad_out
        n = d.shape[0]
        return {"weight": torch.einsum("ni,no->nio", torch.tanh(x), d) * (n * self.factor)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), TanhProjection(4, 3)).double()


def _batch() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(N, 5, dtype=torch.float64), torch.randint(0, 3, (N,))


def _reference(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Per-example norms and Σ_i min(1, C/‖g_i‖) g_i, one backward per example."""
    params = list(model.parameters())
    grads = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(N)]
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in grads])
    c = clip_factors(norms, C)
    return norms, [sum(c[i] * grads[i][k] for i in range(N)) for k in range(len(params))]


def _engine_result(engine_name: str, model: nn.Module, x: Tensor, y: Tensor):
    engine = make_engine(engine_name)
    engine.attach(model)
    try:
        engine.begin_step(N)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        return engine.clip_and_sum(list(model.parameters()), C)
    finally:
        engine.detach()


@pytest.fixture
def registered(monkeypatch):
    """TanhProjectionRule registered for the test only (the registry's list restored after), and the engines' replay
    refused for TanhProjection (the Linear layer keeps its own path)."""
    monkeypatch.setattr(rules, "_RULES", registered_rules())
    register_rule(TanhProjectionRule)
    monkeypatch.setattr(TanhProjectionRule, "calls", [])

    def refusing(real):
        def replay(calls: LayerCalls, *args, **kwargs):
            if isinstance(calls.module, TanhProjection):
                raise AssertionError("TanhProjection was replayed per example")
            return real(calls, *args, **kwargs)
        return replay

    monkeypatch.setattr(ghost, "fallback_stats", refusing(ghost.fallback_stats))
    monkeypatch.setattr(functorch_vmap, "_layer_grads", refusing(functorch_vmap._layer_grads))
    return TanhProjectionRule


@pytest.mark.parametrize("engine_name", ["ghost", "vmap"])
def test_a_registered_rule_is_what_both_engines_take_for_its_layer(registered, engine_name):
    model = _model()
    x, y = _batch()
    assert isinstance(rule_for(model[1]), registered) and isinstance(rule_for(model[0]), LinearRule)
    got = _engine_result(engine_name, model, x, y)
    assert registered.calls, f"{engine_name} never called the registered rule"
    norms, sums = _reference(model, x, y)
    torch.testing.assert_close(got.norms, norms, rtol=1e-10, atol=1e-12)
    for p, want in zip(model.parameters(), sums):
        torch.testing.assert_close(got.sums[p], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine_name", ["ghost", "vmap"])
def test_the_engines_result_is_the_registered_rules(registered, engine_name, monkeypatch):
    """A rule whose gradients are twice the true ones: each engine's norms show it (so the rule, not a replay, made
    them)."""
    monkeypatch.setattr(registered, "factor", 2.0)
    model = _model()
    x, y = _batch()
    got = _engine_result(engine_name, model, x, y)
    norms, _ = _reference(model, x, y)
    assert registered.calls and not torch.allclose(got.norms, norms)
    monkeypatch.setattr(registered, "factor", 1.0)
    torch.testing.assert_close(_engine_result(engine_name, model, x, y).norms, norms, rtol=1e-10, atol=1e-12)


def test_a_removed_rule_serves_nothing_any_more(monkeypatch):
    monkeypatch.setattr(rules, "_RULES", registered_rules())
    register_rule(TanhProjectionRule)
    assert isinstance(rule_for(TanhProjection(2, 2)), TanhProjectionRule)
    monkeypatch.undo()
    assert rule_for(TanhProjection(2, 2)) is None
    assert not any(isinstance(r, TanhProjectionRule) for r in registered_rules())


# ------------------------------------------------------------------------------------------ the built-ins
class Conv1D(nn.Module):
    """Hugging Face's Conv1D as ``linear_rule.is_hf_conv1d`` recognises it (weight [in, out], ``nf`` = out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: Tensor) -> Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


BUILT_IN = [
    (nn.Linear(3, 2), LinearRule, "linear_rule"),
    (Conv1D(2, 3), LinearRule, "linear_rule"),
    (nn.Embedding(5, 3), EmbeddingRule, "embedding_rule"),
    (nn.LayerNorm(3), NormRule, "norm_rule"),
    (nn.GroupNorm(1, 2), NormRule, "norm_rule"),
    (nn.RMSNorm(3), NormRule, "norm_rule"),
    (nn.Conv1d(2, 2, 3), ConvRule, "conv_rules"),
    (nn.Conv2d(2, 2, 3), ConvRule, "conv_rules"),
    (nn.Conv3d(2, 2, 3), ConvRule, "conv_rules"),
    (nn.ConvTranspose2d(2, 2, 3), ConvRule, "conv_rules"),
    (nn.PReLU(), PReLURule, "prelu_rule"),
    (nn.LSTM(2, 2), RecurrentRule, "recurrent_rule"),
    (nn.GRU(2, 2), RecurrentRule, "recurrent_rule"),
    (nn.RNN(2, 2), RecurrentRule, "recurrent_rule"),
    (nn.MultiheadAttention(4, 2), AttentionProjectionsRule, "attention_projections"),
]


@pytest.mark.parametrize("module,rule,home", BUILT_IN, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module)
                         else "")
def test_each_built_in_family_is_served_by_a_rule_of_its_own_file(module, rule, home):
    found = rule_for(module)
    assert isinstance(found, rule), (module, found)
    assert type(found).__module__ == f"lightning_dp.grad_sample.{home}" and type(found).__module__ in rules.RULE_MODULES


def test_layers_served_by_no_built_in_rule():
    class Standardised(nn.Conv2d):  # its own _conv_forward: per-example gradients are not δ aᵀ
        def _conv_forward(self, x, w, b):
            return super()._conv_forward(x, (w - w.mean()) / (w.std() + 1e-5), b)

    class SubLinear(nn.Linear):  # a subclass may change the forward: replayed
        pass

    for m in (SubLinear(3, 2), nn.Embedding(5, 3, scale_grad_by_freq=True), Standardised(2, 2, 3),
              nn.Bilinear(2, 2, 2), nn.utils.parametrizations.weight_norm(nn.Linear(3, 2))):
        assert rule_for(m) is None, m


def test_a_layer_verified_as_weight_times_y_is_served_by_the_elementwise_scale_rule():
    class ScaleNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x: Tensor) -> Tensor:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    norm = ScaleNorm().double()
    assert rule_for(norm) is None  # a family recognised from its calls only
    capture = ActivationCapture()
    capture.attach([("norm", norm)])
    capture.begin_step(N)
    norm(torch.randn(N, 3, 4, dtype=torch.float64, requires_grad=True)).pow(2).sum().backward()
    calls = capture.completed()[id(norm)]
    capture.detach()
    assert isinstance(rule_for_calls(calls), ElementwiseScaleRule)
    assert isinstance(rule_for_calls(calls, for_vmap=True), ElementwiseScaleRule)


def test_the_registry_keeps_the_documented_precedence():
    """Rules in RULE_MODULES order (rules.py's docstring), a rule of an unlisted module after all of them: a rule a
    test or a user registers for nn.Linear does not displace the built-in one."""
    order = [type(r).__module__ for r in registered_rules()]
    assert order[:len(rules.RULE_MODULES)] == list(rules.RULE_MODULES)
    assert [r.for_vmap for r in registered_rules()] == [True, True, False, False, True, False, True, True, True]

    class AnotherLinearRule(LayerRule):
        def serves(self, m: nn.Module) -> bool:
            return isinstance(m, nn.Linear)

    saved = rules._RULES
    rules._RULES = registered_rules()
    try:
        register_rule(AnotherLinearRule)
        assert isinstance(rule_for(nn.Linear(2, 2)), LinearRule)
        assert isinstance(registered_rules()[-1], AnotherLinearRule)
    finally:
        rules._RULES = saved


def test_the_ghost_engines_attach_time_decisions_read_the_registry():
    assert ghost.has_closed_form(nn.Linear(3, 2)) and ghost.has_closed_form(nn.LayerNorm(3))
    assert ghost.has_closed_form(nn.Conv2d(2, 2, 3)) and not ghost.has_closed_form(nn.Conv2d(2, 2, 3, groups=2))
    assert not ghost.has_closed_form(nn.PReLU()) and not ghost.has_closed_form(nn.LSTM(2, 2))
    assert ghost.reducer_for(nn.LayerNorm(3)) is not None and ghost.reducer_for(nn.PReLU()) is not None
    assert ghost.reducer_for(nn.Linear(3, 2)) is None
    assert ghost.input_grad_only_forward(nn.LSTM(2, 2)) is not None
    assert ghost.input_grad_only_forward(Conv1D(2, 3)) is None


def test_the_vmap_engine_reads_only_the_rules_for_it_in_the_same_order():
    """nn.RMSNorm's torch forward is one multiplication by its weight: on ghost the norm rule serves it (first), on
    vmap, where the norm rule is off, the elementwise-scale rule (as before the registry); LayerNorm is replayed."""
    found = {}
    for m in (nn.RMSNorm(4), nn.LayerNorm(4)):
        capture = ActivationCapture()
        capture.attach([("norm", m)])
        capture.begin_step(3)
        m(torch.randn(3, 5, 4, requires_grad=True)).pow(2).sum().backward()
        calls = capture.completed()[id(m)]
        capture.detach()
        found[type(m)] = (rule_for_calls(calls), rule_for_calls(calls, for_vmap=True))
    assert isinstance(found[nn.RMSNorm][0], NormRule) and isinstance(found[nn.RMSNorm][1], ElementwiseScaleRule)
    assert isinstance(found[nn.LayerNorm][0], NormRule) and found[nn.LayerNorm][1] is None
