"""The releases made on each training dataset (accounting/data_ledgers.py): which data share records, and the union
of two ledgers that counts each fit's releases once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Subset, TensorDataset

from lightning_dp.accounting import forget_data_releases
from lightning_dp.accounting.data_ledgers import (continue_on_data, data_use, per_user, register, releases_on,
                                                  shares_records, union)
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_checks.stored_sources import identifying_rows




class _Array(torch.utils.data.Dataset):
    """A dataset of an array's rows (its memory, not a tensor)."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


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
    assert shares_records(data_use(_Array(x)), data_use(_Array(x[10:20])))
    assert shares_records(data_use(_Array(x)), data_use(TensorDataset(torch.from_numpy(x[:5]))))
    assert not shares_records(data_use(_Array(x[:50])), data_use(_Array(x[50:])))
    assert not shares_records(data_use(_Array(x)), data_use(_Array(x.copy())))


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


def test_releases_per_example_are_charged_per_user_as_groups_and_never_mixed_silently():
    examples, users = _ledger("e", 5, sigma=2.0, q=0.1), _ledger("u", 3)
    users.unit = "user"
    charged = per_user(examples, 3)
    assert charged.unit == "user" and charged.steps == 5
    assert (charged[0].noise_multiplier, charged[0].sample_rate, charged[0].run) == (
        pytest.approx(2.0 / 3), pytest.approx(1 - 0.9 ** 3), "e")
    assert per_user(examples, 1).entries == examples.entries  # one record per user: the plain sum
    with pytest.raises(ValueError, match="cannot hold releases accounted per example"):
        union(users, examples)
    assert union(users, charged).ledger.unit == "user" and union(users, charged).added == 5
    ds = TensorDataset(torch.randn(50, 4))
    continue_on_data(users, data_use(ds), "user")
    fresh = _ledger("f", 0)
    with pytest.raises(PrivacyConfigurationError, match="trained per user"):
        continue_on_data(fresh, data_use(ds))  # per example, after a fit per user on the same records
    groups = _ledger("g", 0)
    assert continue_on_data(groups, data_use(ds), "user", lambda: 3) and groups.steps == 3
    register(data_use(Subset(ds, range(10))), examples)  # an earlier fit per example on some of the records
    assert continue_on_data(groups, data_use(Subset(ds, range(5))), "user", lambda: 3)
    assert groups.unit == "user" and [e.run for e in groups.entries] == ["u", "e"]
    assert groups[-1].noise_multiplier == pytest.approx(2.0 / 3)


# ---- the same records as other bytes: the library's transforms, casts, column orders (record_checks/row_lineage.py)

N, K, BATCH = 250, 5, 20  # folds of 200 records: q = 0.1, 10 steps per epoch


def _folds(n: int = N, k: int = K):
    fold = torch.arange(n) % k
    return [(fold != f).nonzero().squeeze(1) for f in range(k)]


def _fit_fold(features, labels, strategy=None):
    from conftest import TinyClassifier, quiet_trainer
    from torch.utils.data import DataLoader

    from lightning_dp import DPStrategy

    strategy = strategy or DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1)
    trainer.fit(TinyClassifier(), DataLoader(TensorDataset(features, labels), batch_size=BATCH))
    return trainer.strategy.ledger


def _cross_validated(x, features) -> list[int]:
    """The releases of each fold's fit on ``features(fold, x[idx], strategy)`` (labels: the sign of column 0), each
    a fresh model seeded by its fold under a strategy of its own."""
    from lightning_dp import DPStrategy

    y = (x[:, 0] > 0).long()
    steps = []
    for f, idx in enumerate(_folds()):
        torch.manual_seed(f)
        strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
        steps.append(_fit_fold(features(f, x[idx], strategy), y[idx], strategy).steps)
    return steps


def test_cross_validation_on_the_private_standardizers_output_composes():
    """l01: per fold ``PrivateStandardizer(...).fit_transform(X[idx], strategy)`` and a fresh model: every output row
    is new bytes (the fold's noisy mean and scale), yet the record of the input row it came from."""
    from lightning_dp import DPStrategy
    from lightning_dp.data import PrivateStandardizer

    x = torch.randn(N, 4, generator=torch.Generator().manual_seed(0)) * 2
    steps = _cross_validated(x, lambda f, rows, strategy: PrivateStandardizer(-5, 5, 5.0).fit_transform(
        rows, strategy))  # 3 releases charged
    assert steps == [13, 26, 39, 52, 65]  # was [13] * 5: each fold's ledger stood alone
    other = torch.randn(200, 4, generator=torch.Generator().manual_seed(1)) * 2  # other records: its own alone
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    features = PrivateStandardizer(-5, 5, 5.0).fit_transform(other, strategy)[:, torch.tensor([3, 1, 0, 2])]
    assert _fit_fold(features, (other[:, 0] > 0).long(), strategy).steps == 13


def test_cross_validation_on_reordered_columns_composes():
    """l05: each fold's copy of the rows with its columns in another order."""
    x = torch.randn(N, 4, generator=torch.Generator().manual_seed(0))
    steps = _cross_validated(x, lambda f, rows, strategy: rows[:, torch.randperm(
        4, generator=torch.Generator().manual_seed(f + 1))].contiguous())
    assert steps == [10, 20, 30, 40, 50]


def _standardised(x, rows):
    from lightning_dp.data import PrivateStandardizer

    return PrivateStandardizer(-5, 5, 5.0).fit_transform(x[rows], PrivacyLedger())


def test_the_transforms_output_rows_are_the_records_of_their_input_rows():
    from lightning_dp.data import PrivateImputer, PrivateStandardizer

    x = torch.randn(100, 4, dtype=torch.float64)
    first, second = torch.arange(0, 80), torch.arange(20, 100)
    scaler = PrivateStandardizer(-5, 5, 5.0).fit(x, PrivacyLedger())  # fit on all, then transform each fold
    a, b = scaler.transform(x[first]), scaler.transform(x[second])
    assert shares_records(_use(TensorDataset(a)), _use(TensorDataset(b)))
    assert shares_records(_use(TensorDataset(_standardised(x, first))), _use(_Array(x[second].numpy())))
    # wrapped, concatenated, cast after the transform
    assert shares_records(data_use(Subset(TensorDataset(a.float()), range(60, 80))), _use(TensorDataset(b.double())))
    joined = ConcatDataset([TensorDataset(torch.randn(10, 4, dtype=torch.float64)), TensorDataset(a[60:])])
    assert shares_records(data_use(joined), _use(TensorDataset(b)))
    assert shares_records(_use(TensorDataset(torch.cat([a[:10], b[60:]]))), _use(TensorDataset(x)))
    # an imputer's output standardised: the records of the imputer's input
    holes = x.clone()
    holes[::3, 1] = float("nan")
    filled = PrivateImputer(-5, 5, 5.0).fit_transform(holes[first], PrivacyLedger())
    chained = PrivateStandardizer(-5, 5, 5.0).fit_transform(filled, PrivacyLedger())
    assert shares_records(_use(TensorDataset(chained)), _use(TensorDataset(_standardised(x, second))))
    # disjoint halves stay parallel through the transform; other data is not these records
    assert not shares_records(_use(TensorDataset(_standardised(x, torch.arange(50)))),
                              _use(TensorDataset(_standardised(x, torch.arange(50, 100)))))
    assert not shares_records(_use(TensorDataset(a)), _use(TensorDataset(scaler.transform(torch.randn(100, 4)))))


@pytest.mark.parametrize("name", ["digits", "breast_cancer"])
def test_column_orders_compose_and_disjoint_halves_stay_parallel_and_binary_rows_keep_no_sorted_digest(name):
    """The column-order-free digest on sklearn's digits (8×8 images of 17 grey levels) and breast cancer (30
    measurements): halves with disjoint rows share none, with columns reordered or not; one half reordered is
    itself. Binary rows: most rows' sorted values are alike (as many ones), so that digest would merge unrelated
    records en masse; it is not kept, and a reordered copy is not found (an understatement the rule accepts:
    docs/accounting.md)."""
    import sklearn.datasets

    x = torch.from_numpy(getattr(sklearn.datasets, f"load_{name}")().data).float()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    perm = torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(1))
    half_1, half_2 = x[order[: len(x) // 2]], x[order[len(x) // 2:]]
    assert not shares_records(_use(TensorDataset(half_1)), _use(TensorDataset(half_2)))
    assert not shares_records(_use(TensorDataset(half_1)), _use(TensorDataset(half_2[:, perm])))
    assert shares_records(_use(TensorDataset(half_1)), _use(TensorDataset(half_1[:, perm].double())))

    g = torch.Generator().manual_seed(0)
    binary = torch.randint(0, 2, (400, 24), generator=g).float()
    perm = torch.randperm(24, generator=g)
    assert not any(kind[0] == "sorted" for kind in data_use(TensorDataset(binary)).digests)
    assert not shares_records(_use(TensorDataset(binary[:200])), _use(TensorDataset(binary[200:, perm])))
