"""A layer's parameter used by its forward and also somewhere no hook sees (a penalty over ``module.parameters()``):
the ghost engine replaces such layers' forwards by ones that fill no ``p.grad``, so any gradient autograd still gives
the parameter is that hidden use, whose share the per-example gradients would silently leave out. Refused exactly,
however small the penalty (the first step's probe compares within a tolerance and missed λ = 1e-4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.grad_sample import make_engine


def _step(penalty: float, through_parameters: bool = True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine = make_engine("ghost")
    engine.attach(model)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    engine.begin_step(6)
    loss = F.cross_entropy(model(x), y)
    if penalty:
        weights = list(model.parameters()) if through_parameters else [model[0].bias]
        loss = loss + penalty * sum(p.pow(2).sum() for p in weights)
    loss.backward()
    params = list(model.parameters())
    try:
        return engine.clip_and_sum(params, 1.0)
    finally:
        engine.detach()


@pytest.mark.parametrize("penalty", [1e-4, 1e-8])
def test_a_penalty_over_module_parameters_is_refused_however_small(penalty):
    with pytest.raises(PrivacyConfigurationError, match="weight_decay"):
        _step(penalty)


def test_a_penalty_on_a_bias_alone_is_refused_too():
    with pytest.raises(PrivacyConfigurationError, match=r"0\.bias|somewhere the per-example engine does not see"):
        _step(1e-4, through_parameters=False)


def test_without_a_penalty_the_step_is_served():
    batch = _step(0.0)
    assert batch.batch_size == 6 and all(bool(torch.isfinite(s).all()) for s in batch.sums.values())
