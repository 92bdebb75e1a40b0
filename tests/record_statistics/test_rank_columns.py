"""Columns replaced by a function of their values' ranks among the training records (record_statistics/
rank_columns.py, rule 11): RankGauss, uniform quantile transforms and quantile bins are refused before any release;
raw data, public grids and balanced categories are not."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, refused_before_any_release  # noqa: E402

from lightning_dp.record_statistics.rank_columns import rank_transformed  # noqa: E402

RNG = np.random.default_rng(0)
X = RNG.normal(size=(300, 4)) * [1, 2, 3, 4] + [0, 5, -3, 1]


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _ranks(x: np.ndarray) -> np.ndarray:
    return x.argsort(0).argsort(0) + 1.0  # 1 … N (no ties)


def _ppf(p: np.ndarray) -> np.ndarray:
    return torch.special.ndtri(torch.tensor(p)).numpy()


def erfinv(p: np.ndarray) -> np.ndarray:
    return torch.erfinv(torch.tensor(p)).numpy()


def test_gaussian_rank_scores_are_found():
    n = len(X)
    assert "Gaussian" in rank_transformed(_t(_ppf((_ranks(X) - 0.5) / n)))
    scaled = np.clip((_ranks(X) / n - 0.5) * 2, -1 + 1e-6, 1 - 1e-6)  # Kaggle's RankGauss: erfinv of scaled ranks
    assert "Gaussian" in rank_transformed(_t(erfinv(scaled)))
    assert "Gaussian" in rank_transformed(_t(_ppf((_ranks(X[:, :1]) - 0.5) / n)))  # one column is enough


def test_uniform_ranks_and_equal_count_quantile_bins_of_two_columns_or_more_are_found():
    assert "evenly spaced" in rank_transformed(_t(_ranks(X) / len(X)))  # pandas' rank(pct=True)
    bins = np.stack([np.searchsorted(np.quantile(c, [0.2, 0.4, 0.6, 0.8]), c) for c in X.T], 1).astype(float)
    assert "quantile bins" in rank_transformed(_t(bins))


def test_scikit_learns_quantile_transforms_and_bins_are_found():
    preprocessing = pytest.importorskip("sklearn.preprocessing")
    qt = preprocessing.QuantileTransformer
    assert "Gaussian" in rank_transformed(_t(qt(n_quantiles=len(X), output_distribution="normal").fit_transform(X)))
    assert "evenly spaced" in rank_transformed(_t(qt(n_quantiles=len(X)).fit_transform(X)))
    kbins = preprocessing.KBinsDiscretizer(n_bins=5, strategy="quantile", encode="ordinal")
    assert "quantile bins" in rank_transformed(_t(kbins.fit_transform(X)))


def test_raw_data_public_grids_and_balanced_categories_are_not_rank_transforms():
    datasets = pytest.importorskip("sklearn.datasets")
    for load in (datasets.load_digits, datasets.load_breast_cancer, datasets.load_iris, datasets.load_wine,
                 datasets.load_diabetes):
        assert rank_transformed(_t(load().data)) == ""
    n = 400
    grid = np.linspace(0, 1, n)
    california = np.c_[RNG.lognormal(1, 0.5, 20000), RNG.integers(1, 52, 20000), RNG.normal(5, 2, 20000),
                       RNG.integers(3, 30000, 20000), np.round(RNG.uniform(32, 42, 20000), 2)]
    for x in (X, RNG.random((1000, 5)), california,
              np.c_[grid, grid, RNG.normal(size=n)],  # the same grid twice, laid out in row order
              np.c_[RNG.permutation(grid), RNG.normal(size=n)],  # one shuffled grid: a public one
              np.c_[RNG.permutation(np.arange(n) % 2), RNG.permutation(np.arange(n) % 2)],  # balanced 0/1 columns
              np.c_[np.arange(n) % 4, RNG.normal(size=n)],  # one balanced category
              np.c_[np.arange(n) % 4, np.arange(n) % 4]):  # the same column twice
        assert rank_transformed(_t(x)) == ""


def test_rank_transformed_training_features_are_refused_before_any_release_and_name_the_fix():
    z = _t(_ppf((_ranks(X[:64]) - 0.5) / 64))
    refused_before_any_release(Classifier(), TensorDataset(z, (z[:, 0] > 0).long()),
                               r"(?s)tensors\[0\] is transformed by the ranks of its values.*Gaussian scores"
                               r".*public function.*PrivateStandardizer")
