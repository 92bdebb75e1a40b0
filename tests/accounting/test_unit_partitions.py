"""Per-user fits continuing each other (accounting/unit_partitions.py, data_ledgers.continue_on_data): an earlier
fit's releases count per ITS units, so a later fit's user is charged (σ/k, 1 − (1 − q)^k), k its earlier units held
whole plus twice those held in part (their term replaced, not removed); k = 1 for the same partition (zoo30 u01:
users = records, then real users; u02: users regrouped)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.accounting import data_ledgers, data_store, ledger_store
from lightning_dp.accounting.data_ledgers import continue_on_data, data_use
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.accounting.unit_partitions import UserGroups, covering
from lightning_dp.record_checks.stored_sources import identifying_rows
from lightning_dp.units import Users

N = 64
X = torch.randn(N, 4, generator=torch.Generator().manual_seed(0))
ROWS = list(range(N))


def _use(dataset):
    return data_use(dataset, None, {k: np.unique(d) for k, d in identifying_rows(dataset).items()})


def _fit(ids, run: str, dataset=None, sigma: float = 1.0, q: float = 0.05, steps: int = 8) -> PrivacyLedger:
    """A fit per user on ``dataset`` (default: a fresh copy of ``X``, found by content) with ``ids``: continues what
    earlier fits made on its records, then makes ``steps`` releases of its own."""
    dataset = TensorDataset(X.clone()) if dataset is None else dataset
    ledger = PrivacyLedger()
    ledger.run, ledger.unit = run, "user"
    continue_on_data(ledger, _use(dataset), "user", UserGroups(Users(ids, users_per_batch=1), dataset))
    ledger.record(sigma, q, steps)
    return ledger


def _charged(ledger: PrivacyLedger, run: str) -> list[tuple[float, float, int]]:
    return [(round(e.noise_multiplier, 4), round(e.sample_rate, 4), e.steps) for e in ledger.entries if e.run == run]


def _group(q: float, k: int) -> float:
    return round(1 - (1 - q) ** k, 4)


def test_users_that_were_records_are_charged_by_group_size():
    """u01: A's users are its records (σ = 1 at q = 1/32), B's users hold 4 records each: B counts A's releases at
    (σ/4, 1 − (1 − q)^4), as after a fit per example — not 1:1."""
    _fit(ROWS, "a", q=1 / 32, steps=32)
    b = _fit([r // 4 for r in ROWS], "b")
    assert _charged(b, "a") == [(0.25, _group(1 / 32, 4), 32)]
    assert _charged(b, "b") == [(1.0, 0.05, 8)]


def test_regrouped_users_are_charged_by_the_earlier_users_each_covers():
    """u02: A's users are rows // 4, B's (rows + 2) // 4: each of B's users holds half of two of A's (k = 2 × 2)."""
    _fit([r // 4 for r in ROWS], "a")
    b = _fit([(r + 2) // 4 for r in ROWS], "b")
    assert _charged(b, "a") == [(0.25, _group(0.05, 4), 8)]


def test_the_same_partition_is_not_charged_a_finer_one_as_a_replaced_term_and_a_coarser_one_by_k():
    _fit([r // 4 for r in ROWS], "a")
    same = _fit([f"user-{r // 4}" for r in ROWS], "same")  # other ids, the same grouping: k = 1
    assert _charged(same, "a") == [(1.0, 0.05, 8)]
    data_ledgers._clear()
    _fit([r // 8 for r in ROWS], "a")
    finer = _fit([r // 4 for r in ROWS], "finer")  # half of one of A's users: its term replaced, up to 2C (k = 2)
    assert _charged(finer, "a") == [(0.5, _group(0.05, 2), 8)]
    data_ledgers._clear()
    _fit([r // 2 for r in ROWS], "a")
    coarser = _fit([r // 8 for r in ROWS], "coarser")  # 8 records (m = 8) over 4 of A's users: k = 4, not m
    assert _charged(coarser, "a") == [(0.25, _group(0.05, 4), 8)]


def test_one_dataset_by_index_when_its_rows_identify_no_record():
    """Rows of few distinct values (no digests): the same dataset object, matched by index under Subset folds."""
    rows = torch.randint(0, 2, (N, 2), generator=torch.Generator().manual_seed(1)).float()
    ds = TensorDataset(rows)
    first, second = Subset(ds, range(0, 48)), Subset(ds, range(16, 64))
    assert not identifying_rows(ds)
    _fit([p // 2 for p in range(48)], "a", dataset=first)
    b = _fit([(16 + p) // 4 for p in range(48)], "b", dataset=second)  # records 16.. by 4: two of A's pairs whole
    assert _charged(b, "a") == [(0.5, _group(0.05, 2), 8)]


def test_covering_is_none_without_an_earlier_partition():
    groups = UserGroups(Users([r // 4 for r in ROWS], users_per_batch=1), TensorDataset(X))
    assert groups() == 4 and covering(None, groups.partition()) is None
    assert covering(groups.partition(), groups.partition()) == 1


def test_the_store_keeps_the_partition_and_an_old_record_is_charged_the_worst_case(monkeypatch):
    """A new process (the ledger store alone): the partition written with the data record (version 2) charges as
    in one process; a version 1 record (no partition) of a fit per user is charged the worst case, 2m, with a
    warning."""
    monkeypatch.setenv(data_store.ENV, "compose")
    a = _fit([r // 4 for r in ROWS], "a")
    data_ledgers.persist(a)
    data_ledgers._RELEASES.clear()
    same = _fit([r // 4 for r in ROWS], "same")
    coarser = _fit([r // 8 for r in ROWS], "coarser")
    assert _charged(same, "a") == [(1.0, 0.05, 8)] and _charged(coarser, "a") == [(0.5, _group(0.05, 2), 8)]
    data_ledgers._clear()
    where = ledger_store.directory()
    where.mkdir(parents=True, exist_ok=True)
    old = PrivacyLedger()
    old.run, old.unit = "old", "user"
    old.record(1.0, 0.05, 8)
    digests = _use(TensorDataset(X.clone())).digests
    torch.save({"version": 1, "created": time.time(), "ledger": old.state_dict(), "limit": -1,
                "digests": [[repr(kind), torch.from_numpy(d.view(np.int64))] for kind, d in digests.items()]},
               Path(where) / f"data-old{data_store.SUFFIX}")
    with pytest.warns(UserWarning, match="left no record of how their records fall into their users"):
        after = _fit([r // 4 for r in ROWS], "after")
    assert _charged(after, "old") == [(0.125, _group(0.05, 8), 8)]  # 2m: each record part of another user


def _fit_model(module, ids=None):
    unit = {} if ids is None else {"privacy_unit": Users(ids, users_per_batch=8)}
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, **unit)
    x = X.clone()
    quiet_trainer(strategy=strategy, max_epochs=1).fit(module, DataLoader(TensorDataset(x, (x[:, 0] > 0).long()),
                                                                         batch_size=16))
    return strategy.ledger


def test_two_fits_per_user_continue_by_k():
    """u01 through DPStrategy: per-user fits with users = records, then with 4 records per user."""
    a = _fit_model(TinyClassifier(), ROWS)
    b = _fit_model(TinyClassifier(), [r // 4 for r in ROWS])
    [entry] = [e for e in b.entries if e.run == a.run]
    assert (entry.noise_multiplier, entry.sample_rate) == (pytest.approx(0.25),
                                                           pytest.approx(1 - (1 - a[0].sample_rate) ** 4))


def test_a_model_trained_apart_and_kept_is_warned_of(recwarn):
    """u03: a fit inside apart() stands apart from the data's record; a later fit on the records while that model
    is alive warns that its ε leaves those releases out. The model trained inside, trained again outside, continues
    its own record: no warning."""
    kept = TinyClassifier()
    with data_ledgers.apart():
        inside = _fit_model(kept)
    with pytest.warns(UserWarning, match="trained inside lightning_dp.accounting.data_ledgers.apart"):
        fresh = _fit_model(TinyClassifier())
    assert all(e.run != inside.run for e in fresh.entries)  # still apart: not counted, but said
    recwarn.clear()
    again = _fit_model(kept)
    assert any(e.run == inside.run for e in again.entries)
    assert not [w for w in recwarn if "apart()" in str(w.message)]


@pytest.mark.parametrize("sigma,q", [(0.8, 0.05), (1.0, 0.3), (2.0, 0.1), (4.0, 0.6)])
def test_a_replaced_term_is_within_the_charge_of_two_units(sigma, q):
    """A user holding part of an earlier user replaces that user's clipped term (two vectors of norm ≤ C, up to 2C
    apart; the pair below is the worst): the Rényi divergence of the subsampled releases, both directions, is within
    the ledger's charge for k = 2, (σ/2, 1 − (1 − q)²), and beyond the plain (σ, q) a 1:1 charge would give."""
    from scipy import integrate
    from scipy.stats import norm

    from lightning_dp.accounting.sgm_rdp import sampled_gaussian_rdp

    orders = [1.5, 2.0, 4.0, 8.0]

    def log_mixture(x: float, shift: float) -> float:
        return float(np.logaddexp(np.log1p(-q) + norm.logpdf(x, 0, sigma), np.log(q) + norm.logpdf(x, shift, sigma)))

    for order, charged, plain in zip(orders, sampled_gaussian_rdp(sigma / 2, _group(q, 2), orders),
                                     sampled_gaussian_rdp(sigma, q, orders)):
        value = integrate.quad(lambda x: np.exp(order * log_mixture(x, 1) + (1 - order) * log_mixture(x, -1)),
                               -12 * sigma - 2, 12 * sigma + 2, limit=400, points=[-1, 0, 1])[0]
        divergence = np.log(value) / (order - 1)  # the pair is symmetric: the other direction is the same
        assert plain < divergence <= charged
