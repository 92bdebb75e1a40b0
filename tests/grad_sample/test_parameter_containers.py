"""Weights kept in an ``nn.ParameterList`` / ``nn.ParameterDict`` and used by the module that holds the container
(``x @ self.ws[i]``, ``F.linear(x, self.ws[i])``, ``torch.einsum``, ``for w in self.ws``, ``self.pd["scale"]``,
``self.pd.values()``): served like a plain parameter attribute of that module (grad_sample/capture/root_parameters.py),
the product with the examples ``x @ w`` being a site like ``F.linear`` (capture/broadcast_sites.py, ``PRODUCTS``).
Exact against one backward per example on ghost and vmap; a use no rule serves is still refused; Opacus' hooks, which
never see the use, refuse the container by name."""

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

D, N = 6, 5
DT = torch.float64


class Held(nn.Module):
    """Two weights in a ParameterList, a scale and a bias in a ParameterDict, read in ``mode``'s way; a head layer."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        g = torch.Generator().manual_seed(3)
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(D, D, generator=g, dtype=DT) * 0.4) for _ in range(2)])
        self.pd = nn.ParameterDict({"scale": nn.Parameter(1 + 0.1 * torch.randn(D, generator=g, dtype=DT)),
                                    "bias": nn.Parameter(0.1 * torch.randn(D, generator=g, dtype=DT))})
        self.head = nn.Linear(D, 3, dtype=DT)

    def forward(self, x: Tensor) -> Tensor:
        if self.mode == "matmul":  # indexing, x @ w and x @ w.t()
            x = torch.tanh(torch.tanh(x @ self.ws[0]) @ self.ws[1].t())
        elif self.mode == "linear":  # F.linear(x, w), then torch.mm
            x = torch.tanh(torch.mm(torch.tanh(F.linear(x, self.ws[0])), self.ws[1]))
        elif self.mode == "einsum":  # torch.einsum, and torch.matmul of a vector-valued use
            x = torch.tanh(torch.einsum("bi,ij->bj", x, self.ws[0]))
            x = torch.tanh(torch.matmul(x, self.ws[1]))
        elif self.mode == "iterate":  # for w in self.ws
            for w in self.ws:
                x = torch.tanh(x @ w)
        if self.mode == "iterate":
            (scale,) = [v for k, v in zip(self.pd.keys(), self.pd.values()) if k == "scale"]  # values(), get(key)
            return self.head(x * scale + self.pd.get("bias"))
        return self.head(x * self.pd["scale"] + self.pd["bias"])


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


def _batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=g, dtype=DT), torch.randint(0, 3, (N,), generator=g)


def _engine_result(engine: str, model: nn.Module, C: float):
    x, y = _batch()
    params = list(model.parameters())
    e = make_engine(engine)
    e.attach(model)
    try:
        e.begin_step(N)
        return run_engine(e, model, _loss, x, y, params, C)
    finally:
        e.detach()


@pytest.mark.parametrize("mode", ["matmul", "linear", "einsum", "iterate"])
@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_container_weights_get_exact_per_example_gradients(engine, mode):
    torch.manual_seed(0)
    model = Held(mode)
    x, y = _batch()
    params = list(model.parameters())
    grads = per_example_grads(model, _loss, x, y, params)
    C = float(reference(grads, params, float("inf")).norms.median())  # about half of the examples clipped
    assert_close_batch(_engine_result(engine, model, C), reference(grads, params, C), params, rtol=1e-8)


class PlainMatmul(nn.Module):
    """The same product on a plain parameter attribute of a module with a layer (not a unit: a root parameter):
    served alike."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(D, D, dtype=DT)
        self.w = nn.Parameter(torch.randn(D, 3, dtype=DT) * 0.4)
        self.b = nn.Parameter(torch.zeros(3, dtype=DT))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.inner(x)) @ self.w + self.b


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_plain_parameter_multiplied_with_the_examples_is_exact(engine):
    model = PlainMatmul()
    x, y = _batch()
    params = list(model.parameters())
    ref = reference(per_example_grads(model, _loss, x, y, params), params, 1e6)
    assert_close_batch(_engine_result(engine, model, 1e6), ref, params, rtol=1e-8)


class LeftProduct(Held):
    """The list's weight multiplied with the examples from the left, ``(w @ x.t()).t()``: no rule serves it."""

    def forward(self, x: Tensor) -> Tensor:
        return self.head((self.ws[0] @ x.t()).t() * self.pd["scale"])


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_container_weight_used_otherwise_is_still_refused(engine):
    with pytest.raises(PrivacyConfigurationError, match=r"parameter ws\.0 .*received a gradient, but from no use"):
        _engine_result(engine, LeftProduct("matmul"), 1.0)


def test_opacus_hooks_refuses_the_container_by_name():
    problems = make_engine("opacus_hooks").unsupported_layers(Held("matmul"))
    assert any(p.startswith("ws (ParameterList)") and "'ghost'" in p for p in problems), problems
    assert any(p.startswith("pd (ParameterDict)") for p in problems), problems


class Classifier(__import__("pytorch_lightning").LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Held("iterate").float()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("engine", ["auto", "vmap"])
def test_a_lightning_module_with_parameter_containers_trains(engine):
    torch.manual_seed(0)
    model = Classifier()
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, D, generator=g), torch.randint(0, 3, (64,), generator=g))
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, per_sample=engine)
    quiet_trainer(strategy=dp, max_steps=3).fit(model, DataLoader(data, batch_size=16))
    assert dp.ledger.steps == 3
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
