"""A training loader rebuilt each epoch stores the same records as the fit's first (record_checks/stored_records.py):
records recomputed from the training set at a reload are refused before the next release; the same data rebuilt,
reordered, re-read from files or augmented at each fetch trains."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.loaders import record_set  # noqa: E402
from lightning_dp.record_checks.stored_records import changed_records, stored_records  # noqa: E402

X, Y = data(64).tensors


class Rebuilt(pl.LightningDataModule):
    """``train_dataloader`` returns ``build(datamodule)`` at every reload."""

    def __init__(self, build: Callable[["Rebuilt"], DataLoader]) -> None:
        super().__init__()
        self.build = build

    def train_dataloader(self) -> DataLoader:
        return self.build(self)


def _fit(datamodule: pl.LightningDataModule, steps: int = 12) -> Any:
    torch.set_num_threads(1)
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=steps, reload_dataloaders_every_n_epochs=1).fit(Classifier(),
                                                                                          datamodule=datamodule)
    return dp


def _loss_scaled(dm: Rebuilt) -> DataLoader:
    """A "temperature curriculum": every input scaled by the model's mean loss over the whole training set."""
    x = X.clone()
    if dm.trainer.current_epoch > 0:
        with torch.no_grad():
            x = x * float(torch.nn.functional.cross_entropy(dm.trainer.lightning_module(x), Y))
    return DataLoader(TensorDataset(x, Y.clone()), batch_size=16)


def _scaled_in_place(dm: Rebuilt) -> DataLoader:
    """The same dataset each epoch, its inputs rescaled in place by the training set's mean loss."""
    x, y = dm.train_set.tensors
    if dm.trainer.current_epoch > 0:
        with torch.no_grad():
            x.mul_(float(torch.nn.functional.cross_entropy(dm.trainer.lightning_module(x), y)))
    return DataLoader(dm.train_set, batch_size=16)


def test_records_recomputed_from_the_training_set_at_a_reload_are_refused_before_the_next_release():
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, max_steps=12, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)same records with other stored values.*tensors\[0\]"
                                                         r".*Keep the stored records fixed.*__getitem__"):
        trainer.fit(Classifier(), datamodule=Rebuilt(_loss_scaled))
    assert dp.ledger.steps == 4  # the first epoch's releases only


def test_the_same_dataset_written_in_place_at_a_reload_is_refused():
    dm = Rebuilt(_scaled_in_place)
    dm.train_set = TensorDataset(X.clone(), Y.clone())
    with pytest.raises(PrivacyConfigurationError, match=r"same records with other stored values \(tensors\[0\]"):
        _fit(dm)


class _Augmented(Dataset):
    """Stored records fixed; a random flip and noise at each fetch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        sign = 1.0 if float(torch.rand(())) < 0.5 else -1.0
        return sign * self.x[i] + 0.01 * torch.randn(4), self.y[i]


class _Files(Dataset):
    """Records in .npy files: the dataset holds their paths (listed in any order) and reads each at its fetch."""

    def __init__(self, folder: Path, shuffle: int) -> None:
        paths = sorted(str(p) for p in folder.glob("*.npy"))
        self.paths = [paths[i] for i in np.random.default_rng(shuffle).permutation(len(paths))]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        row = np.load(self.paths[i])
        return torch.from_numpy(row[:4]).float(), int(row[4])


def _permuted(dm: Rebuilt) -> DataLoader:
    order = torch.randperm(64, generator=torch.Generator().manual_seed(dm.trainer.current_epoch))
    return DataLoader(TensorDataset(X[order], Y[order]), batch_size=16 + dm.trainer.current_epoch)


@pytest.mark.parametrize("build", [
    lambda dm: DataLoader(TensorDataset(X.clone(), Y.clone()), batch_size=8 * (1 + dm.trainer.current_epoch % 2)),
    _permuted,
    lambda dm: DataLoader(_Augmented(X.clone(), Y.clone()), batch_size=16),
    lambda dm: DataLoader(Subset(TensorDataset(X.clone(), Y.clone()), list(range(48))), batch_size=16),
    lambda dm: DataLoader(_Files(dm.folder, dm.trainer.current_epoch), batch_size=16),
], ids=["fresh-equal-tensors", "same-records-reordered", "augmented-per-fetch", "subset", "file-paths"])
def test_the_same_records_rebuilt_at_every_reload_train(build, tmp_path):
    for i in range(64):
        np.save(tmp_path / f"{i:03d}.npy", np.concatenate([X[i].numpy(), [float(Y[i])]]))
    dm = Rebuilt(build)
    dm.folder = tmp_path
    assert _fit(dm).ledger.steps == 12


def _stored(dataset: Any) -> Any:
    return stored_records(dataset, record_set(dataset)[1])


def test_an_order_of_positions_shuffled_by_set_epoch_is_not_a_stored_record():
    held = _Augmented(X.numpy().copy(), Y.tolist())
    held.order = list(range(64))
    before = _stored(held)
    random_order = torch.randperm(64, generator=torch.Generator().manual_seed(2)).tolist()
    held.order[:] = random_order  # which record each fetch reads: public (an epoch-seeded shuffle), not records
    assert changed_records(before, _stored(held)) == []
    held.y[3] = 1 - held.y[3]
    assert changed_records(before, _stored(held)) == ["dataset 0 (_Augmented).y"]


def test_what_is_compared():
    before = _stored(TensorDataset(X, Y))
    order = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    assert changed_records(before, _stored(TensorDataset(X[order], Y[order]))) == []  # the same records
    assert changed_records(before, _stored(TensorDataset(X[order], Y))) == [".tensors[0]"]  # re-paired records
    other = Y.clone()
    other[3] = 1 - other[3]
    assert changed_records(before, _stored(TensorDataset(X, other))) == [".tensors[1]"]
    # a subset's records: reordering the rows under it changes which records it holds
    inner = list(range(0, 64, 2))
    assert changed_records(stored_records(Subset(TensorDataset(X, Y), inner), inner),
                           stored_records(Subset(TensorDataset(X[order], Y[order]), inner), inner)) != []
    # NumPy arrays and lists of labels held by a dataset; a memory-mapped array is read lazily: not compared
    held = _Augmented(X.numpy().copy(), Y.tolist())
    again = _Augmented(X.numpy() * 2, Y.tolist())
    assert changed_records(_stored(held), _stored(again)) == ["dataset 0 (_Augmented).x"]
    again.y = [1 - v for v in again.y]
    assert changed_records(_stored(held), _stored(again)) == ["dataset 0 (_Augmented).x", "dataset 0 (_Augmented).y"]
