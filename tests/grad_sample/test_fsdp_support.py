"""What the ghost engine cannot serve once FSDP2 shards a model (grad_sample/fsdp_support.py): a parametrized layer
(weight_norm, spectral_norm, orthogonal) is named once, with DPStrategy as the strategy that serves it."""

from __future__ import annotations

import pytest
from torch import nn
from torch.nn.utils import parametrizations

from lightning_dp.grad_sample.fsdp_support import engine_problems


@pytest.mark.parametrize("parametrize", [parametrizations.spectral_norm, parametrizations.weight_norm])
def test_a_parametrized_layer_is_named_once_with_the_strategy_that_serves_it(parametrize):
    [problem] = engine_problems(nn.Sequential(parametrize(nn.Linear(4, 4)), nn.Linear(4, 2)))
    assert problem.startswith("layer 0 (ParametrizedLinear) has no closed-form per-example rule")
    assert "served by DPStrategy, unsharded" in problem


def test_plain_layers_have_no_problem():
    assert engine_problems(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))) == []
