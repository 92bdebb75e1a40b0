"""Layers pruned by ``torch.nn.utils.prune`` (validators/layers.pruned; Lightning's ``ModelPruning``): the trainable
tensor is ``weight_orig`` and the layer computes ``weight = weight_orig * weight_mask`` in a forward pre-hook. Served
like a parametrization (replayed per example on the originals): example i's gradient of ``weight_orig`` is its gradient
of ``weight`` times the mask. Exact against one backward per example on ghost and vmap; Opacus' rules, which would give
the computed weight the gradient, refuse the layer by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from gs_cases import assert_close_batch, per_example_grads, reference, run_engine
from torch import Tensor, nn

import lightning_dp.grad_sample  # noqa: F401  (registers the engines)
from lightning_dp.grad_sample.base import make_engine

N = 6
DT = torch.float64


def _pruned(kind: str) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    if kind == "conv":
        model = nn.Sequential(nn.Conv1d(2, 4, 3, dtype=DT), nn.Tanh(), nn.Flatten(), nn.Linear(16, 3, dtype=DT))
        prune.ln_structured(model[0], "weight", amount=0.5, n=2, dim=0)
        prune.l1_unstructured(model[3], "weight", amount=0.4)
        return model, torch.randn(N, 2, 6, dtype=DT)
    model = nn.Sequential(nn.Linear(5, 8, dtype=DT), nn.Tanh(), nn.Linear(8, 3, dtype=DT))
    prune.l1_unstructured(model[0], "weight", amount=0.3)
    prune.l1_unstructured(model[0], "bias", amount=0.3)
    prune.random_unstructured(model[2], "weight", amount=0.5)
    if kind == "twice":  # ModelPruning prunes again at every epoch's end: a PruningContainer
        prune.l1_unstructured(model[0], "weight", amount=0.3)
    return model, torch.randn(N, 5, dtype=DT)


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("kind", ["linear", "twice", "conv"])
@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_pruned_layers_get_exact_per_example_gradients_of_their_originals(engine, kind):
    model, x = _pruned(kind)
    y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    assert any(name.endswith("weight_orig") for name, _ in model.named_parameters())
    grads = per_example_grads(model, _loss, x, y, params)
    C = float(reference(grads, params, float("inf")).norms.median())  # about half of the examples clipped
    e = make_engine(engine)
    assert e.unsupported_layers(model) == []
    e.attach(model)
    try:
        e.begin_step(N)
        got = run_engine(e, model, _loss, x, y, params, C)
    finally:
        e.detach()
    assert_close_batch(got, reference(grads, params, C), params, rtol=1e-8)
    for m in model.modules():  # the weight the replays computed on their originals was put back: a plain tensor
        w = m.__dict__.get("weight")
        assert w is None or not torch._C._functorch.is_functorch_wrapped_tensor(w)
    w = model[0].weight_orig.detach() * model[0].weight_mask
    assert torch.equal(model[0](x[:1]).detach(), model[0]._conv_forward(x[:1], w, model[0].bias).detach()) \
        if kind == "conv" else torch.equal(model[0].weight.detach(), w)


def test_opacus_hooks_refuse_a_pruned_layer_by_name():
    model, _ = _pruned("linear")
    problems = make_engine("opacus_hooks").unsupported_layers(model)
    assert any(p.startswith("0 (Linear)") and "pruning mask" in p and "'ghost'" in p for p in problems), problems
