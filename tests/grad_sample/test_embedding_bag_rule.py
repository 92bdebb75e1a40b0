"""``nn.EmbeddingBag`` on a 1-D packed input with ``offsets`` (grad_sample/embedding_bag_rule.py): each bag is an
example; the ghost engine's norms and clipped sums (and squares) and the vmap engine's materialised gradients equal a
per-example loop (one backward per bag, float64), with tokens repeated within a bag, an empty bag, padding_idx,
per_sample_weights, include_last_offset, the layer called twice, and its table tied to the output layer."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gs_cases import reference
from lightning_dp.grad_sample import make_engine
from lightning_dp.grad_sample.rules import rule_for

V, D, K = 11, 4, 3
BAGS = [[1, 2, 2, 5], [], [3, 3, 3], [0, 4, 0, 7, 4], [9], [2, 0, 6, 6, 1, 2]]  # 0: the padding token where set
"""Bags with a token repeated in them (2, 3, 4, 6), an empty one, and padding tokens (0)."""
LABELS = torch.tensor([0, 1, 2, 1, 0, 2])
ENGINES = ["ghost", "vmap"]


class BagClassifier(nn.Module):
    """The torchtext tutorial's model: EmbeddingBag on the packed tokens and offsets, then a Linear head; ``twice``:
    a second bag of each example's tokens reversed through the same layer; ``tied``: a Linear layer whose weight is the
    table (weight tying) reads it too."""

    def __init__(self, mode: str = "mean", padding_idx: Optional[int] = None, include_last_offset: bool = False,
                 weighted: bool = False, twice: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode=mode, padding_idx=padding_idx, include_last_offset=include_last_offset)
        self.head = nn.Linear(D, K)
        self.weighted, self.twice, self.tied = weighted, twice, tied
        if tied:
            self.vocab = nn.Linear(D, V, bias=False)
            self.vocab.weight = self.bag.weight

    def embed(self, bags: list[list[int]]) -> Tensor:
        flat = torch.tensor([t for b in bags for t in b], dtype=torch.long)
        lengths = torch.tensor([len(b) for b in bags])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        if not self.bag.include_last_offset:
            offsets = offsets[:-1]
        weights = (0.5 + 0.1 * flat).to(self.head.weight.dtype) if self.weighted else None
        return self.bag(flat, offsets, per_sample_weights=weights)

    def forward(self, bags: list[list[int]]) -> Tensor:
        h = torch.tanh(self.embed(bags))
        if self.twice:
            h = h + torch.tanh(self.embed([b[::-1] for b in bags]))
        out = self.head(h)
        if self.tied:
            out = out + 0.1 * self.vocab(h)[:, :K]
        return out


def loss_of(model: BagClassifier, bags: list[list[int]], y: Tensor) -> Tensor:
    return F.cross_entropy(model(bags), y)


def per_example(model: BagClassifier) -> list[list[Tensor]]:
    """Example b's gradients: its bag alone, one backward each."""
    params = list(model.parameters())
    return [list(torch.autograd.grad(loss_of(model, [b], LABELS[i:i + 1]), params)) for i, b in enumerate(BAGS)]


def assert_engine_matches(engine_name: str, model: BagClassifier, scale: bool = False) -> None:
    torch.manual_seed(0)
    model.double()
    params = list(model.parameters())
    grads = per_example(model)
    s = {p: 0.5 + torch.rand_like(p) for p in params} if scale else None
    if s is not None:
        grads = [[g * s[p] for g, p in zip(gi, params)] for gi in grads]
    engine = make_engine(engine_name)
    engine.attach(model)
    try:
        norms = reference(grads, params, float("inf")).norms
        for C in (float(norms.sort().values[2]), 1e12):  # half the examples clipped; none
            want = reference(grads, params, C)
            engine.begin_step(len(BAGS))
            model.zero_grad()
            loss_of(model, BAGS, LABELS).backward()
            got = engine.clip_and_sum(params, C, s, with_squares=True)
            torch.testing.assert_close(got.norms.double(), want.norms, rtol=1e-10, atol=1e-12)
            for p in params:
                torch.testing.assert_close(got.sums[p], want.sums[p], rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(got.square_sums[p], want.square_sums[p], rtol=1e-10, atol=1e-12)
    finally:
        engine.detach()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("config", [
    dict(mode="mean"),
    dict(mode="sum"),
    dict(mode="sum", weighted=True),
    dict(mode="mean", padding_idx=0),
    dict(mode="sum", weighted=True, padding_idx=0),
    dict(mode="mean", include_last_offset=True),
    dict(mode="sum", padding_idx=0, include_last_offset=True, twice=True),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_packed_bags_match_the_per_example_loop(engine, config):
    assert_engine_matches(engine, BagClassifier(**config))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_table_tied_to_the_output_matches(engine):
    """The table read by the bag and by the head: the ghost engine's cross terms take the bag's lookup form."""
    assert_engine_matches(engine, BagClassifier(mode="mean", padding_idx=0, tied=True))


def test_scale_then_privatize_matches():
    assert_engine_matches("ghost", BagClassifier(mode="sum", weighted=True, padding_idx=0), scale=True)


def test_rule_serves_sum_and_mean_only():
    assert rule_for(nn.EmbeddingBag(V, D, mode="mean")).name == "embedding_bag"
    assert rule_for(nn.EmbeddingBag(V, D, mode="sum")).name == "embedding_bag"
    assert rule_for(nn.EmbeddingBag(V, D, mode="max")) is None  # replayed per example on 2-D calls


def test_opacus_hooks_excludes_embedding_bag():
    """Opacus' EmbeddingBag rule counts a token repeated within a bag once and ignores padding_idx and
    per_sample_weights: the engine leaves the layer to ghost/vmap."""
    problems = make_engine("opacus_hooks").unsupported_layers(BagClassifier())
    assert any(p.startswith("bag (EmbeddingBag)") for p in problems)
