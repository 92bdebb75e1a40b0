"""Features projected onto the training set's own principal directions (record_statistics/decorrelated_columns.py,
rule 11): a PCA of the training rows is refused before any release; raw, standardised, merely centred and privately
standardised data, and a balanced factorial design, are not."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, refused_before_any_release  # noqa: E402

from lightning_dp.accounting import PrivacyLedger  # noqa: E402
from lightning_dp.data import PrivateStandardizer  # noqa: E402
from lightning_dp.record_statistics.decorrelated_columns import decorrelated  # noqa: E402

RNG = np.random.default_rng(0)


def _table(n: int = 256, d: int = 8) -> np.ndarray:
    mixing = RNG.normal(size=(d, d))
    return RNG.normal(size=(n, d)) @ mixing + np.arange(d)


def _pca(x: np.ndarray, k: int) -> np.ndarray:
    centred = x - x.mean(0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    return centred @ vt[:k].T


def test_a_pca_projection_of_the_training_rows_is_found_in_float32_and_float64():
    x = _table()
    assert decorrelated(torch.tensor(_pca(x, 6), dtype=torch.float32))
    assert decorrelated(torch.tensor(_pca(x, 8)))
    t = torch.tensor(x, dtype=torch.float32)  # computed in float32 by torch
    centred = t - t.mean(0)
    assert decorrelated(centred @ torch.linalg.svd(centred, full_matrices=False).Vh[:5].T)


def test_scikit_learns_pca_of_real_data_is_found_and_the_raw_data_is_not():
    datasets = pytest.importorskip("sklearn.datasets")
    pca = pytest.importorskip("sklearn.decomposition").PCA
    for load in (datasets.load_digits, datasets.load_breast_cancer, datasets.load_iris, datasets.load_wine,
                 datasets.load_diabetes):
        x = load().data
        assert not decorrelated(torch.tensor(x, dtype=torch.float32))
        assert decorrelated(torch.tensor(pca(3).fit_transform(x), dtype=torch.float32))
        assert decorrelated(torch.tensor(pca(3).fit_transform(x.astype(np.float32))))


def test_standardised_centred_random_and_privately_standardised_data_are_not_projections():
    x = _table(2000)
    assert not decorrelated(torch.tensor(x))
    assert not decorrelated(torch.tensor((x - x.mean(0)) / x.std(0)))  # standardised: still correlated
    assert not decorrelated(torch.tensor(x - x.mean(0)))  # centred only (the diabetes set is shipped so)
    assert not decorrelated(torch.tensor(RNG.normal(size=(100_000, 4))))  # independent, mean 0 in the population
    scaler = PrivateStandardizer(-40.0, 40.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    white = torch.tensor(_pca(x, 6))
    assert not decorrelated(scaler.fit_transform(white, PrivacyLedger()) * 1.0)  # a DP centring is off by its noise
    design = np.array(np.meshgrid(*[[-1.0, 1.0]] * 4)).reshape(4, -1).T.repeat(8, 0)  # a 2⁴ factorial design
    assert not decorrelated(torch.tensor(design))


def test_pca_projected_training_features_are_refused_before_any_release_and_name_the_fix():
    x = _table(64, 8)
    z = torch.tensor(_pca(x, 4), dtype=torch.float32)
    refused_before_any_release(Classifier(), TensorDataset(z, (z[:, 0] > 0).long()),
                               r"(?s)tensors\[0\] is projected on its own principal directions.*public basis"
                               r".*no DP-PCA")
