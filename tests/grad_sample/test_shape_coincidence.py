"""A step whose Poisson batch happens to hold exactly as many examples as a dimension the model computes without them
(T positions, a [T, d] table times a learned scalar: x-transformers' ScaledSinusoidalEmbedding; a learned vector
repeated T times) must not take that dimension for the examples: once a call on a followed tensor was seen without
the examples in dimension 0, the same call (its shapes) is never a broadcast site for the run
(grad_sample/capture/broadcast_sites.py, ``_rowless``). Exact against one backward per example at n ≠ T, then at
n = T, on ghost; before, the second step's per-example gradients of the scalar were silently wrong (their sum right),
so clipping did not bound each example's influence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gs_cases import assert_close_batch, per_example_grads, reference, run_engine
from torch import Tensor, nn

import lightning_dp.grad_sample  # noqa: F401  (registers the engines)
from lightning_dp.grad_sample.base import make_engine

T, D = 6, 4
DT = torch.float64


class FixedTable(nn.Module):
    """A fixed [T, D] table scaled by a learned scalar (``scaled``), or a learned [1, D] vector repeated T times
    (``repeated``), added to every example's T tokens."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        g = torch.Generator().manual_seed(3)
        self.proj = nn.Linear(D, D, dtype=DT)
        self.scale = nn.Parameter(torch.tensor(0.5, dtype=DT))
        self.vector = nn.Parameter(torch.randn(1, D, generator=g, dtype=DT))
        positions = torch.arange(T, dtype=DT)[:, None] * torch.arange(1, D + 1, dtype=DT)[None]
        self.register_buffer("table", torch.sin(positions))
        self.head = nn.Linear(D, 3, dtype=DT)
        (self.vector if mode == "scaled" else self.scale).requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        extra = self.table * self.scale if self.mode == "scaled" else self.vector.repeat(T, 1)  # [T, D]: no examples
        return self.head(torch.tanh(self.proj(x) + extra).mean(1))


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("mode", ["scaled", "repeated"])
def test_a_step_of_exactly_t_examples_after_another_is_exact(mode):
    torch.manual_seed(0)
    model = FixedTable(mode)
    params = [p for p in model.parameters() if p.requires_grad]
    steps = []
    for n in (T - 1, T, T + 1, T):  # the first step's n is not T (the first step's checks see that one)
        g = torch.Generator().manual_seed(n)
        x, y = torch.randn(n, T, D, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
        steps.append((n, x, y, reference(per_example_grads(model, _loss, x, y, params), params, 1e6)))
    engine = make_engine("ghost")
    engine.attach(model)
    try:
        for n, x, y, ref in steps:
            engine.begin_step(n)
            assert_close_batch(run_engine(engine, model, _loss, x, y, params, 1e6), ref, params, rtol=1e-8)
    finally:
        engine.detach()
