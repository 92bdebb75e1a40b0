"""A parameter written into a tensor by index assignment (grad_sample/capture/broadcast_sites.py,
``BroadcastSites._assigned``): into the examples' rows at positions a leading index picks (wav2vec2's SpecAugment,
``hidden[mask_time_indices] = self.masked_spec_embed``) it is a broadcast site; into anything else (peft FourierFT's
``dense[rows, cols] = spectrum``, then the matrix used as a weight) the tensor written is followed on to its use. Exact
against one backward per example on ghost and vmap; an assignment no rule serves (into the examples along the
value's own dimension) is still refused, and so is a mask that reads the other examples (by the first step's probe)."""

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

D, T, N, K = 4, 5, 6, 3
DT = torch.float64


class Assigns(nn.Module):
    """A sequence model whose masked positions take a learned vector, and a weight built by writing a learned
    spectrum into a zero matrix, each written in ``mode``'s way."""

    def __init__(self, mode: str, dtype: torch.dtype = DT) -> None:
        super().__init__()
        self.mode = mode
        g = torch.Generator().manual_seed(3)
        self.proj = nn.Linear(D, D, dtype=dtype)
        self.mask_emb = nn.Parameter(torch.randn(D, generator=g, dtype=dtype))
        self.spectrum = nn.Parameter(0.5 * torch.randn(K, generator=g, dtype=dtype))
        self.mask_emb.requires_grad_(mode != "weight")  # each mode trains the parameter it writes
        self.spectrum.requires_grad_(mode == "weight")
        self.register_buffer("where", torch.tensor([[0, 1, 3], [2, 0, 1]]))
        self.head = nn.Linear(D, 3, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)  # [n, T, D] (a linear layer's output: autograd keeps no copy of it, so it may be written)
        mask = x[..., 0] > 0.3  # each example's own positions
        if self.mode == "mask":
            h[mask] = self.mask_emb.to(h.dtype)
        elif self.mode == "rows":  # an integer index on the examples' rows, a slice on time
            h[torch.arange(h.shape[0]), 1:3] = self.mask_emb
        elif self.mode == "weight":
            dense = torch.zeros(D, D, dtype=h.dtype)
            dense[self.where[0], self.where[1]] = self.spectrum
            h = h + F.linear(h, dense)
        elif self.mode == "features":  # along the value's own dimension: no rule serves it
            h[..., :2] = self.mask_emb[:2]
        elif self.mode == "template":  # a zero template [T, D] (T = the step's n here) then added to every example
            template = torch.zeros(T, D, dtype=h.dtype)
            template[torch.tensor([True, False, True, False, True])] = self.mask_emb
            h = h + template
        elif self.mode == "neighbour":  # each example masked where the next one is: examples interact
            h[mask.roll(1, 0)] = self.mask_emb
        return self.head(torch.tanh(h).mean(1))


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


def _batch(n: int = N) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, T, D, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


def _engine_result(engine: str, model: nn.Module, C: float, n: int = N):
    x, y = _batch(n)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = per_example_grads(model, _loss, x, y, params)
    e = make_engine(engine)
    e.attach(model)
    try:
        e.begin_step(n)
        return run_engine(e, model, _loss, x, y, params, C), grads, params
    finally:
        e.detach()


@pytest.mark.parametrize("mode", ["mask", "rows", "weight", "template"])
@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_parameter_written_by_index_assignment_is_exact(engine, mode):
    torch.manual_seed(0)
    _, grads, params = _engine_result(engine, Assigns(mode), 1e6)
    C = float(reference(grads, params, float("inf")).norms.median())  # about half of the examples clipped
    got, grads, params = _engine_result(engine, Assigns(mode), C)
    assert_close_batch(got, reference(grads, params, C), params, rtol=1e-8)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_template_whose_rows_happen_to_number_the_examples_is_not_taken_for_them(engine):
    """A zero [T, D] template written then added to every example: a broadcast, also at a step of n = T examples."""
    got, grads, params = _engine_result(engine, Assigns("template"), 1e6, n=T)
    assert_close_batch(got, reference(grads, params, 1e6), params, rtol=1e-8)


def test_an_assignment_along_the_values_own_dimension_is_still_refused():
    with pytest.raises(PrivacyConfigurationError, match=r"parameter <root>\.mask_emb .*received a gradient, but from"):
        _engine_result("ghost", Assigns("features"), 1.0)


class Classifier(__import__("pytorch_lightning").LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.net = Assigns(mode, torch.float32)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(64, T, D, generator=g), torch.randint(0, 3, (64,), generator=g)),
                      batch_size=16)


@pytest.mark.parametrize("mode", ["mask", "weight"])
def test_a_lightning_module_writing_parameters_by_index_trains(mode):
    torch.manual_seed(0)
    model = Classifier(mode)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=dp, max_steps=3).fit(model, _data())
    assert dp.ledger.steps == 3
    written = "net.mask_emb" if mode == "mask" else "net.spectrum"
    assert not torch.equal(before[written], dict(model.named_parameters())[written])


def test_a_mask_read_from_another_example_is_refused():
    torch.manual_seed(0)
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(PrivacyConfigurationError, match="Examples interact"):
        quiet_trainer(strategy=dp, max_steps=3).fit(Classifier("neighbour"), _data())
    assert dp.ledger.steps == 0
