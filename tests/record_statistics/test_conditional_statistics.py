"""Class-conditional statistics of the training features held by the model (record_statistics/conditional_statistics.py):
class means stacked into a prototype head, per-class standard deviations or variances, one class's mean alone —
refused before any release; prototypes drawn at random or from other data are not."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import refused_before_any_release  # noqa: E402

from lightning_dp.record_statistics.data_statistics import data_statistics_held  # noqa: E402

_G = torch.Generator().manual_seed(11)
X = torch.randn(300, 5, generator=_G)
Y = torch.randint(0, 3, (300,), generator=_G)


def _per_class(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor = X, y: torch.Tensor = Y) -> torch.Tensor:
    return torch.stack([f(x[y == c]) for c in range(3)])


@pytest.mark.parametrize("value, what", [
    (lambda: _per_class(lambda r: r.mean(0)), "a row of the class means"),
    (lambda: _per_class(lambda r: r.mean(0)).T.contiguous(), "a row of the class means"),  # [D, K]
    (lambda: X[Y == 2].mean(0), "a row of the class means"),  # one class's mean kept alone
    (lambda: _per_class(lambda r: r.std(0)), "a row of the per-class standard deviations"),
    (lambda: _per_class(lambda r: r.var(0, correction=0)), "a row of the per-class variances"),
])
def test_class_conditional_statistics_are_found(value: Callable[[], torch.Tensor], what: str):
    holder = nn.Module()
    holder.proto = nn.Parameter(value())
    assert data_statistics_held([("model", holder)], TensorDataset(X, Y)) == [
        f"parameter proto holds {what} of the training tensors[0]"]


class Prototypes(nn.Module):
    """A nearest-class-mean head: logits are minus the squared distances to the prototypes."""

    def __init__(self, prototypes: torch.Tensor) -> None:
        super().__init__()
        self.proto = nn.Parameter(prototypes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -((x[:, None, :] - self.proto[None]) ** 2).sum(-1)


def test_a_prototype_head_initialised_from_the_class_means_is_refused_before_any_release():
    import pytorch_lightning as pl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.head = Prototypes(_per_class(lambda r: r.mean(0)))

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.head(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Model()
    refused_before_any_release(model, TensorDataset(X, Y), r"(?s)parameter head\.proto holds a row of the class means")


def test_random_prototypes_and_class_means_of_other_data_are_not_found():
    dataset = TensorDataset(X, Y)
    other = torch.randn(300, 5, generator=torch.Generator().manual_seed(12))
    for prototypes in (torch.randn(3, 5), _per_class(lambda r: r.mean(0), other), torch.zeros(3, 5)):
        assert data_statistics_held([("model", Prototypes(prototypes))], dataset) == []
