"""OpacusHooksEngine (grad_sample/opacus_hooks.py): the torch.func fallback Opacus prepares for a layer without its own
rule (``ft_compute_sample_grad``) is prepared again when the first step's state restore dropped it (zoo28 b05: the
checks' snapshot taken while ``per_sample='auto'`` had another engine attached), without the layer's hooks: prepared
lazily by Opacus in the backward, the copy kept them and torch's backward-hook Function failed under ``vmap``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gs_cases import assert_close_batch, per_example_grads, reference, run_engine
from torch import Tensor, nn

import lightning_dp.grad_sample  # noqa: F401  (registers the engines)
from lightning_dp.grad_sample.base import make_engine


D, K, N = 6, 3, 5
DT = torch.float64


class Prototypes(nn.Module):
    """Learnable prototypes on a module with a layer: Opacus serves the whole module by its torch.func fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D, 4, dtype=DT), nn.Tanh())
        self.protos = nn.Parameter(torch.randn(K, 4, dtype=DT, generator=torch.Generator().manual_seed(2)))

    def forward(self, x: Tensor) -> Tensor:
        return -torch.cdist(self.enc(x), self.protos)


def _loss(model, x, y):
    return F.cross_entropy(model(x), y)


def test_a_fallback_dropped_by_a_state_restore_is_prepared_again_and_exact():
    torch.manual_seed(0)
    model = Prototypes()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g, dtype=DT), torch.randint(0, K, (N,), generator=g)
    params = list(model.parameters())
    ref = reference(per_example_grads(model, _loss, x, y, params), params, 1e6)
    engine = make_engine("opacus_hooks")
    engine.attach(model)
    try:
        assert "ft_compute_sample_grad" in vars(model)  # the root's fallback: protos are read in its own forward
        del model.__dict__["ft_compute_sample_grad"]  # what StateSnapshot.restore does to an attribute added later
        engine.begin_step(N)
        assert_close_batch(run_engine(engine, model, _loss, x, y, params, 1e6), ref, params, rtol=1e-8)
        assert model._backward_hooks and model._forward_hooks  # the hooks set aside while preparing are back
    finally:
        engine.detach()
