"""vmap engine == brute-force per-example clipping (docs/algorithms.md "The mechanism", §4)."""

import pytest
import torch
from torch import nn

from lightning_dp.grad_sample.base import make_engine
import lightning_dp.grad_sample.functorch_vmap  # noqa: F401  (registers "vmap")
from gs_cases import check_clipping_bound, check_engine, cls_loss, run_engine

KINDS = ["cnn", "mlp", "lm"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scaled", [False, True])
def test_matches_reference(kind, scaled):
    check_engine(make_engine("vmap"), kind, 5, scaled, freeze=False)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [0, 1])
def test_tiny_batches(kind, n):
    assert check_engine(make_engine("vmap"), kind, n, scaled=False, freeze=False).batch_size == n


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_parameters_ignored(kind):
    check_engine(make_engine("vmap"), kind, 3, scaled=True, freeze=True, with_squares=False)


def test_clipping_bound():
    check_clipping_bound(make_engine("vmap"))


def test_tied_weights_sum_their_owners():
    """One Parameter in two layers: per-example grad is the sum of both uses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False)).double()
    model[2].weight = model[0].weight
    params = list(model.parameters())
    assert len(params) == 1
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 4, (3,))
    ref = [torch.autograd.grad(cls_loss(model, x[i:i + 1], y[i:i + 1]), params)[0] for i in range(3)]
    engine = make_engine("vmap")
    engine.attach(model)
    got = run_engine(engine, model, cls_loss, x, y, params, 1e9, with_squares=False)
    torch.testing.assert_close(got.norms, torch.stack([r.norm() for r in ref]))
    torch.testing.assert_close(got.sums[params[0]], sum(ref))
    assert not engine._capture.any_recorded()
    engine.detach()


def test_unsupported_layers_named():
    class RootParam(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x * self.w)

    model = nn.Sequential(nn.BatchNorm1d(3), RootParam())
    problems = make_engine("vmap").unsupported_layers(model)
    assert problems == ["0 (BatchNorm1d): mixes examples in training mode (keep it in eval, or use GroupNorm)"]
    model[0].eval()  # running statistics: a per-example affine map; RootParam's w: served (root_parameters.py)
    assert make_engine("vmap").unsupported_layers(model) == []
