"""A LayerNorm/GroupNorm call keeps the mean and 1/σ torch's kernel normalised with (capture.activations.norm_stats),
and the norm rule normalises the input again from them (norm_rule.normalised): the same values, detached from the
graph, and only where the statistics are laid out as the call is recorded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.grad_sample.base import make_engine
from lightning_dp.grad_sample.norm_rule import normalised


def _recorded(model: nn.Module, layer: nn.Module, x: torch.Tensor):
    engine = make_engine("ghost")
    engine.attach(model)
    engine.begin_step(x.shape[0])
    out = model(x)
    return engine, out, engine._capture._calls[id(layer)].records


@pytest.mark.parametrize("layer,shape", [(nn.LayerNorm(16), (4, 5, 16)), (nn.LayerNorm((3, 4)), (4, 3, 4)),
                                         (nn.GroupNorm(2, 6), (4, 6, 3, 3))])
def test_kept_statistics_normalise_as_the_kernel_did(layer, shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 2
    engine, _, records = _recorded(layer, layer, x)
    try:
        (rec,) = records
        assert rec.norm_stats is not None
        assert all(t.grad_fn is None and not t.requires_grad for t in rec.norm_stats)  # no cycle through the graph
        got = normalised(layer, rec.args[0], rec)
        if isinstance(layer, nn.GroupNorm):
            want = F.group_norm(x, layer.num_groups, eps=layer.eps)
        else:
            want = F.layer_norm(x, layer.normalized_shape, eps=layer.eps)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    finally:
        engine.detach()


class Flattened(nn.Module):
    """A LayerNorm called on the examples' rows flattened, [n·m, d]: its statistics are laid out per row."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.head = nn.LayerNorm(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, m, d = x.shape
        return self.head(self.ln(x.reshape(n * m, d)).reshape(n, m, d)).sum(1)


def test_a_call_on_flattened_rows_keeps_no_statistics_and_its_gradients_stay_exact():
    torch.manual_seed(0)
    model = Flattened().double()
    x, y = torch.randn(3, 4, 8, dtype=torch.float64), torch.randint(0, 2, (3,))
    weight = model.ln.weight  # read before the capture follows reads made outside the layer's forward
    engine, out, records = _recorded(model, model.ln, x)
    try:
        (rec,) = records
        assert rec.flattened and rec.norm_stats is None
        F.cross_entropy(out, y).backward()
        got = engine.clip_and_sum([weight], float("inf"))
    finally:
        engine.detach()
    expected = torch.zeros_like(weight)
    for i in range(3):
        g, = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), weight)
        expected += g
    torch.testing.assert_close(got.sums[weight], expected, rtol=1e-10, atol=1e-12)
