"""The training records stay as they are (validators/kept_state.py, dataset_token): a step that writes the training
dataset's tensors in place — relabelling records from the batch, accumulating into the features — is refused before
the next release; reading it, and a dataset's own caches of other types, are not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cases import Classifier, data, parameters, strategy, unchanged
from conftest import quiet_trainer
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_dp import PrivacyConfigurationError
from lightning_dp.fingerprints.dataset_tokens import dataset_token


class Relabels(Classifier):
    """Overwrites the labels of the batch's records with the model's predictions (pseudo-labelling in place)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        labels = self.trainer.train_dataloader.dataset.tensors[1]
        labels[: len(batch[1])] = self(batch[0]).argmax(1).detach()
        return super().training_step(batch, batch_idx)


class Caching(Dataset):
    """Memoises each record in a dict (a harmless cache: the record itself never changes)."""

    def __init__(self) -> None:
        self.inner, self.cache = data(64), {}

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if i not in self.cache:
            self.cache[i] = self.inner[i]
        return self.cache[i]


def test_records_written_in_place_are_refused():
    model = Relabels()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"dataset 0 \(TensorDataset\)"):
        quiet_trainer(strategy=strategy(), max_steps=3).fit(model, DataLoader(data(64), batch_size=16))
    assert unchanged(before, model)


def test_a_dataset_caching_its_records_trains():
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=3).fit(Classifier(), DataLoader(Caching(), batch_size=16))
    assert dp.ledger.steps == 3


def test_the_token_follows_wrapped_datasets_and_in_place_writes():
    base = data(16)
    wrapped = Subset(base, list(range(8)))
    before = dataset_token(wrapped)
    assert dataset_token(wrapped) == before
    base.tensors[0][3, 0] += 1.0
    assert dataset_token(wrapped) != before


class ReloadsOtherRecords(Classifier):
    """A new training set every epoch (reload_dataloaders_every_n_epochs): the records as loaded are the baseline."""

    def train_dataloader(self):
        return DataLoader(data(64 + 16 * self.trainer.current_epoch, seed=self.trainer.current_epoch), batch_size=16)


def test_a_loader_rebuilt_on_other_records_trains():
    dp = strategy()
    quiet_trainer(strategy=dp, max_epochs=3, reload_dataloaders_every_n_epochs=1).fit(ReloadsOtherRecords())
    assert dp.ledger.steps >= 12
