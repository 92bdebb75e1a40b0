"""Missing values filled from the neighbouring records (record_statistics/neighbour_copies.py, rule 11): forward
and backward fills and linear interpolations are refused before any release; real tables, sorted columns, slowly
varying and quantised sensor series, regular time stamps, constant fills and repeated records pass."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, refused_before_any_release  # noqa: E402
from gapped import with_gaps  # noqa: E402

from lightning_dp.record_statistics.neighbour_copies import neighbour_copies  # noqa: E402

RNG = np.random.default_rng(0)


def _with_gaps(x: np.ndarray, share: float = 0.1, seed: int = 1) -> np.ndarray:
    x = with_gaps(x, share, seed)
    x[0] = np.where(np.isnan(x[0]), 1.0, x[0])  # no record before the first: a public value
    x[-1] = np.where(np.isnan(x[-1]), 1.0, x[-1])
    return x


def _ffill(x: np.ndarray, backward: bool = False) -> np.ndarray:
    x = x[::-1].copy() if backward else x.copy()
    for i in range(1, len(x)):
        x[i] = np.where(np.isnan(x[i]), x[i - 1], x[i])
    return x[::-1].copy() if backward else x


def _interpolate(x: np.ndarray) -> np.ndarray:
    x, index = x.copy(), np.arange(len(x))
    for j in range(x.shape[1]):
        gap = np.isnan(x[:, j])
        x[gap, j] = np.interp(index[gap], index[~gap], x[~gap, j])
    return x


def _table(n: int) -> np.ndarray:
    return RNG.normal(size=(n, 4)) * [1, 10, 0.1, 100] + [0, 5, 1, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, share", [(300, 0.03), (2000, 0.1), (5000, 0.3)])
def test_forward_and_backward_fills_and_interpolations_are_found(dtype, n, share):
    x = _with_gaps(_table(n), share)
    for fill, how in ((_ffill(x), "copy"), (_ffill(x, backward=True), "copy"), (_interpolate(x), "interpolation")):
        assert neighbour_copies(torch.tensor(fill, dtype=dtype)) == [(j, how) for j in range(4)]


def test_a_slowly_varying_sorted_series_holds_no_copy_or_interpolation():
    t = np.arange(5000)
    sensor = np.cumsum(RNG.normal(0, 0.01, 5000)) + 20  # repeats its reading once rounded
    series = np.c_[t * 0.1, t + 1.7e9, sensor, np.round(sensor, 1), np.round(sensor, 2), np.sin(t / 50),
                   1e6 + np.cumsum(RNG.normal(0, 0.01, 5000))]
    for dtype in (torch.float32, torch.float64):
        assert neighbour_copies(torch.tensor(series, dtype=dtype)) == []


def test_real_and_sorted_tables_hold_no_copy_or_interpolation():
    datasets = pytest.importorskip("sklearn.datasets")
    tables = [loader().data for loader in (datasets.load_digits, datasets.load_breast_cancer, datasets.load_iris,
                                          datasets.load_wine, datasets.load_diabetes)]
    n = 20000
    california = np.c_[RNG.lognormal(1, 0.5, n), RNG.integers(1, 52, n), RNG.normal(5, 2, n),
                       RNG.integers(3, 30000, n), np.round(RNG.uniform(32, 42, n), 2),
                       np.round(RNG.lognormal(1, .5, n), 4),
                       np.minimum(np.round(RNG.lognormal(12, 0.5, n)), 500001.0)]  # ties, capped at a maximum
    mixed = np.c_[RNG.integers(0, 5, (2000, 3)), np.eye(4)[RNG.integers(0, 4, 2000)], RNG.poisson(3, (2000, 2)),
                  RNG.normal(size=(2000, 2))]  # ordinal, one-hot, counts, continuous
    tables += [california, *(california[np.argsort(california[:, j], kind="stable")] for j in (2, 5, 6)), mixed,
               mixed[np.lexsort(mixed.T[:3])]]
    for x in tables:
        for dtype in (torch.float32, torch.float64):
            assert neighbour_copies(torch.tensor(x, dtype=dtype)) == []


def test_an_entitys_fixed_features_repeated_over_its_records_are_not_copies():
    """Long format: each patient's height and weight on each of their 1 to 4 visits, the readings varying."""
    visits = RNG.integers(1, 5, 1500)
    fixed = np.repeat(RNG.normal(size=(1500, 2)) * [10, 15] + [170, 70], visits, 0)
    table = np.c_[fixed, RNG.normal(size=(len(fixed), 3))]
    for dtype in (torch.float32, torch.float64):
        assert neighbour_copies(torch.tensor(table, dtype=dtype)) == []


def test_constant_fills_and_repeated_records_are_not_copies():
    x = _with_gaps(_table(2000), 0.3)
    for fill in (0.0, -1.0, -999.0):
        assert neighbour_copies(torch.tensor(np.nan_to_num(x, nan=fill))) == []
    assert neighbour_copies(torch.tensor(np.repeat(_table(500), 2, 0))) == []  # each record twice: rule 9's


@pytest.mark.parametrize("fill, what", [(_ffill, "copies of the previous or next record's cell"),
                                        (_interpolate, "linear interpolations between the records around them")])
def test_a_forward_fill_or_an_interpolation_is_refused_before_any_release(fill, what):
    x = fill(_with_gaps(_table(64), 0.2))
    y = torch.tensor(x[:, 0] > 0).long()
    refused_before_any_release(
        Classifier(), TensorDataset(torch.tensor(x, dtype=torch.float32), y),
        r"(?s)tensors\[0\] is filled where values were missing from the neighbouring records' cells \(" + what
        + r" in column 0.*not a forward/backward fill or an interpolation")


def test_integer_data_under_a_jitter_far_under_the_tolerance_is_no_interpolation():
    """zoo30 r09: digits (integers 0–16) + 1e-7·noise. Runs of zeros became new values each, within tolerance of the
    flat line between their neighbours: not an interpolation (the neighbours differ by less than the window). An
    interpolation is still found where the records around the cell differ (the tests above)."""
    import sklearn.datasets

    digits = torch.tensor(sklearn.datasets.load_digits().data, dtype=torch.float32)
    for seed in (6, 7):
        noise = torch.randn(digits.shape, generator=torch.Generator().manual_seed(seed))
        assert neighbour_copies(digits + 1e-7 * noise) == []
    jittered = torch.tensor(_with_gaps(_table(2000), 0.1)) + 1e-9 * torch.randn(2000, 4, dtype=torch.float64)
    assert neighbour_copies(torch.tensor(_interpolate(jittered.numpy()))) == [(j, "interpolation") for j in range(4)]


def test_digits_with_a_tiny_jitter_train():
    """The r09 fit: a DP fit on digits + 1e-7·noise is not refused."""
    import sklearn.datasets
    from conftest import TinyClassifier, quiet_trainer
    from torch.utils.data import DataLoader

    from lightning_dp import DPStrategy

    data = sklearn.datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = x + 1e-7 * torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=2)
    trainer.fit(TinyClassifier(d_in=64), DataLoader(TensorDataset(x, torch.tensor(data.target) % 2), batch_size=64))
    assert trainer.strategy.ledger.steps == 2
