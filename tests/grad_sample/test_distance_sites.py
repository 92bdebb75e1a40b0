"""Learnable prototypes scored by ``torch.cdist`` (grad_sample/capture/distance_sites.py): ``-torch.cdist(features,
self.prototypes)`` with the prototypes a parameter of the LightningModule (zoo28 b05). Exact against one backward per
example on the engines that serve parameters outside standard layers (ghost, vmap; Opacus' hooks replay the whole
module: tests/grad_sample/test_opacus_hooks.py); a fit trains on each, and under ``per_sample='auto'``."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from gs_cases import assert_close_batch, per_example_grads, reference, run_engine
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp.grad_sample  # noqa: F401  (registers the engines)
from lightning_dp import DPStrategy
from lightning_dp.grad_sample.base import make_engine

D, K, N = 6, 3, 5
DT = torch.float64


class Prototypes(nn.Module):
    """An encoder, then the negative distances to K learnable prototypes (``p``: the norm); ``tokens``: m feature rows
    per example ``[n, m, d]``, their distances averaged."""

    def __init__(self, p: float = 2.0, tokens: int = 0) -> None:
        super().__init__()
        self.p, self.tokens = p, tokens
        self.enc = nn.Sequential(nn.Linear(D, 4 * max(tokens, 1), dtype=DT), nn.Tanh())
        self.protos = nn.Parameter(torch.randn(K, 4, dtype=DT, generator=torch.Generator().manual_seed(2)))

    def forward(self, x: Tensor) -> Tensor:
        h = self.enc(x)
        if self.tokens:
            return -torch.cdist(h.reshape(x.shape[0], self.tokens, 4), self.protos, p=self.p).mean(1)
        return -torch.cdist(h, self.protos, p=self.p)


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


def _engine_result(engine: str, model: nn.Module, x: Tensor, y: Tensor, C: float):
    params = list(model.parameters())
    e = make_engine(engine)
    e.attach(model)
    try:
        e.begin_step(x.shape[0])
        return run_engine(e, model, _loss, x, y, params, C)
    finally:
        e.detach()


@pytest.mark.parametrize("p, tokens", [(2.0, 0), (1.0, 0), (2.0, 3)])
@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_prototypes_by_cdist_get_exact_per_example_gradients(engine, p, tokens):
    torch.manual_seed(0)
    model = Prototypes(p, tokens)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g, dtype=DT), torch.randint(0, K, (N,), generator=g)
    params = list(model.parameters())
    grads = per_example_grads(model, _loss, x, y, params)
    C = float(reference(grads, params, float("inf")).norms.median())  # about half of the examples clipped
    assert_close_batch(_engine_result(engine, model, x, y, C), reference(grads, params, C), params, rtol=1e-8)


class LearnProto(pl.LightningModule):
    """zoo28 b05: the prototypes a parameter of the LightningModule itself."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.protos = nn.Parameter(torch.randn(2, 16))

    def forward(self, x: Tensor) -> Tensor:
        return -torch.cdist(self.enc(x), self.protos)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("engine", ["auto", "ghost", "vmap"])
def test_a_lightning_module_with_learnable_prototypes_trains(engine):
    torch.manual_seed(0)
    model = LearnProto()
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, per_sample=engine)
    quiet_trainer(strategy=dp, max_steps=3).fit(model, DataLoader(data, batch_size=16))
    assert dp.ledger.steps == 3
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


class CosinePrototypes(nn.Module):
    """zoo29 c07: a cosine classifier, ``F.cosine_similarity(z[:, None, :], protos[None], dim=-1)`` (``pairwise``:
    ``-F.pairwise_distance`` of the same broadcast instead)."""

    def __init__(self, pairwise: bool = False) -> None:
        super().__init__()
        self.pairwise = pairwise
        self.enc = nn.Sequential(nn.Linear(D, 4, dtype=DT), nn.Tanh())
        self.protos = nn.Parameter(torch.randn(K, 4, dtype=DT, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: Tensor) -> Tensor:
        z = self.enc(x)
        if self.pairwise:
            return -F.pairwise_distance(z[:, None, :], self.protos[None])
        return 10 * F.cosine_similarity(z[:, None, :], self.protos[None], dim=-1)


@pytest.mark.parametrize("pairwise", [False, True])
@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_cosine_and_pairwise_prototypes_get_exact_per_example_gradients(engine, pairwise):
    torch.manual_seed(0)
    model = CosinePrototypes(pairwise)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g, dtype=DT), torch.randint(0, K, (N,), generator=g)
    params = list(model.parameters())
    grads = per_example_grads(model, _loss, x, y, params)
    C = float(reference(grads, params, float("inf")).norms.median())
    assert_close_batch(_engine_result(engine, model, x, y, C), reference(grads, params, C), params, rtol=1e-8)


class CosineHead(LearnProto):
    def forward(self, x: Tensor) -> Tensor:
        return 10 * F.cosine_similarity(self.enc(x)[:, None, :], self.protos[None], dim=-1)


class BatchCosine(LearnProto):
    """The similarity reduced over the examples' dimension: row i depends on every example (not a site)."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.enc(x)
        return F.cosine_similarity(h, self.protos[:1].expand_as(h), dim=0)[:2].expand(x.shape[0], 2)


def _fit(model: pl.LightningModule, engine: str = "ghost") -> DPStrategy:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, per_sample=engine)
    quiet_trainer(strategy=dp, max_steps=3).fit(model, DataLoader(TensorDataset(x, (x[:, 0] > 0).long()),
                                                                  batch_size=16))
    return dp


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_cosine_classifier_trains(engine):
    torch.manual_seed(0)
    model = CosineHead()
    before = model.protos.detach().clone()
    assert _fit(model, engine).ledger.steps == 3
    assert not torch.equal(before, model.protos)


def test_a_similarity_reduced_over_the_examples_is_refused():
    from lightning_dp.errors import PrivacyConfigurationError

    torch.manual_seed(0)
    with pytest.raises(PrivacyConfigurationError):
        _fit(BatchCosine())
