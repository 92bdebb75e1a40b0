"""The base record each training position reads, from torch's wrappers alone (record_checks/record_sources.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from lightning_dp import PrivacyConfigurationError
from lightning_dp.data import DistinctRecords
from lightning_dp.record_checks.record_sources import check_sources


def _data(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.randn(n, 2))


def test_wrappers_that_read_each_record_once_pass():
    d, e = _data(), _data()
    check_sources(ConcatDataset([Subset(d, range(5)), Subset(d, range(5, 10)), e]), None)
    check_sources(Subset(ConcatDataset([d, d]), [0, 1, 12, 13]), None)  # positions from both copies, distinct records
    check_sources(ConcatDataset([d, d]), list(range(10)))  # a population that takes the first copy only


@pytest.mark.parametrize("make,population,match", [
    (lambda d: Subset(Subset(d, [3, 4, 5]), [0, 1, 2, 0]), None, "positions 0 and 3 both read record 3"),
    (lambda d: Subset(d, [9, -1]), None, "record 9"),
    (lambda d: ConcatDataset([ConcatDataset([d, Subset(d, [7])]), d]), None, "11 repeated"),
    (lambda d: ConcatDataset([d, d]), [0, 3, 13], "positions 3 and 13"),
    (lambda d: DistinctRecords(ConcatDataset([d, d])), None, "10 repeated"),
    (lambda d: Subset(DistinctRecords(Subset(d, [1, 1])), [0, 1]), None, "record 1"),
])
def test_a_record_read_at_two_positions_is_refused(make, population, match):
    with pytest.raises(PrivacyConfigurationError, match=match):
        check_sources(make(_data()), population)


def test_a_subset_index_outside_its_dataset_is_refused():
    with pytest.raises(PrivacyConfigurationError, match="outside the 10 records"):
        check_sources(Subset(_data(), [0, 10]), None)


def test_an_index_outside_that_is_never_read_is_no_concern():
    check_sources(Subset(_data(), [0, 1, 10]), [0, 1])


class _Flipped(Dataset):
    """An augmented copy of a dataset: record i of ``base``, its features reversed."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x.flip(0), y


def test_a_dataset_beside_an_augmented_copy_of_itself_is_refused():
    base = TensorDataset(torch.randn(8, 3), torch.zeros(8))
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)positions 0 and 8 both read record 0.*augmentation_multip"):
        check_sources(ConcatDataset([base, _Flipped(base)]), None)
    check_sources(_Flipped(base), None)  # a view alone reads each record once
    halves = ConcatDataset([Subset(base, range(4)), _Flipped(Subset(base, range(4, 8)))])
    check_sources(halves, None)  # a copy of the other half: each record once


def test_a_wrapper_of_another_length_is_a_base_of_its_own():
    base = TensorDataset(torch.randn(8, 3), torch.zeros(8))

    class Pairs(_Flipped):
        def __len__(self) -> int:
            return len(self.base) // 2

    check_sources(ConcatDataset([base, Pairs(base)]), None)
