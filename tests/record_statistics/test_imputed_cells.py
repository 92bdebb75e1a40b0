"""Missing values filled with the mean or median of their column (record_statistics/imputed_cells.py, rule 11):
refused before any release; constant and public fills, raw real data and the mode of a 0/1 column are not taken
for an imputed statistic."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, refused_before_any_release, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402
from gapped import with_gaps  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dp.record_statistics.imputed_cells import imputed_columns  # noqa: E402

RNG = np.random.default_rng(0)


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _table(n: int = 256, d: int = 4) -> np.ndarray:
    return RNG.normal(size=(n, d)) * np.arange(1, d + 1) + np.arange(d) * 3


@pytest.mark.parametrize("n", [256, 257])
def test_mean_and_median_imputation_are_found(n):
    x = with_gaps(_table(n))
    mean = np.where(np.isnan(x), np.nanmean(x, 0), x)
    median = np.where(np.isnan(x), np.nanmedian(x, 0), x)
    assert imputed_columns(_t(mean)) == [(j, "mean") for j in range(4)]
    even = [j for j in range(4) if (~np.isnan(x[:, j])).sum() % 2 == 0]  # an odd count's median is a data value
    assert even and imputed_columns(_t(median)) == [(j, "median") for j in even]


def test_a_fill_in_the_middle_of_the_column_is_not_a_median_unless_halfway_between_its_neighbours():
    """A constant (or a DP mean) near the middle of the data has as many values below as above by chance."""
    x = with_gaps(RNG.normal(size=(64, 40)))
    middle = np.where(np.isnan(x), np.nanmedian(x, 0) + 1e-3, x)  # within the middle gap of most columns
    assert imputed_columns(_t(middle)) == []
    lower = torch.tensor(x)  # torch's lower median: an observed value, in the middle
    assert imputed_columns(torch.where(torch.isnan(lower), lower.nanmedian(0).values, lower)) == []


def test_a_mean_off_the_grid_of_an_integer_or_decimal_column_is_found():
    counts = with_gaps(RNG.integers(0, 20, (300, 3)).astype(float))
    tenths = with_gaps(np.round(RNG.normal(5, 1, (300, 3)), 1))
    for x in (counts, tenths):
        assert len(imputed_columns(_t(np.where(np.isnan(x), np.nanmean(x, 0), x)))) == 3


@pytest.mark.parametrize("fill", [0.0, -1.0, 3.7, -999.0])
def test_a_constant_or_public_fill_is_not_an_imputed_statistic(fill):
    for x in (with_gaps(_table()), with_gaps(RNG.integers(0, 20, (300, 3)).astype(float))):
        assert imputed_columns(_t(np.where(np.isnan(x), fill, x))) == []


def test_the_median_of_a_binary_or_three_level_column_is_not_taken_for_imputation():
    """The mode of a 0/1 column is its median: a median fill lands on the column's own values and says nothing."""
    binary = RNG.integers(0, 2, (400, 3)).astype(float)
    levels = np.repeat(np.array([[0.0], [1.0], [2.0]]), 100, 0) * np.ones((1, 3))  # a three-level column, 1 in middle
    for x in (binary, levels, with_gaps(binary), with_gaps(levels)):
        filled = np.where(np.isnan(x), np.nanmedian(x, 0), x)
        assert imputed_columns(_t(filled)) == []


def test_zero_inflated_symmetric_data_is_not_taken_for_a_median():
    x = np.where(RNG.random((1001, 6)) < 0.05, 0.0, RNG.normal(size=(1001, 6)))
    x[:, :3] = np.concatenate([x[:500, :3], -x[:500, :3], np.zeros((1, 3))])  # exactly as many below 0 as above
    assert imputed_columns(_t(x)) == []


def test_raw_real_and_random_data_hold_no_imputed_statistic():
    datasets = pytest.importorskip("sklearn.datasets")
    tables = [loader().data for loader in (datasets.load_digits, datasets.load_breast_cancer, datasets.load_iris,
                                          datasets.load_wine, datasets.load_diabetes)]
    california = np.c_[RNG.lognormal(1, 0.5, 20000), RNG.integers(1, 52, 20000), RNG.normal(5, 2, 20000),
                       RNG.integers(3, 30000, 20000), np.round(RNG.uniform(32, 42, 20000), 2)]
    for x in (*tables, california, RNG.random((1000, 5)), RNG.normal(size=(20000, 8))):
        assert imputed_columns(_t(x)) == []
        assert imputed_columns(torch.tensor(x, dtype=torch.float64)) == []


def test_mean_imputed_training_features_are_refused_before_any_release_and_a_constant_fill_trains():
    x = with_gaps(np.c_[RNG.normal(size=(64, 1)), _table(64, 3)])
    y = torch.tensor(np.nan_to_num(x[:, 0]) > 0).long()
    refused_before_any_release(
        Classifier(), TensorDataset(_t(np.where(np.isnan(x), np.nanmean(x, 0), x)), y),
        r"(?s)tensors\[0\] is filled where values were missing with a statistic of its own column.*\(the mean\)"
        r".*a constant or a public value.*PrivateImputer")
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(TensorDataset(_t(np.nan_to_num(x)), y),
                                                                        batch_size=16))
    assert dp.ledger.steps == 2


def test_a_mean_fill_in_a_column_with_many_exact_zeros_is_found():
    x = with_gaps(np.where(RNG.random((400, 3)) < 0.2, 0.0, RNG.normal(2, 1, (400, 3))))
    assert len(imputed_columns(_t(np.where(np.isnan(x), np.nanmean(x, 0), x)))) == 3


def test_a_half_between_balanced_zeros_and_ones_is_not_an_imputed_mean():
    """Two annotators' vote share: ½ is the mean and median of equally many 0s and 1s by chance, not by a fill."""
    votes = np.r_[np.zeros(24), np.ones(24), np.full(16, 0.5)]
    for column in (votes, np.r_[np.zeros(30), np.ones(10), np.full(8, 0.25)]):
        assert imputed_columns(_t(np.c_[RNG.normal(size=(len(column), 3)), column])) == []


def test_a_mean_rounded_far_below_its_standard_error_is_found_and_a_hand_written_value_near_the_mean_is_not():
    """round(mean, 5) is the mean to a step 1/100 of its standard error or less; 0.49, 3.1 or 5001 near the mean
    have fewer digits and lie within half a step of it by chance only."""
    rng = np.random.default_rng(1)  # its own data: the module's generator's state depends on the tests run before
    x = with_gaps(rng.normal(size=(2000, 4)) * [1, 10, 0.1, 1000] + [0.5, 3, 0.2, 5000])
    mean = np.nanmean(x, 0)
    assert all(round(m * 1e5) % 10 for m in mean[:3])  # five decimals each (0.19840 would read as round(mean, 4))
    for dtype in (torch.float32, torch.float64):
        found = imputed_columns(torch.tensor(np.where(np.isnan(x), np.round(mean, 5), x), dtype=dtype))
        assert [j for j, _ in found] == [0, 1, 2, 3] and ("rounded mean" in dict(found).values())
        if dtype == torch.float64:  # in float32, 16 ulps of the largest magnitude cover the rounding: "mean"
            assert {how for _, how in found} == {"rounded mean"}
        coarse = [round(float(mean[0]), 1), round(float(mean[1]), 1), round(float(mean[2]), 2), round(float(mean[3]))]
        for public in ([0.49, 3.1, 0.21, 5010.0], [0.5, 3.0, 0.2, 5000.0], coarse):  # steps above error / 100
            assert imputed_columns(torch.tensor(np.where(np.isnan(x), public, x), dtype=dtype)) == []
