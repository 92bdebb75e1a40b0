"""Ghost engine == brute-force per-example clipping (docs/algorithms.md "The mechanism", §4)."""

import pytest
import torch
from torch import nn

import lightning_dp.grad_sample.conv_rules as conv_rules
import lightning_dp.grad_sample.embedding_rule as embedding_rule
import lightning_dp.grad_sample.ghost as ghost
import lightning_dp.grad_sample.linear_rule as linear_rule
import lightning_dp.grad_sample.norm_rule as norm_rule
from lightning_dp.grad_sample.base import make_engine
from gs_cases import (
    assert_close_batch,
    check_clipping_bound,
    check_engine,
    make_case,
    per_example_grads,
    random_scale,
    reference,
    run_engine,
)

KINDS = ["cnn", "mlp", "lm"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("with_squares", [False, True])
def test_matches_reference(kind, scaled, with_squares):
    check_engine(make_engine("ghost"), kind, 6, scaled, freeze=False, with_squares=with_squares)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [0, 1])
def test_tiny_batches(kind, n):
    got = check_engine(make_engine("ghost"), kind, n, scaled=True, freeze=False)
    assert got.batch_size == n


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_parameters_ignored(kind):
    got = check_engine(make_engine("ghost"), kind, 4, scaled=True, freeze=True, with_squares=False)
    assert all(p.requires_grad for p in got.sums)


@pytest.mark.parametrize("force", [True, False])
def test_both_norm_paths(monkeypatch, force):
    """Ghost norm and materialised norm, for Linear/Conv2d and Embedding, both exact."""
    monkeypatch.setattr(linear_rule, "prefer_ghost", lambda *a: force)
    monkeypatch.setattr(conv_rules, "prefer_conv_ghost", lambda *a: force)
    monkeypatch.setattr(embedding_rule, "prefer_ghost_embedding", lambda *a: force)
    for kind in ("lm", "cnn"):
        check_engine(make_engine("ghost"), kind, 5, scaled=False, freeze=False, with_squares=False)


def test_without_skipping_param_grads():
    check_engine(ghost.GhostEngine(skip_param_grads=False), "lm", 4, scaled=True, freeze=False)


def test_float32_within_1e5():
    check_engine(make_engine("ghost"), "lm", 6, scaled=True, freeze=False, dtype=torch.float32)


def test_clipping_bound():
    check_clipping_bound(make_engine("ghost"))


class _SigmoidGate(nn.Module):
    """A leaf without a closed-form rule: x ⊙ σ(w)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * torch.sigmoid(self.weight)


def test_fallback_layer_and_no_state_left():
    """A leaf layer without a ghost rule goes through vmap; nothing survives the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), _SigmoidGate(5), nn.Linear(5, 3)).double()
    engine = make_engine("ghost")
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    params = list(model.parameters())
    loss = lambda m, x, y: nn.functional.cross_entropy(m(x), y)  # noqa: E731
    ref = []
    for i in range(4):
        ref.append(torch.autograd.grad(loss(model, x[i:i + 1], y[i:i + 1]), params))
    engine.attach(model)
    got = run_engine(engine, model, loss, x, y, params, 1e9, with_squares=False)
    assert not engine._capture.any_recorded()
    for k, p in enumerate(params):
        torch.testing.assert_close(got.sums[p], sum(r[k] for r in ref), rtol=1e-7, atol=1e-9)
    engine.detach()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_batch_size_disagreement_raises():
    """Without the step's example count, a [1, T] lookup broadcast over the batch is refused
    (its output gradient is the batch's sum); with it, see test_broadcast_lookup_is_exact."""

    class Broadcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(10, 4), nn.Embedding(3, 4), nn.Linear(4, 10)

        def forward(self, idx):
            return self.head(self.tok(idx) + self.pos(torch.arange(3)[None]))

    model, engine = Broadcast(), make_engine("ghost")
    engine.attach(model)
    x = torch.randint(0, 10, (2, 3))
    model(x).sum().backward()
    with pytest.raises(ValueError, match="example dimension"):
        engine.clip_and_sum(list(model.parameters()), 1.0)
    assert not engine._capture.any_recorded()


def test_unused_parameter_gets_a_zero_sum_and_adds_nothing_to_the_norms():
    model, loss, x, y = make_case("mlp", 3)
    engine = make_engine("ghost")
    engine.attach(model)
    used = list(model.parameters())
    before = run_engine(engine, model, loss, x, y, used, 1.0)
    model.extra = nn.Linear(2, 2).double()  # never called in forward
    after = run_engine(engine, model, loss, x, y, list(model.parameters()), 1.0)
    torch.testing.assert_close(after.norms, before.norms)
    assert all(not after.sums[p].any() for p in model.extra.parameters())


def test_a_gradient_from_an_uncaptured_use_raises():
    model, loss, x, y = make_case("mlp", 3)
    model.extra = nn.Linear(2, 2).double()
    engine = make_engine("ghost")
    engine.attach(model)
    functional = lambda m, x, y: loss(m, x, y) + 0.1 * m.extra.weight.sum()  # noqa: E731  (read outside its module)
    with pytest.raises(ValueError, match="received a gradient, but from no use"):
        run_engine(engine, model, functional, x, y, list(model.parameters()), 1.0)


class _ConvZoo(nn.Module):
    """Conv2d layouts the conv rule must get right: dilation, stride, asymmetric padding,
    a rectangular kernel, no bias, and one conv called twice (its per-example grad sums the calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.dil = nn.Conv2d(2, 3, 3, dilation=2, padding=(2, 1))
        self.rect = nn.Conv2d(3, 4, (2, 3), stride=(2, 1), bias=False)
        self.twice = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.tanh(self.dil(x))
        x = torch.tanh(self.twice(torch.tanh(self.twice(self.rect(x)))))
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("force", [True, False])
@pytest.mark.parametrize("scaled", [False, True])
def test_conv_layouts_both_norm_paths(monkeypatch, force, scaled):
    monkeypatch.setattr(conv_rules, "prefer_conv_ghost", lambda *a: force)
    torch.manual_seed(0)
    model = _ConvZoo().double()
    x, y = torch.randn(5, 2, 9, 7, dtype=torch.float64), torch.randint(0, 3, (5,))
    _check_against_reference(model, x, y, scaled, with_squares=scaled)


def _check_against_reference(model: nn.Module, x, y, scaled: bool, with_squares: bool) -> None:
    """Ghost engine on a classifier == the brute-force per-example reference, C at the median norm."""
    loss = lambda m, x, y: nn.functional.cross_entropy(m(x), y)  # noqa: E731
    params = list(model.parameters())
    scale = random_scale(params) if scaled else None
    grads = per_example_grads(model, loss, x, y, params, scale)
    C = float(reference(grads, params, float("inf")).norms.median())
    engine = make_engine("ghost")
    engine.attach(model)
    got = run_engine(engine, model, loss, x, y, params, C, scale, with_squares=with_squares)
    engine.detach()
    assert_close_batch(got, reference(grads, params, C), params)


def test_conv_chunked_patches_match_reference(monkeypatch):
    """Patch columns unfolded a few examples at a time (the memory bound) give the same sums."""
    monkeypatch.setattr(conv_rules, "_MIN_PATCH_CHUNK", 1)
    for force in (True, False):
        test_conv_layouts_both_norm_paths(monkeypatch, force, scaled=False)


@pytest.mark.parametrize("n,per_example,budget", [(64, 9216, 65536 * 4), (5, 1134, 630), (7, 10, 10**6), (1, 50, 0)])
def test_example_chunks_cover_the_batch_within_budget(monkeypatch, n, per_example, budget):
    monkeypatch.setattr(conv_rules, "_MIN_PATCH_CHUNK", 64)
    chunks = conv_rules.example_chunks(n, per_example, budget)
    assert [i for s in chunks for i in range(n)[s]] == list(range(n))
    for s in chunks:
        k = len(range(n)[s])
        assert k == 1 or k * per_example <= max(budget, 64)
    assert len(chunks) <= 1 + n * per_example // max(budget, 64)
    assert len(conv_rules.example_chunks(n, per_example, budget, "cuda")) <= len(chunks)  # GPU: fewer launches


class _NormTwice(nn.Module):
    """One LayerNorm applied on two branches (its per-example grads sum both calls), an
    RMSNorm without bias, and a GroupNorm on a [n, C, L] input."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.ln, self.rms = nn.Linear(6, 8), nn.LayerNorm(8), nn.RMSNorm(8)
        self.gn, self.out = nn.GroupNorm(2, 4), nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        h = self.ln(h) + self.ln(torch.tanh(h))
        h = self.gn(self.rms(h).view(-1, 4, 2)).view(-1, 8)
        return self.out(h)


def _norm_twice_case():
    torch.manual_seed(0)
    model = _NormTwice().double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    return model, x, y, (lambda m, x, y: nn.functional.cross_entropy(m(x), y))


@pytest.mark.parametrize("scaled", [False, True])
def test_norm_layers_reduced_during_backward_match_reference(scaled):
    model, x, y, _ = _norm_twice_case()
    _check_against_reference(model, x, y, scaled, with_squares=True)


def test_norm_layer_calls_release_their_tensors_during_backward():
    """After backward a normalisation layer holds only its [n, C] per-example grads: no input,
    no output gradient (the memory the ghost engine would otherwise keep until clipping)."""
    from lightning_dp.grad_sample.capture.activations import ActivationCapture

    model, x, y, loss = _norm_twice_case()
    layers = [(n, m) for n, m in model.named_children()]
    held, reduced = ActivationCapture(), ActivationCapture()
    held.attach(layers)
    reduced.attach(layers, ghost.reducer_for)
    loss(model, x, y).backward()
    for name, m in layers:
        got, ref = reduced.completed()[id(m)], held.completed()[id(m)]
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
            assert got.records == [] and len(ref.records) == (2 if name == "ln" else 1)
            expect = {}
            for r in ref.records:
                for k, g in norm_rule.norm_layer_record_grads(m, r).items():
                    expect[k] = expect.get(k, 0) + g
            assert set(got.reduced) == {k for k, _ in m.named_parameters()}
            for k, g in expect.items():
                torch.testing.assert_close(got.reduced[k], g)
                assert g.shape == (5, *getattr(m, k).shape)
        else:
            assert got.reduced == {} and len(got.records) == 1


def test_backward_twice_through_a_reduced_layer_raises():
    from lightning_dp.grad_sample.capture.activations import ActivationCapture

    model, x, y, loss = _norm_twice_case()
    capture = ActivationCapture()
    capture.attach(list(model.named_children()), ghost.reducer_for)
    out = loss(model, x, y)
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.backward()


def test_large_vocabulary_embedding_never_scatters(monkeypatch):
    """T² > 16·V would favour scattering on time alone, but a vocabulary > 8·T would make the
    [n, V, d] buffer dwarf the activations: the ghost norm is used, and it is exact."""
    def no_scatter(self):
        raise AssertionError("scattered into [n, V, d]")

    monkeypatch.setattr(embedding_rule.EmbeddingStats, "_scatter", no_scatter)
    torch.manual_seed(0)
    n, T, V, dim = 3, 300, 5000, 4
    idx, d = torch.randint(0, 20, (n, T)), torch.randn(n, T, dim, dtype=torch.float64)
    weight = torch.zeros(V, dim, dtype=torch.float64)
    got = embedding_rule.EmbeddingStats(idx, d, weight, None, with_squares=False).sq_norms
    expect = [torch.zeros(V, dim, dtype=torch.float64).index_add_(0, idx[i], d[i]).square().sum() for i in range(n)]
    torch.testing.assert_close(got, torch.stack(expect))
    assert not embedding_rule.prefer_ghost_embedding(64, 64)  # position tables (V = T) still scatter


def test_bf16_autocast_conv_and_norm_layers_give_float32_sums_near_float32_norms():
    """Under CPU bf16 autocast the captured activations and output grads are bf16: the reduced
    normalisation layers and the conv/linear rules compute in float32 and match float32 norms."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    x, y = torch.randn(6, 2, 6, 6), torch.randint(0, 3, (6,))
    params = list(model.parameters())

    def clipped(autocast: bool):
        engine = make_engine("ghost")
        engine.attach(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        out = engine.clip_and_sum(params, 1.0)
        engine.detach()
        return out

    low, full = clipped(True), clipped(False)
    assert all(low.sums[p].dtype == torch.float32 and low.sums[p].isfinite().all() for p in params)
    torch.testing.assert_close(low.norms, full.norms, rtol=0.05, atol=0.0)


def test_backward_of_a_cleared_step_does_not_reach_the_next_step():
    """A graph kept past its step's clipping (cleared) and backpropagated later adds nothing to
    the step being recorded now."""
    from lightning_dp.grad_sample.capture.activations import ActivationCapture

    model, x, y, loss = _norm_twice_case()
    capture = ActivationCapture()
    capture.attach(list(model.named_children()), ghost.reducer_for)
    stale = loss(model, x, y)
    capture.clear()
    loss(model, x[:3], y[:3]).backward()
    fresh = {k: g.clone() for k, g in capture.completed()[id(model.ln)].reduced.items()}
    stale.backward()
    assert all(torch.equal(capture.completed()[id(model.ln)].reduced[k], g) for k, g in fresh.items())
    assert capture.completed()[id(model.ln)].reduced["weight"].shape[0] == 3


@pytest.mark.parametrize("name", ["ghost", "vmap"])
def test_the_previous_release_left_in_an_unused_parameters_grad_is_no_gradient_of_this_step(name):
    """A parameter in no optimizer group keeps the last release in ``.grad`` (no ``zero_grad`` reaches it): untouched
    it adds nothing; once a backward adds to it (a use the engine does not capture) it is refused as before, and so
    is a non-zero ``.grad`` no release wrote."""
    from lightning_dp.engine_api import mark_released

    model, loss, x, y = make_case("mlp", 3)
    model.extra = nn.Linear(2, 2).double()
    engine = make_engine(name)
    engine.attach(model)
    params = list(model.parameters())

    def step(loss_fn, released=True):
        for p in params:
            p.grad = None
        for p in model.extra.parameters():
            p.grad = torch.randn_like(p)  # the previous step's ĝ: noise only
            if released:
                mark_released(p.grad)
        loss_fn(model, x, y).backward()
        return engine.clip_and_sum(params, 1.0)

    out = step(loss)
    assert all(not out.sums[p].any() for p in model.extra.parameters())
    with pytest.raises(ValueError, match="received a gradient, but from no use"):
        step(lambda m, x, y: loss(m, x, y) + 0.1 * m.extra.weight.sum())
    with pytest.raises(ValueError, match="received a gradient, but from no use"):
        step(loss, released=False)


def test_only_layers_no_rule_serves_by_class_have_their_calls_verified_as_a_scale(monkeypatch):
    """The ghost engine's capture verifies a call as w ⊙ y + b (a walk of its autograd nodes, read by the
    elementwise-scale rule only) for a layer no rule serves by its class alone (issue 38): not for Linear or LayerNorm,
    still for a custom scale layer, which the elementwise-scale rule then serves (its exact per-example gradients)."""
    import torch.nn.functional as F

    import lightning_dp.grad_sample.capture.activations as activations
    import lightning_dp.grad_sample.elementwise_scale as elementwise_scale

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x * self.weight

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), Scale(), nn.Linear(4, 2))
    checked, served = [], []
    real_check, real_grads = activations.scaled_operand, elementwise_scale.scale_layer_grads
    monkeypatch.setattr(activations, "scaled_operand", lambda c, out, inputs: checked.append(c) or real_check(
        c, out, inputs))
    monkeypatch.setattr(elementwise_scale, "scale_layer_grads", lambda calls, *a: served.append(calls.module) or
                        real_grads(calls, *a))
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    engine = make_engine("ghost")
    engine.attach(model)
    engine.begin_step(5)
    F.cross_entropy(model(x), y).backward()
    params = list(model.parameters())
    out = engine.clip_and_sum(params, 0.1)
    engine.detach()
    assert [tuple(c) for c in checked] == [(model[2].weight,)] and served == [model[2]]
    for i in range(5):  # the per-example norms are the exact ones
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
        torch.testing.assert_close(out.norms[i], torch.sqrt(sum(g.pow(2).sum() for g in grads)), rtol=1e-5, atol=1e-7)
