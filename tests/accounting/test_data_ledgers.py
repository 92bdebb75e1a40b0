"""The releases made on each training dataset (accounting/data_ledgers.py): which data share records, and the union
of two ledgers that counts each fit's releases once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Subset, TensorDataset

from lightning_dp.accounting import forget_data_releases
from lightning_dp.accounting.data_ledgers import continue_on_data, data_use, releases_on, shares_records, union
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.record_checks.stored_sources import identifying_rows


pytestmark = pytest.mark.usefixtures("data_record")


def _ledger(run: str, steps: int, sigma: float = 1.0, q: float = 0.1) -> PrivacyLedger:
    ledger = PrivacyLedger()
    ledger.run = run
    ledger.record(sigma, q, steps)
    return ledger


def _use(dataset, rows=None):
    digests = {k: np.unique(d if rows is None else d[sorted(rows)]) for k, d in identifying_rows(dataset).items()}
    return data_use(dataset, rows, digests)


def test_the_union_adds_other_fits_and_never_a_fit_twice():
    a, b = _ledger("a", 6), _ledger("b", 6)
    assert union(a, b).ledger.steps == 12  # two fits on the same records: both count
    longer = _ledger("a", 6)
    longer.run = "c"
    longer.record(1.0, 0.1, 6)  # a's 6 releases, then a second fit's 6 (the same module refit)
    assert union(a, longer).ledger.steps == 12 and union(longer, a).added == 0
    ab = union(a, b).ledger
    assert union(ab, longer).ledger.steps == 18  # a once, b, c
    assert union(union(b, longer).ledger, ab).ledger.steps == 18  # in any order


def test_one_dataset_at_overlapping_indices_shares_records_and_disjoint_parts_do_not():
    ds = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
    fold_1, fold_2 = data_use(Subset(ds, range(0, 80))), data_use(Subset(ds, range(20, 100)))
    assert shares_records(fold_1, fold_2)
    assert not shares_records(data_use(Subset(ds, range(0, 50))), data_use(Subset(ds, range(50, 100))))  # parallel
    assert shares_records(data_use(ConcatDataset([Subset(ds, range(0, 10)), TensorDataset(torch.randn(5, 4))])),
                          data_use(Subset(ds, [5])))


def test_copies_of_the_rows_in_new_memory_share_records_by_content():
    x, y = torch.randn(100, 4), torch.randint(0, 2, (100,))
    idx_1, idx_2 = torch.arange(0, 80), torch.arange(20, 100)
    assert shares_records(_use(TensorDataset(x[idx_1], y[idx_1])), _use(TensorDataset(x[idx_2], y[idx_2])))
    assert not shares_records(_use(TensorDataset(x[:50], y[:50])), _use(TensorDataset(x[50:].clone(), y[50:])))
    other = torch.randn(100, 4)
    other[:2] = x[:2]  # 2 % of the rows equal: natural, not the same population
    assert not shares_records(_use(TensorDataset(x, y)), _use(TensorDataset(other, y)))


def test_views_of_one_buffer_share_records_by_memory():
    x = np.random.default_rng(0).integers(0, 3, size=(100, 2)).astype(np.float32)  # rows repeat: no digests

    class Rows(torch.utils.data.Dataset):
        def __init__(self, data):
            self.data = data

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            return self.data[i]

    assert shares_records(data_use(Rows(x)), data_use(Rows(x[10:20])))
    assert shares_records(data_use(Rows(x)), data_use(TensorDataset(torch.from_numpy(x[:5]))))
    assert not shares_records(data_use(Rows(x[:50])), data_use(Rows(x[50:])))
    assert not shares_records(data_use(Rows(x)), data_use(Rows(x.copy())))


def test_a_fit_continues_the_releases_on_its_records_once_and_forgetting_warns():
    ds = TensorDataset(torch.randn(100, 4))
    first, second = _ledger("a", 6), _ledger("b", 0)
    assert continue_on_data(first, data_use(Subset(ds, range(80)))) is None
    note = continue_on_data(second, data_use(Subset(ds, range(20, 100))))
    assert second.steps == 6 and "continues the releases already made on this data" in note
    second.record(1.0, 0.1, 6)
    assert continue_on_data(second, data_use(Subset(ds, range(20, 100)))) is None and second.steps == 12
    assert len(releases_on(data_use(ds))) == 2
    with pytest.warns(UserWarning, match="understates"):
        assert forget_data_releases(ds) == 2
    assert releases_on(data_use(ds)) == []
