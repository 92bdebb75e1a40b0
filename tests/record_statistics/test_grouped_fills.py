"""Missing values filled with a statistic of their class or group (record_statistics/grouped_fills.py, rule 11):
a class-conditional mean (the Titanic notebooks' fill) or a median per level of a feature column is refused before
any release; real tables, integer, ordinal and one-hot columns, a constant per class and a DP mean per class
(PrivateImputer(groups=...)) pass."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, refused_before_any_release, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402
from gapped import with_gaps  # noqa: E402

from lightning_dp.data import PrivateImputer  # noqa: E402
from lightning_dp.record_statistics.grouped_fills import grouped_imputed_columns  # noqa: E402
from lightning_dp.record_statistics.imputed_cells import imputed_columns  # noqa: E402

RNG = np.random.default_rng(0)


def _by_group(x: np.ndarray, g: np.ndarray, statistic=np.nanmean) -> np.ndarray:
    """``X[g == c] = fill(X[g == c], statistic(X[g == c], 0))`` for each group c."""
    x = x.copy()
    for c in np.unique(g):
        rows = g == c
        x[rows] = np.where(np.isnan(x[rows]), statistic(x[rows], 0), x[rows])
    return x


def _labelled(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    return rng.normal(size=(n, 4)) * [1, 10, 0.1, 100] + y[:, None] * [1, 5, 0.2, 30], y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_class_conditional_mean_fill_is_found_where_no_global_fill_is(dtype):
    x, y = _labelled()
    filled = torch.tensor(_by_group(with_gaps(x, 0.15), y), dtype=dtype)
    assert imputed_columns(filled) == []  # one fill per class: none is the column's mean
    found = grouped_imputed_columns(filled, [("labels", torch.tensor(y))])
    assert [(j, how) for j, how, _ in found] == [(j, "mean") for j in range(4)] and found[0][2] == "labels"
    float_target = [("y", torch.tensor(y == 1, dtype=torch.float32)[:, None])]  # a BCE target [N, 1]: two groups
    x2 = _by_group(with_gaps(x, 0.15), (y == 1).astype(int))
    assert len(grouped_imputed_columns(torch.tensor(x2, dtype=dtype), float_target)) == 4


def test_a_mean_or_median_per_level_of_a_feature_column_is_found():
    x, _ = _labelled(600)
    level = RNG.integers(1, 4, 600).astype(float)  # a passenger class: 1, 2, 3
    table = np.c_[level, with_gaps(x, 0.15)]
    mean = grouped_imputed_columns(torch.tensor(_by_group(table, level), dtype=torch.float32))
    assert mean == [(j, "mean", "column 0") for j in (1, 2, 3, 4)]
    median = grouped_imputed_columns(torch.tensor(_by_group(table, level, np.nanmedian), dtype=torch.float32))
    assert median and all(how == "median" and by == "column 0" for _, how, by in median)  # an odd count's: unseen


def test_real_tables_and_synthetic_columns_hold_no_grouped_fill():
    datasets = pytest.importorskip("sklearn.datasets")
    tables = [(b.data, b.target) for b in (loader() for loader in (
        datasets.load_digits, datasets.load_breast_cancer, datasets.load_iris, datasets.load_wine,
        datasets.load_diabetes))]
    n = 20000
    california = np.c_[RNG.lognormal(1, 0.5, n), RNG.integers(1, 52, n), RNG.normal(5, 2, n),
                       RNG.integers(3, 30000, n), np.round(RNG.uniform(32, 42, n), 2),
                       np.round(RNG.lognormal(1, .5, n), 4)]
    mixed = np.c_[RNG.integers(0, 5, (2000, 3)), np.eye(4)[RNG.integers(0, 4, 2000)], RNG.poisson(3, (2000, 2)),
                  RNG.normal(size=(2000, 2))]  # ordinal, one-hot, counts, continuous
    tables += [(california, (california[:, 0] > 3).astype(int)), (mixed, RNG.integers(0, 3, 2000))]
    for x, y in tables:
        for dtype in (torch.float32, torch.float64):
            assert grouped_imputed_columns(torch.tensor(x, dtype=dtype), [("labels", torch.tensor(y))]) == []


def test_a_constant_per_class_and_a_dp_mean_per_class_are_not_grouped_fills():
    x, y = _labelled()
    gaps = with_gaps(x, 0.15)
    labels = [("labels", torch.tensor(y))]
    constant = np.where(np.isnan(gaps), y[:, None] * 2.5 - 1.0, gaps)  # a public value per class
    assert grouped_imputed_columns(torch.tensor(constant, dtype=torch.float32), labels) == []
    imputer = PrivateImputer([-5.0, -40.0, -1.0, -400.0], [8.0, 60.0, 1.0, 500.0], noise_multiplier=1.0, groups=3,
                             generator=torch.Generator().manual_seed(0))
    private = imputer.fit_transform(torch.tensor(gaps), strategy(), torch.tensor(y))
    assert grouped_imputed_columns(private.float(), labels) == []


def test_class_conditional_fills_are_refused_before_any_release_and_a_private_one_trains():
    x, y = _labelled(64, seed=3)
    y2 = (y > 0).astype(int)
    gaps = with_gaps(x, 0.2)
    refused_before_any_release(
        Classifier(), TensorDataset(torch.tensor(_by_group(gaps, y2), dtype=torch.float32), torch.tensor(y2)),
        r"(?s)tensors\[0\] is filled where values were missing with a statistic of its own column.*within groups "
        r"of records \(the mean per group of labels \(tensors\[1\]\) in column 0.*groups=G")
    dp = strategy()
    filled = PrivateImputer(-30.0, 400.0, noise_multiplier=2.0, groups=2).fit_transform(torch.tensor(gaps), dp,
                                                                                         torch.tensor(y2))
    quiet_trainer(strategy=dp, max_steps=2).fit(
        Classifier(), DataLoader(TensorDataset(filled.float(), torch.tensor(y2)), batch_size=16))
    assert dp.ledger.steps == 2 + PrivateImputer.releases
