"""Columns clipped (winsorised) at their own percentiles up front (record_statistics/clipped_columns.py, rule 11)
are refused before any release; clips at public round bounds and unclipped data with natural ties train."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, refused_before_any_release, strategy  # noqa: E402

from lightning_dp.data import PrivateStandardizer  # noqa: E402
from lightning_dp.record_statistics.clipped_columns import clipped, clipped_columns  # noqa: E402

G = torch.Generator().manual_seed(0)
X = torch.randn(256, 4, generator=G)
LABELS = (X[:, 0] > 0).long()


def _winsorised(x: torch.Tensor, p: float) -> torch.Tensor:
    lo, hi = torch.quantile(x, p, 0), torch.quantile(x, 1 - p, 0)
    return x.clamp(lo, hi)


@pytest.mark.parametrize("p", [0.01, 0.05])
def test_columns_clipped_at_their_own_percentiles_are_found(p):
    assert clipped_columns(_winsorised(X, p)) == [0, 1, 2, 3]
    assert clipped_columns(_winsorised(X.double(), p)) == [0, 1, 2, 3]
    assert clipped_columns(torch.maximum(X, torch.quantile(X, p, 0))) == [0, 1, 2, 3]  # one side only
    x = X.numpy()
    assert clipped_columns(torch.tensor(np.clip(x, *np.percentile(x, [100 * p, 100 - 100 * p], 0)))) == [0, 1, 2, 3]
    assert clipped_columns(_winsorised(X[:, 0], p)) == [0]  # one column


def test_a_clip_at_the_mean_plus_or_minus_k_standard_deviations_is_found():
    x = torch.randn(2000, 3, generator=G)
    m, s = x.mean(0), x.std(0)
    assert clipped_columns(x.clamp(m - 2 * s, m + 2 * s)) == [0, 1, 2]


@pytest.mark.parametrize("p", [0.01, 0.05])
def test_features_winsorised_up_front_are_refused_before_any_release(p):
    refused_before_any_release(Classifier(), TensorDataset(_winsorised(X, p), LABELS),
                               r"(?s)the training tensors\[0\] is clipped at its own percentiles or extremes"
                               r".*Clip at public bounds.*PrivateStandardizer")


def test_public_round_clips_and_unclipped_data_with_natural_ties_are_not_found():
    rng = np.random.default_rng(0)
    sensor = np.r_[rng.normal(3.0, 1.0, 240), np.full(16, 4.5)]  # a sensor saturating at a round 4.5
    for x in (X, X.clamp(-3, 3), X.clamp(-1.5, 1.5), (X * 60 + 128).clamp(0, 255), X.clamp(min=0),
              X.clamp(-0.125, 0.8), X.clamp(-1.234, 1.234),  # round at four significant digits
              torch.tensor(rng.integers(0, 17, (256, 4))).float(),  # integer columns: ties everywhere
              torch.tensor(np.round(rng.normal(size=(5000, 3)), 2)),  # two decimals: ties everywhere
              torch.tensor(sensor), torch.tensor(rng.exponential(size=(1000, 4))),
              torch.tensor(rng.random((1000, 4)), dtype=torch.float32)):
        assert clipped_columns(x) == []


def test_scikit_learns_shipped_datasets_are_not_clipped():
    datasets = pytest.importorskip("sklearn.datasets")
    for load in (datasets.load_digits, datasets.load_breast_cancer, datasets.load_diabetes, datasets.load_iris,
                 datasets.load_wine):
        for dtype in (torch.float32, torch.float64):
            assert clipped_columns(torch.tensor(load().data, dtype=dtype)) == []


def test_features_clipped_at_public_bounds_train():
    for x in (X.clamp(-1.5, 1.5), (X * 60 + 128).clamp(0, 255)):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(Classifier(),
                                                            DataLoader(TensorDataset(x, LABELS), batch_size=16))


def test_features_privately_standardised_within_public_bounds_train():
    """PrivateStandardizer clips to its public bounds, then scales by noised statistics: the clipped records tie at
    a bound that is not round, but its rows are the mechanism's and are not judged."""
    dp = strategy()
    scaler = PrivateStandardizer(-1.5, 1.5, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    x = scaler.fit_transform(X, dp).float()
    assert clipped_columns(x) == [0, 1, 2, 3] and clipped(x) == ""
    quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(TensorDataset(x, LABELS), batch_size=16))


def test_a_private_standardizers_output_with_its_columns_reordered_trains():
    """CI (2026-11-30): ``PrivateStandardizer(-5, 5).fit_transform(x)[:, perm]`` — clipped to its public bounds and
    scaled by the noised statistics, so tied at bounds that are no round number, and no longer its output rows once
    the columns are reordered — was refused as clipped at its own percentiles whenever three records fell beyond ±5."""
    from lightning_dp import DPStrategy
    from lightning_dp.data import PrivateStandardizer

    x = torch.randn(200, 4, generator=torch.Generator().manual_seed(1)) * 2
    x = x.clamp(-4.5, 4.5)
    for c in range(4):  # four records beyond the public upper bound in each column (others in each): four ties there
        x[4 * c:4 * c + 4, c] = 9.0
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    features = PrivateStandardizer(-5, 5, 5.0).fit_transform(x, dp)[:, torch.tensor([3, 1, 0, 2])]
    quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(TensorDataset(features, (x[:, 0] > 0).long()),
                                                                         batch_size=16))


def test_columns_winsorised_beside_a_private_standardizers_output_are_refused():
    """A fit charged for a PrivateStandardizer release: its columns (ties at its public bounds scaled by the released
    statistics) pass, a column winsorised at its own percentiles beside them is still refused (the last note: every
    column of such a fit was skipped)."""
    dp = strategy()
    scaler = PrivateStandardizer(-1.5, 1.5, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    released = scaler.fit_transform(X[:, :2], dp).float()
    features = torch.cat([released[:, [1, 0]], _winsorised(X[:, 2:], 0.05)], 1)  # reordered: not its rows
    assert clipped_columns(features) == [0, 1, 2, 3]
    from lightning_dp import PrivacyConfigurationError

    charged = dp.ledger.steps  # the standardiser's releases
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)clipped at its own percentiles.*columns 2, 3\)"):
        quiet_trainer(strategy=dp, max_steps=2).fit(Classifier(), DataLoader(TensorDataset(features, LABELS),
                                                                             batch_size=16))
    assert dp.ledger.steps == charged  # refused before any step's release
