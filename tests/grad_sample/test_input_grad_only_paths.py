"""The ghost engine's input-gradient-only forwards take two paths: torch's own op on the detached weight and bias
where the call's input requires grad, the Python autograd Function where it does not (a first layer, whose output
must still require grad for the capture's hook). Both give the module's values and no weight gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gs_cases import assert_close_batch, per_example_grads, reference, run_engine
from lightning_dp.grad_sample.base import make_engine

LAYERS = [lambda: nn.Linear(6, 4), lambda: nn.Conv2d(3, 4, 3, padding=1), lambda: nn.ConvTranspose1d(3, 2, 3, stride=2)]


def _input(layer: nn.Module, requires_grad: bool) -> Tensor:
    shape = (5, 6) if isinstance(layer, nn.Linear) else (5, 3, *[4] * (layer.weight.dim() - 2))
    return torch.randn(shape, dtype=torch.float64, requires_grad=requires_grad)


@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("make", LAYERS)
def test_each_path_gives_the_module_output_and_no_weight_gradient(make, requires_grad):
    torch.manual_seed(0)
    layer = make().double()
    x = _input(layer, requires_grad)
    expected = layer(x)
    engine = make_engine("ghost")
    engine.attach(layer)
    try:
        out = layer(x)
        node = type(out.grad_fn).__name__
        assert ("InputGradOnly" in node) is not requires_grad, node  # the Function only for an input without grad
        assert out.requires_grad  # the capture's hook on it receives the output gradient either way
        out.backward(torch.ones_like(out))
    finally:
        engine.detach()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert layer.weight.grad is None and layer.bias.grad is None


class InPlace(nn.Module):
    """Two Linear layers on [n, T, d]; the second's output (a view, from F.linear on a 3-D input) changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        q = self.b(torch.tanh(self.a(x)))
        q /= 2.0
        return q.sum(1)


def test_an_output_changed_in_place_keeps_the_exact_clipped_sums():
    torch.manual_seed(0)
    model = InPlace().double()
    x, y = torch.randn(6, 5, 4, dtype=torch.float64), torch.randint(0, 3, (6,))

    def loss_fn(m: nn.Module, xb: Tensor, yb: Tensor) -> Tensor:
        return F.cross_entropy(m(xb), yb)

    params = list(model.parameters())
    grads = per_example_grads(model, loss_fn, x, y, params)
    C = float(reference(grads, params, float("inf")).norms.median())
    engine = make_engine("ghost")
    engine.attach(model)
    try:
        got = run_engine(engine, model, loss_fn, x, y, params, C, with_squares=False)
    finally:
        engine.detach()
    assert_close_batch(got, reference(grads, params, C), params, rtol=1e-10)
