"""Statistics of the training data held by the training loader's collator and the datasets' transforms
(record_statistics/loader_statistics.py, judged by record_statistics/data_statistics.py): a collate object or a
``functools.partial`` normalising batches with the training mean and standard deviation, and a ``Normalize``-like
transform module inside a ``Compose``-like list on the dataset, are refused before any release; public constants
(ImageNet's) and a scale of 255 train."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_statistics.loader_statistics import transform_holders  # noqa: E402

X, Y = data(64).tensors
X = X * 3 + 7


def _stacked(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


class Standardise:
    """A collate object scaling each batch by the mean and standard deviation it holds."""

    def __init__(self, mean: Any, std: Any) -> None:
        self.mean, self.std = mean, std

    def __call__(self, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _stacked(rows)
        return (x - self.mean) / self.std, y


def standardise(rows: list, mean: Any, std: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _stacked(rows)
    return (x - mean) / std, y


def standardise_with(mean: Any, std: Any, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    return standardise(rows, mean, std)


class Normalize(nn.Module):
    """Like torchvision's: a module holding its mean and standard deviation as lists."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.mean, self.std = list(mean), list(std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - torch.tensor(self.mean)) / torch.tensor(self.std)


class Compose:
    def __init__(self, transforms: list) -> None:
        self.transforms = transforms

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for t in self.transforms:
            x = t(x)
        return x


class Transformed(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, transform: Any) -> None:
        self.x, self.y, self.transform = x, y, transform

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.x[i]), self.y[i]


def _fit(dataset: Dataset, collate_fn: Any = None) -> Any:
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(dataset, batch_size=16,
                                                                        collate_fn=collate_fn))
    return dp


@pytest.mark.parametrize("make, where", [
    (lambda: (TensorDataset(X, Y), Standardise(X.mean(0), X.std(0))), r"loader\.collate_fn\.mean"),
    (lambda: (TensorDataset(X, Y), functools.partial(standardise, mean=X.mean(0), std=X.std(0))),
     r"loader\.collate_fn\.mean"),
    (lambda: (TensorDataset(X, Y), functools.partial(standardise_with, X.mean(0), X.std(0))),
     r"loader\.collate_fn\.args\[0\]"),
    (lambda: (Transformed(X, Y, Compose([Normalize(X.mean(0).tolist(), X.std(0).tolist())])), None),
     r"dataset Transformed\.transform\.transforms\[0\]\.mean"),
])
def test_a_statistic_held_by_the_collator_or_a_datasets_transform_is_refused_before_any_release(make, where):
    dataset, collate = make()
    model = Classifier()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)without noise before training.*{where} equals the "
                                                         "per-feature mean of the training"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(model, DataLoader(dataset, batch_size=16,
                                                                              collate_fn=collate))
    assert unchanged(before, model)


def test_public_constants_and_a_scale_of_255_train():
    imagenet = Compose([Normalize([0.485, 0.456, 0.406, 0.5], [0.229, 0.224, 0.225, 0.25])])
    assert _fit(Transformed(X, Y, imagenet), Standardise(0.0, 255.0)).ledger.steps == 2
    other, labels = data(64, seed=1).tensors  # other records (mean 7, scale 3 as X): its own ledger
    assert _fit(TensorDataset(other * 3 + 7, labels), functools.partial(standardise, mean=7.0, std=3.0)).ledger.steps == 2


def test_the_walk_stops_at_datasets_tensors_and_torchs_own_objects():
    dataset = Transformed(X, Y, Compose([Normalize([0.5] * 4, [2.0] * 4)]))
    loader = DataLoader(dataset, batch_size=16, collate_fn=Standardise(0.0, 1.0))
    labels = [label for label, _ in transform_holders(loader, [dataset])]
    assert "loader.collate_fn" in labels and "dataset Transformed.transform.transforms[0]" in labels
    assert not any(label.startswith(("loader.sampler", "loader.batch_sampler")) for label in labels)
    assert not any(label.endswith((".x", ".y")) for label in labels)
