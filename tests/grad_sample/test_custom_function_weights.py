"""A weight computed from parameters by a custom ``torch.autograd.Function`` (peft LoHa's ``HadaWeight``:
ΔW = ((w1a @ w1b) * (w2a @ w2b)) * scale, then ``F.linear(x, ΔW)``): the Function's forward runs without grad, so its
ops' results carry no gradient until the Function makes the last one its output; they are followed all the same
(grad_sample/capture/broadcast_sites.py) and the product with the examples is a site. Exact against one backward per
example on ghost; a Function's output used otherwise (a penalty on the whole ΔW added to the batch's mean loss) is
still refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from gs_cases import assert_close_batch, per_example_grads, reference, run_engine
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp.grad_sample  # noqa: F401  (registers the engines)
from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.grad_sample.base import make_engine

D, N, R = 6, 5, 2
DT = torch.float64


class Hadamard(torch.autograd.Function):
    """LoHa's weight, written as peft writes it: forward with ctx.save_for_backward, a backward of its own."""

    @staticmethod
    def forward(ctx, w1a, w1b, w2a, w2b):
        ctx.save_for_backward(w1a, w1b, w2a, w2b)
        return (w1a @ w1b) * (w2a @ w2b)

    @staticmethod
    def backward(ctx, g):
        w1a, w1b, w2a, w2b = ctx.saved_tensors
        t1, t2 = g * (w2a @ w2b), g * (w1a @ w1b)
        return t1 @ w1b.T, w1a.T @ t1, t2 @ w2b.T, w2a.T @ t2


class Adapted(nn.Module):
    """A frozen layer plus a Hadamard-product adapter whose factors live in the module (read directly)."""

    def __init__(self, use: str = "linear") -> None:
        super().__init__()
        self.use = use
        g = torch.Generator().manual_seed(3)
        self.base = nn.Linear(D, D, dtype=DT).requires_grad_(False)
        self.w1a, self.w2a = (nn.Parameter(0.5 * torch.randn(D, R, generator=g, dtype=DT)) for _ in range(2))
        self.w1b, self.w2b = (nn.Parameter(0.5 * torch.randn(R, D, generator=g, dtype=DT)) for _ in range(2))
        self.head = nn.Linear(D, 3, dtype=DT)

    def forward(self, x: Tensor) -> Tensor:
        delta = Hadamard.apply(self.w1a, self.w1b, self.w2a, self.w2b)
        h = torch.tanh(self.base(x) + F.linear(x, delta))
        if self.use == "penalty":
            self.delta = delta  # read by the loss
        return self.head(h)


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    loss = F.cross_entropy(model(x), y)
    return loss + 0.1 * model.delta.pow(2).sum() if model.use == "penalty" else loss


def _engine_result(model: nn.Module, C: float):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g, dtype=DT), torch.randint(0, 3, (N,), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = per_example_grads(model, _loss, x, y, params)
    e = make_engine("ghost")
    e.attach(model)
    try:
        e.begin_step(N)
        return run_engine(e, model, _loss, x, y, params, C), grads, params
    finally:
        e.detach()


def test_a_weight_made_by_a_custom_function_is_exact():
    torch.manual_seed(0)
    _, grads, params = _engine_result(Adapted(), 1e6)
    C = float(reference(grads, params, float("inf")).norms.median())  # about half of the examples clipped
    got, grads, params = _engine_result(Adapted(), C)
    assert_close_batch(got, reference(grads, params, C), params, rtol=1e-8)


def test_a_custom_functions_output_used_otherwise_is_still_refused():
    with pytest.raises(PrivacyConfigurationError, match=r"parameter <root>\.w1a .*received a gradient, but from no"):
        _engine_result(Adapted("penalty"), 1.0)


class Classifier(__import__("pytorch_lightning").LightningModule):
    def __init__(self, net: nn.Module, call=lambda net, x: net(x)) -> None:
        super().__init__()
        self.net, self.call = net, call

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.call(self.net, batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _fit(net: nn.Module) -> DPStrategy:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, D, generator=g), torch.randint(0, 3, (64,), generator=g))
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=dp, max_steps=3).fit(Classifier(net), DataLoader(data, batch_size=16))
    return dp


def test_a_lightning_module_with_a_custom_function_weight_trains():
    torch.manual_seed(0)
    net = Adapted().float()
    before = net.w2b.detach().clone()
    assert _fit(net).ledger.steps == 3
    assert not torch.equal(before, net.w2b)


def test_peft_loha_trains():
    peft = pytest.importorskip("peft")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.head = nn.Linear(D, D), nn.Linear(D, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(torch.tanh(self.q(x)))

    torch.manual_seed(0)
    net = peft.get_peft_model(Net(), peft.LoHaConfig(r=2, alpha=4, target_modules=["q"], modules_to_save=["head"]))
    assert _fit(net).ledger.steps == 3


class EmaWritten(Adapted):
    """Also keeps, under torch.no_grad(), a copy of the adapter's weight and uses it with grad on (a frozen teacher
    branch): the copy never carries a gradient, is no use of the parameters, and changes nothing."""

    def forward(self, x: Tensor) -> Tensor:
        w1a, w1b = self.w1a, self.w1b  # read with grad on (followed), then used under no_grad too
        delta = Hadamard.apply(w1a, w1b, self.w2a, self.w2b)
        with torch.no_grad():
            frozen = w1a @ w1b  # followed without grad: a copy that never gets one
        h = torch.tanh(self.base(x) + F.linear(x, delta))
        h = h + 0.1 * F.linear(h, frozen)  # h carries a gradient, the frozen copy none
        return self.head(h)


def test_a_copy_made_without_grad_is_no_use_of_the_parameters():
    torch.manual_seed(0)
    got, grads, params = _engine_result(EmaWritten(), 1e6)
    assert_close_batch(got, reference(grads, params, 1e6), params, rtol=1e-8)
