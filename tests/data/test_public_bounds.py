"""The public range of PrivateStandardizer and PrivateImputer compared with the data at fit (data/public_bounds.py):
bounds read off the private columns (min/max, tail percentiles: zoo28 p01, p02) are refused, domain bounds are not
(round ends of a domain that the data reach: sklearn's digits 0–16, a binary column, breast cancer's generous
ranges)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.accounting import PrivacyLedger
from lightning_dp.data import PrivateImputer, PrivateStandardizer
from lightning_dp.data.public_bounds import round_number


def _features(n: int = 256, d: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * 3 + 10


def _with_missing(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[torch.rand(x.shape, generator=torch.Generator().manual_seed(2)) < 0.1] = float("nan")
    return x


def _fit_quietly(make, x):
    """The fit's outcome: "refused", "warned" or "ok" (no warning of the bounds)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            make().fit(x, PrivacyLedger())
        except PrivacyConfigurationError as err:
            assert "domain knowledge" in str(err)
            return "refused"
    return "warned" if any("bound entries" in str(w.message) for w in caught) else "ok"


def test_bounds_read_off_the_columns_min_and_max_are_refused_and_domain_bounds_train():
    x = _features()
    y = (x[:, 0] > 10).long()
    with pytest.raises(PrivacyConfigurationError, match="minimum, a maximum or a tail percentile"):
        PrivateStandardizer(x.min(0).values, x.max(0).values, 5.0).fit(x, DPStrategy(noise_multiplier=1.0))
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)  # the safe twin: a round domain range
    scaler = PrivateStandardizer(0.0, 20.0, 5.0).fit(x, strategy)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1)
    trainer.fit(TinyClassifier(), DataLoader(TensorDataset(scaler.transform(x), y), batch_size=32))
    assert strategy.ledger.steps == 3 + 8


@pytest.mark.parametrize("percentiles, method", [((1, 99), "linear"), ((2.5, 97.5), "linear"), ((0.5, 99.5), "linear"),
                                                 ((5, 95), "nearest"), ((1, 99), "lower")])
def test_imputer_bounds_from_nanpercentile_are_refused(percentiles, method):
    x = _with_missing(_features())
    lo, hi = np.nanpercentile(x.numpy(), percentiles, axis=0, method=method)
    assert _fit_quietly(lambda: PrivateImputer(torch.tensor(lo), torch.tensor(hi), 5.0), x) == "refused"


def test_torch_quantiles_in_float32_and_a_scalar_global_maximum_are_refused():
    x = _features()
    q = torch.quantile(x, torch.tensor([0.02, 0.98]), dim=0)
    assert _fit_quietly(lambda: PrivateStandardizer(q[0], q[1], 5.0), x) == "refused"
    assert _fit_quietly(lambda: PrivateStandardizer(0.0, float(x.max()), 5.0), x) == "refused"


def test_one_column_of_many_read_off_the_data_warns_without_refusing():
    x = _features(d=8)
    lower = torch.zeros(8)
    lower[3] = x[:, 3].min()
    assert _fit_quietly(lambda: PrivateStandardizer(lower, 30.0, 5.0), x) == "warned"


def test_round_domain_ends_the_data_reach_are_not_refused():
    sklearn = pytest.importorskip("sklearn.datasets")
    digits = torch.tensor(sklearn.load_digits().data)
    assert _fit_quietly(lambda: PrivateStandardizer(0.0, 16.0, 5.0), digits) == "ok"
    top = torch.maximum(digits.max(0).values, digits.min(0).values + 1)  # pixel columns that are always 0
    assert _fit_quietly(lambda: PrivateStandardizer(digits.min(0).values, top, 5.0), digits) == "ok"
    cancer = torch.tensor(sklearn.load_breast_cancer().data)
    assert _fit_quietly(lambda: PrivateStandardizer(cancer.min(0).values, cancer.max(0).values, 5.0),
                        cancer) == "refused"
    powers = 10 ** torch.ceil(torch.log10(cancer.max(0).values))  # 0 and a power of ten per feature
    assert _fit_quietly(lambda: PrivateStandardizer(0.0, powers, 5.0), cancer) == "ok"
    binary = torch.cat([cancer, (cancer[:, :1] > 14).double()], 1)
    assert _fit_quietly(lambda: PrivateStandardizer(0.0, torch.cat([powers, torch.ones(1)]), 5.0), binary) == "ok"


def test_round_numbers():
    assert all(round_number(v) for v in (0.0, 1.0, 16.0, 255.0, 2024.0, -40.0, 0.001, 1e6, 2.5, 65535.0,
                                         float(torch.tensor(0.1)), float(torch.tensor(3e-4))))
    assert not any(round_number(v) for v in (6.981, 28.11, 0.012345, 1234567.0, 10.123456))
