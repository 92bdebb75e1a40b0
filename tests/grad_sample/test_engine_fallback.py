"""per_sample='auto' after a refused probe (private_step.PrivateStep._probe_engines, grad_sample/auto.engines_after):
the next engine that supports the model is probed, and trains only if the probe passes it; every rank takes the
same engine; an explicitly named engine never changes."""

from __future__ import annotations

import re
from typing import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp.grad_sample.linear_rule as linear_rule
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.privacy.noise import NoiseMechanism
from lightning_dp.grad_sample.auto import engines_after
from lightning_dp.privacy.private_step import Distribution, PrivateStep

C, B = 0.3, 8


class ZeroNoise(NoiseMechanism):
    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        return [torch.zeros_like(t) for t in like]


def _wrong_linear_rule(calls, wanted, n, scale, with_squares):
    """ghost's Linear rule with a mistake (inputs doubled): per-example gradients twice too large."""
    m = calls.module
    a = torch.cat([2 * r.args[0].reshape(n, -1, m.in_features) for r in calls.records], 1)
    d = torch.cat([r.grad_out.reshape(n, -1, m.out_features) for r in calls.records], 1)
    return linear_rule.LinearFormStats(a, d, n, wanted.get("weight"), wanted.get("bias"), scale, with_squares)


def _failing_linear_rule(calls, wanted, n, scale, with_squares):
    raise RuntimeError("an edge case of the rule")


def _setup(engine: str = "auto", distribution: Distribution = Distribution()):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 5), torch.randint(0, 3, (32,)))
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step = PrivateStep(1.0, C, ZeroNoise(), engine=engine, sampler_seed=0)
    step.attach(model, optimizer, distribution)
    loader = step.poisson_loader(DataLoader(data, batch_size=B))
    return step, model, optimizer, loader


def _loss(model: nn.Module, batch) -> Tensor:
    return F.cross_entropy(model(batch[0].double()), batch[1])


def _reference(model: nn.Module, batch) -> list[Tensor]:
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for x, y in zip(*batch):
        grads = torch.autograd.grad(_loss(model, (x[None], y[None])), params)
        factor = min(1.0, C / (float(torch.sqrt(sum(g.pow(2).sum() for g in grads))) + 1e-6))  # the engines' clip
        total = [t + factor * g for t, g in zip(total, grads)]
    return [t / B for t in total]


def _assert_release_is_the_reference(step: PrivateStep, model: nn.Module, optimizer, loader) -> None:
    """One released step (zero noise) equals the per-example loop's clipped mean."""
    batch = next(iter(loader))
    step.begin()
    _loss(model, batch).backward()
    step.release(optimizer=optimizer)
    step.detach()
    for p, want in zip(model.parameters(), _reference(model, batch)):
        torch.testing.assert_close(p.grad, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("rule", [_wrong_linear_rule, _failing_linear_rule], ids=["wrong", "failing"])
def test_an_engine_the_probe_refuses_gives_way_to_the_next_that_passes(monkeypatch, rule):
    monkeypatch.setattr(linear_rule, "linear_stats", rule)
    step, model, optimizer, loader = _setup()
    assert step.engine_name == "ghost"
    with pytest.warns(UserWarning, match="(?s)refused engine\\(s\\) 'ghost'.*passed engine 'vmap'"):
        step.verify(lambda batch: _loss(model, batch))
    assert step.engine_name == "vmap"
    _assert_release_is_the_reference(step, model, optimizer, loader)


def test_an_engine_named_by_the_user_is_never_replaced(monkeypatch):
    monkeypatch.setattr(linear_rule, "linear_stats", _wrong_linear_rule)
    step, model, _, _ = _setup("ghost")
    with pytest.raises(PrivacyConfigurationError) as refused:
        step.verify(lambda batch: _loss(model, batch))
    assert "also tried" not in str(refused.value) and step.engine_name == "ghost"


def test_a_refusal_of_every_engine_is_the_first_engines_and_names_the_others():
    step, model, _, _ = _setup()
    with pytest.raises(PrivacyConfigurationError, match="(?s)mean.*also tried 'vmap'.*'opacus_hooks'"):
        step.verify(lambda batch: F.cross_entropy(model(batch[0].double()), batch[1], reduction="sum"))
    assert not step.verified


class _Ranks:
    """A stand-in all-reduce of [refused, state written]: another rank refuses the first ``attempts`` probes (``final``:
    because the forward wrote the model's state)."""

    def __init__(self, attempts: int, final: bool = False) -> None:
        self.attempts, self.final, self.calls = attempts, final, 0

    def __call__(self, t: Tensor) -> None:
        self.calls += 1
        if self.calls <= self.attempts:
            t[0] += 1.0
            t[1] += float(self.final)


def test_every_rank_takes_the_engine_that_passed_on_all():
    """Another rank's refusal moves this rank on too, although its own probe passed: one engine everywhere."""
    ranks = _Ranks(attempts=1)
    step, model, _, _ = _setup(distribution=Distribution(rank=0, world_size=2, all_reduce=ranks))
    with pytest.warns(UserWarning, match="passed engine 'vmap'"):
        step.verify(lambda batch: _loss(model, batch))
    assert step.engine_name == "vmap" and ranks.calls == 2 and step.verified


def test_a_refusal_on_another_rank_alone_is_refused_here_too():
    ranks = _Ranks(attempts=3)
    step, model, _, _ = _setup(distribution=Distribution(rank=0, world_size=2, all_reduce=ranks))
    with pytest.raises(PrivacyConfigurationError, match="another rank"):
        step.verify(lambda batch: _loss(model, batch))
    assert ranks.calls == 3 and not step.verified


def test_engines_after_lists_the_later_engines_that_serve_the_model():
    model = nn.Sequential(nn.Linear(3, 3))
    assert engines_after(model, "ghost") == ["vmap", "opacus_hooks"]
    assert engines_after(model, "opacus_hooks") == []
    recurrent = nn.Sequential(nn.Linear(3, 3), nn.LSTM(3, 3))  # Opacus' hooks have no rule for nn.LSTM
    assert engines_after(recurrent, "ghost") == ["vmap"]


def test_another_ranks_state_write_ends_the_search_on_every_rank():
    ranks = _Ranks(attempts=1, final=True)
    step, model, _, _ = _setup(distribution=Distribution(rank=0, world_size=2, all_reduce=ranks))
    with pytest.raises(PrivacyConfigurationError, match="another rank.*wrote the model's own state"):
        step.verify(lambda batch: _loss(model, batch))
    assert ranks.calls == 1 and step.engine_name == "ghost"


class _ActNorm(nn.Module):
    """Glow's ActNorm: a buffer set from the first batch's mean (a forward that writes data into the model)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("loc", torch.zeros(d))
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        if not bool(self.loc.any()):
            with torch.no_grad():
                self.loc.copy_(x.mean(0))
        return (x - self.loc) * self.scale


@pytest.mark.parametrize("broken", [False, True], ids=["engine-passes", "engine-fails-after-the-write"])
def test_a_forward_that_writes_the_models_state_is_refused_by_auto_without_trying_another_engine(monkeypatch, broken):
    """The first engine's probe ran the write: a second engine's probe would see nothing change and pass (found by a
    timm sweep: a data-dependent initialisation then trained on 'vmap', its buffer holding the private batch's mean).
    An engine failing after the write reports the write."""
    if broken:
        monkeypatch.setattr(linear_rule, "linear_stats", _failing_linear_rule)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 5) + 3, torch.randint(0, 3, (32,)))
    model = nn.Sequential(_ActNorm(5), nn.Linear(5, 3)).double()
    step = PrivateStep(1.0, C, ZeroNoise(), sampler_seed=0)
    step.attach(model, torch.optim.SGD(model.parameters(), lr=1.0))
    step.poisson_loader(DataLoader(data, batch_size=B))
    with pytest.raises(PrivacyConfigurationError, match="changed the model's own state") as refused:
        step.verify(lambda batch: _loss(model, batch))
    assert "also tried" not in str(refused.value) and step.engine_name == "ghost" and not step.verified


def _ghost_refused_and_auto_on_vmap(monkeypatch, rule: type, refusal: str):
    """With ghost's Linear rule replaced by ``rule``: the probe refuses ghost named (``refusal``), and ``auto`` passes
    over it to vmap with a warning; returns the ``auto`` setup (step, model, optimizer, loader) after its probe."""
    monkeypatch.setattr(linear_rule, "LinearFormStats", rule)
    step, model, _, _ = _setup("ghost")
    with pytest.raises(PrivacyConfigurationError, match=refusal):
        step.verify(lambda batch: _loss(model, batch))
    step, model, optimizer, loader = _setup()
    with pytest.warns(UserWarning, match="passed engine 'vmap'"):
        step.verify(lambda batch: _loss(model, batch))
    return step, model, optimizer, loader


class _Underestimating(linear_rule.LinearFormStats):
    """ghost's Linear rule with a wrong norm (half of it) and right sums: examples would be clipped too little."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sq_norms = self.sq_norms * 0.25


def test_a_wrong_norm_rule_is_caught_by_the_probe_and_auto_moves_on(monkeypatch):
    """The probe's norm check (validators/probe.py, _check_norms): an engine whose per-example norm is not the norm
    of the gradient it computes is refused; the comparisons of the engine with itself and of its sums with autograd
    cannot see that error."""
    step, model, optimizer, loader = _ghost_refused_and_auto_on_vmap(
        monkeypatch, _Underestimating, "computed a per-example gradient norm that is not")
    _assert_release_is_the_reference(step, model, optimizer, loader)


class _SquaredFactors(linear_rule.LinearFormStats):
    """ghost's Linear rule applying the clip factors squared: right at C = ∞ (every factor 1), wrong when clipping."""

    def sums(self, c: Tensor) -> dict:
        return super().sums(c * c)


def test_a_wrong_use_of_the_clip_factors_is_caught_by_the_probe(monkeypatch):
    """The probe's clipped pass (validators/probe.py, _check_clipping): at a bound that clips some examples the
    engine's sum must be Σ min(1, C/‖g_i‖) g_i of its own per-example gradients; every other pass takes C = ∞."""
    _ghost_refused_and_auto_on_vmap(monkeypatch, _SquaredFactors, "clipped the first step's examples wrongly")


# ------------------------------------------------------------------ one message, once (issue 35)
def _messages(err: BaseException) -> list[str]:
    """The messages Python prints for ``err``: its own and those of its chain (cause, context)."""
    out: list[str] = []
    while err is not None:
        out.append(str(err))
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return out


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=\.)\s+(?=[A-Z(])", text) if len(s.strip()) > 20]


def test_a_summed_loss_refused_by_every_engine_is_said_once_cause_and_fix_first():
    """auto probes ghost, vmap and opacus_hooks; each refuses the summed loss alike: the printed refusal (its chain
    included) names the cause and fix in its first sentence, is short, and repeats no sentence."""
    step, model, _, _ = _setup()
    with pytest.raises(PrivacyConfigurationError) as refused:
        step.verify(lambda batch: F.cross_entropy(model(batch[0].double()), batch[1], reduction="sum"))
    printed = "\n".join(_messages(refused.value))
    assert len(printed) < 2000, len(printed)
    sentences = _sentences(printed)
    assert len(sentences) == len(set(sentences)), printed
    first = sentences[0]
    assert "SUM over the batch" in first and "reduction='mean'" in first, first
    assert printed.endswith("(per_sample='auto' also tried 'vmap', 'opacus_hooks': the same refusal.)"), printed


def test_other_engines_reasons_are_one_line_of_headlines_only_where_they_differ():
    from lightning_dp.validators.step_checks import _probe_refusal

    cause = RuntimeError("an engine's own failure")
    first = PrivacyConfigurationError("Examples interact (parameter a.weight): the details.")
    first.__cause__ = cause
    error = _probe_refusal([("ghost", first),
                            ("vmap", PrivacyConfigurationError("Examples interact: other details.")),
                            ("opacus_hooks", PrivacyConfigurationError("The per-example engine failed (x): long."))],
                           "opacus_hooks")
    assert str(error) == ("Examples interact (parameter a.weight): the details.\n(per_sample='auto' also tried "
                          "'vmap': the same refusal; 'opacus_hooks': The per-example engine failed.)")
    assert error.__cause__ is cause  # the engine's failure stays the cause; the refusal is not printed twice


def test_a_headline_is_not_cut_inside_a_word():
    """QA qa8 s22: a refusal whose first line says "example(s)" was cut at its '(' and read "This step sampled 6
    example.)"; a headline ends at ': ' or ' (' only, its final ':' or '.' dropped."""
    from lightning_dp.validators.example_dim import example_dim_error
    from lightning_dp.validators.step_checks import _probe_refusal

    first = PrivacyConfigurationError("Examples interact (parameter a.weight): the details.")
    error = _probe_refusal([("ghost", first), ("opacus_hooks", example_dim_error({"lm_head": [(96, 100)]}, 6))],
                           "opacus_hooks")
    assert str(error).endswith("\n(per_sample='auto' also tried 'opacus_hooks': This step sampled 6 example(s), but "
                               "dimension 0 of these layers' outputs is not 6.)"), str(error)


def test_opacus_hooks_on_the_data_layer_raise_no_torch_notice_in_the_probe_or_the_step():
    """Opacus' full backward hooks fire on the first layer with output gradients only (its input is the data);
    torch says so with a warning at each backward the probe and the strategy run. Quieted around those calls only
    (issue 35): nothing reaches the user's console."""
    import warnings

    from conftest import TinyClassifier, make_loader, quiet_trainer

    from lightning_dp import DPStrategy
    from lightning_dp.grad_sample.opacus_hooks import OUTPUT_HOOK_NOTICE

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, per_sample="opacus_hooks"), max_steps=2).fit(
            TinyClassifier(), make_loader())
    assert not [str(w.message) for w in caught if OUTPUT_HOOK_NOTICE in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:  # outside our calls torch still says it: only ours is quiet
        warnings.simplefilter("always")
        step, model, _, loader = _setup("opacus_hooks")
        batch = next(iter(loader))
        assert step.begin() > 0
        _loss(model, batch).backward()
    assert [w for w in caught if OUTPUT_HOOK_NOTICE in str(w.message)]
