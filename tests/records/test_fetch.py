"""Records read exactly as the loader's fetcher reads them (records/fetch.py): a dataset's ``__getitems__`` in the
probe, physical batches and empty batches; end to end, exact where served and refused where the batch-level read
makes examples interact."""

from __future__ import annotations

import copy
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, Dataset, StackDataset, Subset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.records.fetch import fetch, reads_per_index, seeded

sys.path.insert(0, str(Path(__file__).parents[1] / "zoo"))

import zoo  # noqa: E402


class ItemsOnly(Dataset):
    """Reads batches only (``__getitem__`` refuses), as fast array-backed or Hugging Face-style datasets do."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        raise RuntimeError("read through __getitems__")

    def __getitems__(self, indices):
        return [(self.x[i], self.y[i]) for i in indices]


class BatchCentred(ItemsOnly):
    """A ``__getitems__`` that centres each batch on its own mean: the records depend on their batch mates."""

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, indices):
        x = self.x[list(indices)]
        x = x - x.mean(0, keepdim=True)
        return [(x[k], self.y[i]) for k, i in enumerate(indices)]


def test_fetch_is_the_loaders_read():
    data = ItemsOnly(torch.arange(12.0).view(6, 2), torch.arange(6))
    assert [int(y) for _, y in fetch(data, [4, 1])] == [4, 1]
    plain = TensorDataset(torch.arange(6))
    assert fetch(plain, [2, 3]) == [plain[2], plain[3]]


def test_which_datasets_read_per_index():
    plain, items = TensorDataset(torch.arange(6)), ItemsOnly(torch.zeros(6, 2), torch.zeros(6))
    assert reads_per_index(plain) and reads_per_index(Subset(plain, [1, 2]))
    assert reads_per_index(StackDataset(plain, Subset(plain, [0, 1, 2, 3, 4, 5])))
    assert not reads_per_index(items) and not reads_per_index(Subset(items, [1, 2]))
    assert not reads_per_index(StackDataset(plain, items))


def test_seeded_reads_repeat_and_restore_every_generator():
    def draw():
        return float(torch.rand(())), float(np.random.rand()), random.random()

    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    after = draw()
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    with seeded(11):
        first = draw()
    with seeded(11):
        assert draw() == first
    with seeded(12):
        assert all(a != b for a, b in zip(draw(), first))  # each generator is seeded, not merely restored
    assert draw() == after


def _double_data(n: int = zoo.N) -> tuple[torch.Tensor, torch.Tensor]:
    data = zoo.vector_data()
    return data.tensors[0].double(), data.tensors[1]


class _PerIndex(Dataset):
    """Record i as the loader reads it alone (``__getitems__([i])``): the per-example loop's records."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return fetch(self.dataset, [i])[0]


@pytest.mark.parametrize("physical", [None, 2])
def test_a_dataset_read_in_batches_trains_exactly(physical):
    """q = 1, zero noise, SGD(lr=1): the update is −Σ_i clip_C(g_i)/B over the records ``__getitems__`` gives, also
    collated anew in physical batches."""
    torch.manual_seed(0)
    model = zoo.Plain().double()
    dataset = ItemsOnly(*_double_data())
    reference = zoo.reference_update(copy.deepcopy(model), _PerIndex(dataset), default_collate, 0.3, float(zoo.N))
    _, update = zoo.private_step(model, dataset, physical=physical)
    for got, want in zip(update, reference):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_empty_poisson_batches_of_a_dataset_read_in_batches():
    """batch_size=1 of 40 (q = 1/40): most steps are empty; their template is read through ``__getitems__`` too."""
    x = torch.randn(40, 4)
    strategy = DPStrategy(noise_multiplier=1.0, sampler_seed=0)
    quiet_trainer(strategy=strategy, max_steps=12).fit(TinyClassifier(), DataLoader(ItemsOnly(x, (x[:, 0] > 0).long()),
                                                                                    batch_size=1))
    assert strategy.ledger.steps == 12


def test_a_batch_level_read_that_mixes_examples_is_seen_by_the_probe():
    """The probe reads its batches as the loader does, so records that depend on their batch mates are refused
    (read one index at a time they looked independent)."""
    model = zoo.Plain().double()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match="Examples interact"):
        zoo.private_step(model, BatchCentred(*_double_data()))
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


class NoEmptyRead(ItemsOnly):
    def __getitems__(self, indices):
        return list(zip(*(t[torch.tensor(indices)] for t in (self.x, self.y)))) if indices else _fail()


def _fail():
    raise ValueError("torch.stack expects a non-empty TensorList")


def test_a_getitems_that_cannot_read_an_empty_batch_is_refused_naming_the_fix():
    x = torch.randn(40, 4)
    with pytest.raises(PrivacyConfigurationError, match=r"__getitems__\(\[\]\): make it return \[\]"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, sampler_seed=0), max_steps=12).fit(
            TinyClassifier(), DataLoader(NoEmptyRead(x, (x[:, 0] > 0).long()), batch_size=1))
