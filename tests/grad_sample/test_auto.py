"""select_engine picks the fastest engine that supports every trainable layer."""

import pytest
import torch
from torch import nn

import lightning_dp.grad_sample.auto as auto
from lightning_dp.grad_sample.auto import select_engine, unsupported_by_engine
from gs_cases import make_case


@pytest.mark.parametrize("kind", ["cnn", "mlp", "lm"])
def test_supported_models_get_ghost(kind):
    model = make_case(kind, 1)[0]
    assert select_engine(model) == "ghost"
    assert all(v == [] for v in unsupported_by_engine(model).values())


def test_tied_weights_stay_on_ghost():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5))
    model[1].weight = model[0].weight
    assert select_engine(model) == "ghost"


def test_frozen_unsupported_layer_is_fine():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5))
    model[1].weight = model[0].weight
    model[0].weight.requires_grad_(False)
    assert select_engine(model) == "ghost"


def test_root_parameters_stay_on_ghost_and_a_model_no_engine_serves_names_the_layer(monkeypatch):
    """A parameter of a module with children is served by ghost (root_parameters.py: broadcast sites); with
    no engine left for a model, the error names the layer."""
    class RootParam(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x * self.w)

    assert select_engine(RootParam()) == "ghost"
    monkeypatch.setattr(auto, "PREFERENCE", ("ghost", "vmap"))
    with pytest.raises(ValueError, match=r"1 \(BatchNorm1d\): mixes examples"):
        select_engine(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
