"""The batches the first check builds from the training population (records/constructed_batches.py): every label value,
one of each pair in each half; labels found without reading a record, under Subset wrappers and as torchvision's
``targets``; none where there are no labels."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from lightning_dp.records.constructed_batches import label_batch, largest_batch


def labelled(n=100, rare=(7, 50, 93)):
    y = torch.arange(n) % 2
    y[list(rare)] = 2
    return TensorDataset(torch.randn(n, 3), y), y


def test_two_of_every_label_one_in_each_half_rarest_first():
    dataset, y = labelled()
    built = label_batch(dataset, list(range(100)), 128, random.Random(0))
    assert built is not None and len(built) == 6
    half, rest = built[:3], built[3:]
    assert sorted(int(y[i]) for i in half) == [0, 1, 2] == sorted(int(y[i]) for i in rest)
    assert int(y[built[0]]) == 2  # the rarest label first
    assert len(set(built)) == 6


def test_only_the_population_and_a_label_seen_once_and_the_cap():
    dataset, y = labelled(rare=(7,))
    population = [i for i in range(100) if i != 50]
    built = label_batch(dataset, population, 128, random.Random(0))
    assert built is not None and 7 in built and set(built) <= set(population) and len(built) == 5
    assert len(label_batch(dataset, population, 2, random.Random(0))) == 1  # one label (the rarest) at most 2 rows


def test_labels_under_a_subset_are_the_loaders_indices():
    dataset, y = labelled(200, rare=(150, 160))
    outer = Subset(dataset, list(range(100, 200)))
    for population in (list(range(100)), range(100)):  # a range (the whole population) is read as one
        built = label_batch(outer, population, 128, random.Random(0))
        assert built is not None and sorted(int(y[100 + i]) for i in built) == [0, 0, 1, 1, 2, 2]


class Images(Dataset):
    """torchvision-like: a list of int targets, records read one by one (never here)."""

    def __init__(self) -> None:
        self.targets = [i % 3 for i in range(30)]

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i):
        raise AssertionError("labels are found without reading a record")


def test_targets_attribute_and_no_labels():
    built = label_batch(Images(), list(range(30)), 128, random.Random(0))
    assert built is not None and len(built) == 6
    floats = TensorDataset(torch.randn(20, 3), torch.randn(20))
    assert label_batch(floats, list(range(20)), 128, random.Random(0)) is None
    one = TensorDataset(torch.randn(20, 3), torch.zeros(20, dtype=torch.long))
    assert label_batch(one, list(range(20)), 128, random.Random(0)) is None


@pytest.mark.parametrize("expected,population,size", [(32, 1000, 55), (32, 40, 40), (1, 100, 5), (0.1, 100, 2)])
def test_the_largest_plausible_batch(expected, population, size):
    assert largest_batch(expected, population) == size
