"""A parameter looked up by the examples' own indices with indexing, ``self.centers[y]`` or
``self.centers.index_select(0, y)`` (center loss, per-class biases and prototypes): the same lookup as
``F.embedding(y, self.centers)`` and served alike (grad_sample/capture/broadcast_sites.py, ``LOOKUPS``), exact against
one backward per example on ghost and vmap (with the table's other uses that are broadcasts over the examples: its sum,
its rows picked by a boolean mask). A table also used otherwise (a penalty on the whole table added to the loss) is
still refused, and a lookup keyed by another example's label is refused by the first step's probe."""

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

D, N, K = 6, 5, 3
DT = torch.float64


class CenterLoss(nn.Module):
    """A body, a head and per-class centres (Wen et al. 2016) read by indexing in ``mode``'s way."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        g = torch.Generator().manual_seed(3)
        self.body = nn.Linear(D, D, dtype=DT)
        self.head = nn.Linear(D, K, dtype=DT)
        shape = {"vector": (K,), "cube": (K, 2, D // 2)}.get(mode, (K, D))
        self.centers = nn.Parameter(0.3 * torch.randn(*shape, generator=g, dtype=DT))

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        h = torch.tanh(self.body(x))
        ce = F.cross_entropy(self.head(h), y, reduction="none")
        if self.mode == "index":
            c = self.centers[y]
        elif self.mode == "slice":
            c = self.centers[y, :]
        elif self.mode == "index_select":
            c = self.centers.index_select(0, y)
        elif self.mode == "negative":  # counted from the end: the same rows
            c = self.centers[y - K]
        elif self.mode == "vector":  # a per-class scalar: c_y · Σ h
            return (ce + self.centers[y] * h.sum(1)).mean()
        elif self.mode == "cube":
            c = self.centers[y, ...].reshape(-1, D)
        elif self.mode == "summed":  # the lookup, and the whole table's sum broadcast over the examples
            c = self.centers[y] + self.centers.sum(0)
        elif self.mode == "mask":  # a boolean index picks the table's rows, not the examples': broadcast
            c = self.centers[torch.tensor([True, False, True])].mean(0)
        elif self.mode == "penalty":  # the lookup, and the whole table in the batch's mean loss: no example's
            return (ce + ((h - self.centers[y]) ** 2).sum(1)).mean() + 0.1 * self.centers.pow(2).sum()
        return (ce + ((h - c) ** 2).sum(1)).mean()


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return model.loss(x, y)


def _engine_result(engine: str, model: nn.Module, C: float):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g, dtype=DT), torch.tensor([0, 2, 1, 2, 0])
    params = list(model.parameters())
    grads = per_example_grads(model, _loss, x, y, params)  # one backward per example, before the engine
    e = make_engine(engine)
    e.attach(model)
    try:
        e.begin_step(N)
        return run_engine(e, model, _loss, x, y, params, C), grads, params
    finally:
        e.detach()


@pytest.mark.parametrize("mode", ["index", "slice", "index_select", "negative", "vector", "cube", "summed",
                                  "mask"])
@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_table_indexed_by_the_examples_labels_is_exact(engine, mode):
    torch.manual_seed(0)
    model = CenterLoss(mode)
    got, grads, params = _engine_result(engine, model, 1e6)
    C = float(reference(grads, params, float("inf")).norms.median())  # about half of the examples clipped
    got, grads, params = _engine_result(engine, model, C)
    assert_close_batch(got, reference(grads, params, C), params, rtol=1e-8)


class Positions(nn.Module):
    """A learned position table indexed with positions 0 … T−1 and added to every example's tokens: a broadcast,
    not a lookup by the examples, also at a step whose number of examples happens to be T."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.pos = nn.Parameter(torch.randn(N, D, generator=g, dtype=DT))
        self.proj = nn.Linear(D, D, dtype=DT)
        self.head = nn.Linear(D, K, dtype=DT)

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.proj(x.unsqueeze(1).expand(-1, N, -1)) + self.pos[torch.arange(N)]  # [n, T = N, D]
        return F.cross_entropy(self.head(torch.tanh(h).mean(1)), y)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_positions_that_happen_to_number_the_examples_are_not_taken_for_their_ids(engine):
    got, grads, params = _engine_result(engine, Positions(), 1e6)  # T = N: the step's n
    assert_close_batch(got, reference(grads, params, 1e6), params, rtol=1e-8)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_table_also_used_otherwise_is_still_refused(engine):
    with pytest.raises(PrivacyConfigurationError, match=r"parameter <root>\.centers .*received a gradient, but from no"):
        _engine_result(engine, CenterLoss("penalty"), 1.0)


class Classifier(__import__("pytorch_lightning").LightningModule):
    def __init__(self, shift: int = 0) -> None:
        super().__init__()
        self.net = CenterLoss("index").float()
        self.shift = shift

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.shift:  # each example pulled to the centre of its neighbour's class: examples interact
            h = torch.tanh(self.net.body(x))
            c = self.net.centers[y.roll(self.shift, 0)]
            return (F.cross_entropy(self.net.head(h), y, reduction="none") + ((h - c) ** 2).sum(1)).mean()
        return self.net.loss(x, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(64, D, generator=g), torch.randint(0, K, (64,), generator=g)),
                      batch_size=16)


@pytest.mark.parametrize("engine", ["auto", "vmap"])
def test_a_lightning_module_with_a_center_loss_trains(engine):
    torch.manual_seed(0)
    model = Classifier()
    before = [p.detach().clone() for p in model.parameters()]
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, per_sample=engine)
    quiet_trainer(strategy=dp, max_steps=3).fit(model, _data())
    assert dp.ledger.steps == 3
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_a_lookup_keyed_by_another_examples_label_is_refused():
    torch.manual_seed(0)
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(PrivacyConfigurationError, match="Examples interact"):
        quiet_trainer(strategy=dp, max_steps=3).fit(Classifier(shift=1), _data())
    assert dp.ledger.steps == 0
