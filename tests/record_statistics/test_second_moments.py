"""Second moments of the training features held by the model (record_statistics/second_moments.py): a ZCA or Cholesky
whitening layer, a covariance, correlation or uncentred second moment, its inverse or Cholesky factor — refused
before any release; an orthogonal or identity layer on data standardised publicly, and random square layers, are
not taken for them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, refused_before_any_release  # noqa: E402

from lightning_dp.record_statistics.data_statistics import data_statistics_held  # noqa: E402

_G = torch.Generator().manual_seed(5)
X = torch.randn(512, 4, generator=_G) @ torch.tensor([[2.0, 0.3, 0.0, 0.1], [0.0, 1.0, 0.5, 0.0],
                                                       [0.0, 0.0, 0.7, 0.2], [0.0, 0.0, 0.0, 1.5]]) + 0.5
Y = (X[:, 0] > 0.5).long()
CENTRED = X - X.mean(0)
COV, SECOND = CENTRED.T @ CENTRED / (len(X) - 1), X.T @ X / len(X)
STD = COV.diagonal().sqrt()


def _zca(m: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    s, u = torch.linalg.eigh(m)
    return u @ torch.diag((s + eps).rsqrt()) @ u.T


def _held(value: torch.Tensor) -> list[str]:
    holder = nn.Module()
    holder.register_buffer("W", value)
    return data_statistics_held([("model", holder)], TensorDataset(X, Y))


@pytest.mark.parametrize("value, what", [
    (lambda: _zca(COV), "a whitening matrix of the covariance"),
    (lambda: _zca(SECOND), "a whitening matrix of the uncentred second moment"),
    (lambda: torch.linalg.inv(torch.linalg.cholesky(COV)), "a whitening matrix of the covariance"),  # L⁻¹ x
    (lambda: torch.linalg.inv(torch.linalg.cholesky(COV)).T, "a whitening matrix of the covariance"),  # x @ L⁻ᵀ
    (lambda: torch.linalg.cholesky(SECOND), "a Cholesky factor or square root of the uncentred second moment"),
    (lambda: COV, "the covariance"),
    (lambda: COV / STD[:, None] / STD[None, :], "the correlation"),
    (lambda: torch.linalg.inv(COV), "the inverse of the covariance"),  # a Mahalanobis distance's precision
])
def test_second_moments_of_the_features_are_found(value: Callable[[], torch.Tensor], what: str):
    assert _held(value()) == [f"buffer W holds {what} of the training tensors[0]"]


class Whitened(Classifier):
    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        xc = x - x.mean(0)
        self.register_buffer("W", _zca(xc.T @ xc / len(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x @ self.W)


def test_a_whitening_layer_fitted_on_the_training_data_is_refused_before_any_release():
    model = Whitened(X)
    refused_before_any_release(model, TensorDataset(X, Y), r"(?s)buffer W holds a whitening matrix.*public_state")


def test_orthogonal_identity_and_random_square_layers_on_standardised_data_are_not_whitening():
    """Synthetic standard-normal features: their covariance is the identity to within 1 / sqrt(n), which an
    orthogonal or identity layer reproduces to that sampling error only — far above the tolerance."""
    for n in (256, 4096):
        x = torch.randn(n, 6, generator=torch.Generator().manual_seed(n))
        dataset = TensorDataset(x, (x[:, 0] > 0).long())
        for seed in range(10):
            torch.manual_seed(seed)
            m = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6))
            nn.init.orthogonal_(m[0].weight)
            nn.init.eye_(m[1].weight)
            assert data_statistics_held([("model", m)], dataset) == []
