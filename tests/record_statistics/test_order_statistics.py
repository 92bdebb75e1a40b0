"""Per-feature order statistics of the training features held by the model (record_statistics/order_statistics.py): a min-max
scaler's buffers, a median and interquartile range, quantile bin edges at any level and interpolation, a range, a
vector of exact training values — refused before any release, in Lightning and in a plain loop; random
initialisations, public constants and integer features' zero buffers are not taken for them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, refused_before_any_release  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_statistics.data_statistics import data_statistics_held  # noqa: E402

_G = torch.Generator().manual_seed(3)
X = torch.randn(256, 6, generator=_G) * torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0, 4.0]) + torch.arange(6.0)
Y = (X[:, 0] > 0).long()


def _held(**buffers: Any) -> list[str]:
    holder = nn.Module()
    for name, value in buffers.items():
        if isinstance(value, torch.Tensor):
            holder.register_buffer(name, value)
        else:
            setattr(holder, name, value)
    return data_statistics_held([("model", holder)], TensorDataset(X, Y))


def _q(p: Any, mode: str = "linear") -> torch.Tensor:
    return torch.quantile(X, torch.as_tensor(p, dtype=X.dtype), dim=0, interpolation=mode)


@pytest.mark.parametrize("value, what", [
    (lambda: X.min(0).values, "per-feature minimum"),
    (lambda: X.amax(0), "per-feature maximum"),
    (lambda: X.median(0).values, "per-feature median"),  # the lower median
    (lambda: _q(0.5), "per-feature median"),
    (lambda: torch.stack([X.min(0).values, X.max(0).values]), "per-feature minimum and maximum"),  # one [2, D] buffer
    *[(lambda m=m, p=p: _q(p, m), "per-feature quantiles")
      for m in ("linear", "lower", "higher", "midpoint", "nearest") for p in (0.1, 0.25, 0.37, 0.99)],
    (lambda: _q(torch.linspace(0, 1, 9)).t().contiguous(), "quantiles (rows at quantile levels)"),  # bin edges
    (lambda: torch.from_numpy(np.percentile(X.double().numpy(), 90, axis=0)), "per-feature quantiles"),  # float64
    (lambda: _q(0.75) - _q(0.25), "difference of two quantiles"),  # RobustScaler's scale
    (lambda: X.max(0).values - X.min(0).values, "difference of two quantiles"),  # the range
    (lambda: _q(0.9, "nearest") - _q(0.1, "nearest"), "difference of two quantiles"),
    (lambda: _q(7 / 8, "lower") - _q(1 / 8, "lower"), "difference of two quantiles"),
    (lambda: X[torch.randperm(256, generator=torch.Generator().manual_seed(1))[:6], torch.arange(6)],
     "exact per-feature values"),  # each entry a value of its own column, from six different records
])
def test_order_statistics_of_the_features_are_found(value: Callable[[], torch.Tensor], what: str):
    found = _held(kept=value())
    assert len(found) == 1 and found[0].startswith("buffer kept holds ") and what in found[0], found
    assert found[0].endswith(" of the training tensors[0]")


def test_a_list_attribute_and_a_declared_name():
    assert _held(edges=X.min(0).values.tolist()) == ["attribute edges holds the per-feature minimum of the training "
                                                     "tensors[0]"]
    holder = nn.Module()
    holder.register_buffer("lo", X.min(0).values)
    assert data_statistics_held([("model", holder)], TensorDataset(X, Y), public=["lo"]) == []


class MinMax(Classifier):
    """A min-max scaler inside the model, fitted on the training features in ``__init__``."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("lo", x.min(0).values)
        self.register_buffer("hi", x.max(0).values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward((x - self.lo) / (self.hi - self.lo))


def test_a_min_max_scaler_in_the_model_is_refused_before_any_release():
    x = X[:, :4]
    model = MinMax(x)
    refused_before_any_release(model, TensorDataset(x, Y), r"(?s)buffer lo holds the per-feature minimum.*"
                                                        r"buffer hi holds the per-feature maximum.*public data.*"
                                                        r"public_state")


class Scale(nn.Module):
    def __init__(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("lo", lo)
        self.register_buffer("hi", hi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.lo) / (self.hi - self.lo)


def test_a_plain_loop_with_a_min_max_scaler_is_refused_when_it_verifies():
    from cases import plain_step

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)  # plain_step's data
    q = torch.quantile(x, torch.tensor([0.25, 0.75]), dim=0)
    with pytest.raises(PrivacyConfigurationError, match=r"buffer 0\.lo holds the per-feature quantiles"):
        plain_step(nn.Sequential(Scale(q[0], q[1]), nn.Linear(4, 2)))


def _initialised(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 6), nn.Linear(6, 6), nn.Linear(6, 6),
                      nn.Linear(6, 2))
    nn.init.kaiming_uniform_(m[0].weight)
    nn.init.xavier_normal_(m[2].weight)
    nn.init.orthogonal_(m[3].weight)
    nn.init.normal_(m[4].weight, std=0.5)
    nn.init.zeros_(m[0].bias)
    nn.init.ones_(m[4].bias)
    return m


def test_random_initialisations_public_constants_and_integer_zeros_are_not_order_statistics():
    dataset = TensorDataset(X, Y)
    for seed in range(20):
        assert data_statistics_held([("model", _initialised(seed))], dataset) == []
    public = Scale(torch.linspace(-4.0, 1.0, 6), torch.linspace(4.0, 16.0, 6))  # a known range per feature
    assert data_statistics_held([("model", public)], dataset) == []
    counts = torch.randint(0, 12, (256, 6), generator=torch.Generator().manual_seed(2)).float()  # integer features
    zeros = Scale(torch.zeros(6), torch.full((6,), 11.0))
    assert data_statistics_held([("model", zeros)], TensorDataset(counts, Y)) == []
    middling = Scale(torch.tensor([3.0, 5.0, 4.0, 6.0, 5.0, 3.0]), torch.full((6,), 11.0))  # integers in range
    assert data_statistics_held([("model", middling)], TensorDataset(counts, Y)) == []
