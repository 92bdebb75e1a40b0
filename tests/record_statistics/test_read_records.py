"""Statistics applied per item to records the dataset reads from outside itself (record_statistics/read_records.py):
``__getitem__`` reading a module-level global (``X[i]``, a NumPy array too) or a tensor another object holds, scaled
by the training mean and standard deviation a LightningDataModule, the dataset, a helper or a closure keeps (zoo31
c11k), is refused before any release; public constants, another population's statistics and a PrivateStandardizer's
noised values train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_statistics.read_records import records_read  # noqa: E402

X, Y = data(64).tensors
X = X * 3 + 7
X_NP = X.numpy().copy()
OTHER = data(64, seed=1).tensors[0] * 3 + 7  # another population's records, of the training set's size


class Reads(Dataset):
    """Items read from this module's globals (``source(self, i)``: ``X[i]`` by default), scaled by
    ``scale(self, x)`` with what the dataset holds (``held``)."""

    def __init__(self, scale: Callable[[Any, Any], Any], source: Callable[[Any, int], Any] = lambda d, i: X[i],
                 **held: Any) -> None:
        self.scale, self.source = scale, source
        for key, value in held.items():
            setattr(self, key, value)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.as_tensor(self.scale(self, self.source(self, i))).float(), Y[i]


class Stats:
    """A helper object (``self.stats = Stats(mean, std)``), or one holding the records (``Stats(x=...)``)."""

    def __init__(self, mean: Any = None, std: Any = None, x: Any = None) -> None:
        self.mean, self.std, self.x = mean, std, x


def standardiser(mean: Any, std: Any) -> Callable[[Any, Any], Any]:
    """A scaling made by a function: the statistics live in its closure."""
    return lambda d, x: (x - mean) / std


def held_scale(d: Any, x: Any) -> Any:
    return (x - d.mean) / d.std


class Module(pl.LightningDataModule):
    """zoo31 c11k: ``setup`` computes the statistics, the dataset reads them from the datamodule per item."""

    def setup(self, stage: Any = None) -> None:
        self.mean, self.std = X.mean(0), X.std(0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Reads(lambda d, x: (x - d.dm.mean) / d.dm.std, dm=self), batch_size=16)


def _fit(make: Callable[[], Any], dp: Any = None) -> Any:
    dp = dp or strategy()
    made = make()
    trainer = quiet_trainer(strategy=dp, max_steps=2)
    if isinstance(made, pl.LightningDataModule):
        trainer.fit(Classifier(), datamodule=made)
    else:
        trainer.fit(Classifier(), DataLoader(made, batch_size=16))
    return dp


@pytest.mark.parametrize("make, where", [
    (Module, r"datamodule\.mean"),  # c11k
    (lambda: Reads(held_scale, mean=X.mean(0), std=X.std(0)), r"dataset Reads\.mean"),  # on the dataset
    (lambda: Reads(lambda d, x: (x - d.stats.mean) / d.stats.std, stats=Stats(X.mean(0), X.std(0))),
     r"dataset Reads\.stats\.mean"),  # on a helper
    (lambda: Reads(standardiser(X.mean(0), X.std(0))), r"dataset Reads\.scale\.mean"),  # in a closure
    (lambda: Reads(held_scale, lambda d, i: X_NP[i], mean=X_NP.mean(0), std=X_NP.std(0)),
     r"dataset Reads\.mean"),  # X a NumPy global
    (lambda: Reads(held_scale, lambda d, i: d.store.x[i], store=Stats(x=X.clone()), mean=X.mean(0), std=X.std(0)),
     r"dataset Reads\.mean"),  # the records a tensor another object holds
])
def test_statistics_applied_to_records_read_from_a_global_or_another_object_are_refused_before_any_release(
        make, where):
    model = Classifier()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)without noise before training.*{where} equals the "
                                                         r"per-feature mean of the training "):
        made = make()
        trainer = quiet_trainer(strategy=strategy(), max_steps=2)
        if isinstance(made, pl.LightningDataModule):
            trainer.fit(model, datamodule=made)
        else:
            trainer.fit(model, DataLoader(made, batch_size=16))
    assert unchanged(before, model)


def test_public_constants_another_populations_statistics_and_released_ones_train():
    from lightning_dp.data import PrivateStandardizer

    imagenet = torch.tensor([0.485, 0.456, 0.406, 0.5]), torch.tensor([0.229, 0.224, 0.225, 0.25])
    assert _fit(lambda: Reads(held_scale, mean=imagenet[0], std=imagenet[1])).ledger.steps >= 2
    assert _fit(lambda: Reads(held_scale, mean=OTHER.mean(0), std=OTHER.std(0))).ledger.steps >= 2  # not read
    dp = strategy()
    scaler = PrivateStandardizer(-5.0, 20.0, 2.0).fit(X, dp)  # noised and charged to this fit
    assert _fit(lambda: Reads(lambda d, x: d.scaler.transform(x[None])[0], scaler=scaler, mean=scaler.mean,
                              std=scaler.std), dp).ledger.steps >= 2


def test_only_the_arrays_the_items_read_are_record_sources():
    found = {path.rpartition(".")[2]: t for path, t in records_read(Reads(held_scale, lambda d, i: X_NP[i],
                                                                          mean=0.0, std=1.0), [])}
    assert set(found) == {"X_NP", "Y"}  # not X, not OTHER: no item reads them
    assert torch.equal(found["X_NP"], X) and torch.equal(found["Y"], Y)


class Counting(Reads):
    """Items that depend on how often they were read: not judged (its reads write what the next one reads)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads = getattr(self, "reads", 0) + 1
        return X[i] * self.reads, Y[i]


def test_a_dataset_whose_items_change_from_read_to_read_is_not_judged():
    assert records_read(Counting(held_scale), []) == []
