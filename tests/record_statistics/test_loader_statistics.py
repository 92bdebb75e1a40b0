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


def test_the_walk_reaches_the_users_closures_and_classes_not_the_standard_librarys_or_a_packages_defaults():
    import random

    import numpy as np

    dataset = made_in_a_function(X, Y)
    dataset.rng, dataset.np_rng, dataset.norm = random.Random(0), np.random.RandomState(0), standardiser(0.0, 1.0)
    labels = [label for label, _ in transform_holders(DataLoader(dataset, collate_fn=collate_by(0.0, 1.0)), [dataset])]
    assert {"dataset Local.getitem()", "dataset Local.norm", "loader.collate_fn"} <= set(labels)
    assert not any(label.startswith(("dataset Local.rng.", "dataset Local.np_rng.")) for label in labels)


class Held(Dataset):
    """The most ordinary spelling of standardisation: statistics of ``x`` kept on the dataset, applied per item
    (zoo31 c11*); ``held(x, y)`` returns what it keeps as attributes, ``scale`` applies them."""

    def __init__(self, x: Any, y: Any, held: Any = lambda x, y: {}, scale: Any = lambda d, x: x) -> None:
        self.x, self.y, self.scale = x, y, scale
        for key, value in held(x, y).items():
            setattr(self, key, value)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        x = self.scale(self, self.x[i])
        return torch.as_tensor(x).float(), torch.as_tensor(self.y[i])


class Stats:
    """A helper object the dataset holds (``self.stats = Stats(x)``)."""

    def __init__(self, mean: Any, std: Any) -> None:
        self.mean, self.std = mean, std


def standardiser(mean: Any, std: Any) -> Any:
    """A transform made by a function: the statistics live in its closure."""
    return lambda x: (x - mean) / std


def collate_by(mean: Any, std: Any) -> Any:
    def collate(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        return standardise(rows, mean, std)
    return collate


def made_in_a_function(x: torch.Tensor, y: torch.Tensor) -> Dataset:
    """A dataset class made inside a function: ``__getitem__``'s closure holds the statistics."""
    mean, std = x.mean(0), x.std(0)

    class Local(Held):
        def __getitem__(self, i: int) -> tuple[Any, Any]:
            return (self.x[i] - mean) / std, self.y[i]
    return Local(x, y)


class ClassMean(Held):
    """Statistics kept as class attributes of the dataset's class."""

    mean, std = X.mean(0), X.std(0)


Y_FLOAT = X @ torch.linspace(1, 2, 4) + 5.0


class Regressor(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x)[:, 0], y)


@pytest.mark.parametrize("make, where, what", [
    (lambda: Held(X, Y, lambda x, y: {"lo": x.min(0).values, "hi": x.max(0).values}), r"Held\.lo",
     "per-feature minimum"),  # c11: min-max by hand
    (lambda: Held(X, Y, lambda x, y: {"mu": x.mean(0), "sd": x.std(0)}), r"Held\.mu", "per-feature mean"),  # c11c
    (lambda: Held(X, Y, lambda x, y: {"mean": x.mean(0), "std": x.std(0)}), r"Held\.mean", "per-feature mean"),
    (lambda: Held(X.numpy(), Y.numpy(), lambda x, y: {"mu": x.mean(0), "sd": x.std(0)}), r"Held\.mu",
     "per-feature mean"),  # c11g: NumPy arrays
    (lambda: Held(X, Y_FLOAT, lambda x, y: {"y_mean": y.mean(), "y_std": y.std()}), r"Held\.y_mean",
     "mean of the training y"),  # c11h: a regression's targets
    (lambda: Held(X, Y, lambda x, y: {"lo": torch.quantile(x, 0.01, 0), "hi": torch.quantile(x, 0.99, 0)}),
     r"Held\.lo", "per-feature quantiles"),  # c11j: winsorising at the training percentiles
    (lambda: Held(X, Y, lambda x, y: {"norm": standardiser(x.mean(0), x.std(0))}), r"Held\.norm\.mean",
     "per-feature mean"),  # a transform's closure
    (lambda: made_in_a_function(X, Y), r"Local\.getitem\(\)\S*\.mean", "per-feature mean"),  # __getitem__'s closure
    (lambda: ClassMean(X, Y), r"ClassMean\.mean", "per-feature mean"),  # the dataset class's attribute
])
def test_a_training_statistic_the_dataset_holds_for_its_items_is_refused_naming_it_and_the_fix(make, where, what):
    dataset = make()
    model = Regressor() if torch.as_tensor(dataset.y).is_floating_point() else Classifier()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)without noise before training.*dataset {where} "
                                                         rf"(equals|holds) the {what}") as err:
        quiet_trainer(strategy=strategy(), max_steps=2).fit(model, DataLoader(dataset, batch_size=16))
    assert unchanged(before, model)
    assert "PrivateStandardizer" in str(err.value) and "public constants" in str(err.value)


@pytest.mark.parametrize("make, where, what", [
    (lambda: Held(X, Y_FLOAT, lambda x, y: {"y_mean": float(y.mean()), "y_std": float(y.std())}), r"Held\.y_mean",
     "mean of the training y"),  # as Python floats
    (lambda: Held(X, Y, lambda x, y: {"stats": Stats(x.mean(0), x.std(0))}), r"Held\.stats\.mean",
     "per-feature mean"),  # a nested helper object
])
def test_held_statistics_refused_before_stay_refused_python_floats_and_a_nested_helper(make, where, what):
    """Spellings refused before the dataset's own tensors were candidates (neither is a tensor of the dataset)."""
    test_a_training_statistic_the_dataset_holds_for_its_items_is_refused_naming_it_and_the_fix(make, where, what)


class Scaler:
    """An object whose bound method is the collate_fn."""

    def __init__(self, mean: Any, std: Any) -> None:
        self.mean, self.std = mean, std

    def collate(self, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        return standardise(rows, self.mean, self.std)


@pytest.mark.parametrize("collate", [lambda: collate_by(X.mean(0), X.std(0)),
                                     lambda: Scaler(X.mean(0), X.std(0)).collate])
def test_a_statistic_in_a_collate_fns_closure_or_its_methods_object_is_refused(collate):
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)collate_fn\.mean equals the per-feature mean"):
        _fit(TensorDataset(X, Y), collate())


def test_a_dataset_holding_public_constants_public_statistics_its_length_a_label_map_or_released_ones_trains():
    from lightning_dp.data import PrivateStandardizer

    public = data(256, seed=1).tensors[0] * 3 + 7  # another population's records
    imagenet = torch.tensor([0.485, 0.456, 0.406, 0.5]), torch.tensor([0.229, 0.224, 0.225, 0.25])
    for held in (lambda x, y: {"mean": 0.5, "std": 0.25}, lambda x, y: {"mean": imagenet[0], "std": imagenet[1]},
                 lambda x, y: {"mean": public.mean(0), "std": public.std(0), "n": len(x), "size": torch.tensor(64)},
                 lambda x, y: {"classes": ["no", "yes"], "index": {"no": 0, "yes": 1}},
                 lambda x, y: {"mean": torch.tensor(0.5), "ends": torch.tensor([0.25, 0.75])}):  # held: no records
        dataset = Held(X, Y, held, lambda d, x: (x - getattr(d, "mean", 0.0)) / getattr(d, "std", 1.0))
        assert _fit(dataset).ledger.steps >= 2  # trained (the ledger continues the earlier fits' releases)
    dp = strategy()
    scaler = PrivateStandardizer(-5.0, 20.0, 2.0).fit(X, dp)  # noised and charged to this fit
    dataset = Held(X, Y, lambda x, y: {"scaler": scaler, "mean": scaler.mean, "std": scaler.std},
                   lambda d, x: d.scaler.transform(x[None])[0])
    quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(dataset, batch_size=16))
    assert dp.ledger.steps >= 2
