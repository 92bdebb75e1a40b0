"""Features computed by PrivateStandardizer / PrivateImputer train only where their release is charged to the fit's
ledger (record_checks/released_transforms.py): a ledger of their own (zoo28 p03) or another DPStrategy's (p04) is
refused before any release; the Trainer's strategy, or ``charge`` to it, trains."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.accounting import PrivacyLedger
from lightning_dp.data import PrivateImputer, PrivateStandardizer
from lightning_dp.record_checks import released_transforms
from lightning_dp.record_checks.released_transforms import transforms_of

X = torch.randn(256, 4, generator=torch.Generator().manual_seed(0)) * 3 + 10
Y = (X[:, 0] > 10).long()


def _missing() -> torch.Tensor:
    x = X.clone()
    x[::3, 2] = float("nan")
    return x


def _fit(strategy: DPStrategy, features: torch.Tensor) -> int:
    quiet_trainer(strategy=strategy, max_epochs=1).fit(
        TinyClassifier(), DataLoader(TensorDataset(features.float(), Y), batch_size=32))
    return strategy.ledger.steps


def _strategy(**kw) -> DPStrategy:
    return DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, **kw)


def test_a_standardiser_charged_to_a_ledger_of_its_own_is_refused_and_charged_to_the_fit_trains():
    scaler = PrivateStandardizer(0.0, 20.0, 2.0).fit(X, PrivacyLedger())
    with pytest.raises(PrivacyConfigurationError, match=r"scaler\.charge\(strategy\)") as err:
        _fit(_strategy(), scaler.transform(X))
    assert "PrivateStandardizer whose release this fit's ledger was not charged" in str(err.value)
    strategy = _strategy()
    scaler.charge(strategy)
    assert _fit(strategy, scaler.transform(X)) == 3 + 8


def test_a_standardiser_charged_to_another_strategy_is_refused_and_the_trainers_strategy_trains():
    scaler = PrivateStandardizer(0.0, 20.0, 2.0).fit(X, _strategy())  # a notebook's earlier cell
    with pytest.raises(PrivacyConfigurationError, match="not charged"):
        _fit(_strategy(), scaler.transform(X))
    strategy = _strategy()
    assert _fit(strategy, PrivateStandardizer(0.0, 20.0, 2.0).fit_transform(X, strategy)) == 3 + 8


def test_an_imputer_on_a_ledger_of_its_own_is_refused_also_under_a_charged_standardiser():
    x = _missing()
    imputer = PrivateImputer(0.0, 20.0, 2.0).fit(x, PrivacyLedger())
    with pytest.raises(PrivacyConfigurationError, match="PrivateImputer whose release"):
        _fit(_strategy(), imputer.transform(x))
    filled = imputer.transform(x)
    scaler = PrivateStandardizer(0.0, 20.0, 2.0)
    scaled = scaler.fit_transform(filled, _strategy())  # the chain: imputed, then scaled
    strategy = _strategy()
    scaler.charge(strategy)
    with pytest.raises(PrivacyConfigurationError, match="PrivateImputer whose release"):
        _fit(strategy, scaled)
    strategy = _strategy()
    scaler.charge(strategy)
    imputer.charge(strategy)
    assert _fit(strategy, scaled) == 3 + 2 + 8


def test_under_secure_mode_a_seeded_preprocessor_is_refused():
    seeded = PrivateStandardizer(0.0, 20.0, 2.0, generator=torch.Generator().manual_seed(0))
    with pytest.raises(PrivacyConfigurationError, match="secure_mode.*remove the generator"):
        seeded.fit(X, _strategy(secure_mode=True))
    strategy = _strategy(secure_mode=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seeded.fit(X, strategy.ledger)  # the strategy's ledger: no secure_mode to see
    with pytest.raises(PrivacyConfigurationError, match="without a generator"):
        _fit(strategy, seeded.transform(X))


def test_rows_are_found_through_casts_and_the_notes_are_bounded(monkeypatch):
    scaler = PrivateStandardizer(0.0, 20.0, 2.0).fit(X, PrivacyLedger())
    z = scaler.transform(X)
    assert [t.run for t in transforms_of(z.double().numpy())] == [scaler.run]
    assert transforms_of(z[:10] * 2) == [] and transforms_of(X) == []
    monkeypatch.setattr(released_transforms, "MAX_NOTED", 300)
    other = PrivateStandardizer(0.0, 20.0, 2.0).fit(X, PrivacyLedger())
    assert [t.run for t in transforms_of(other.transform(X))] == [other.run]
    assert transforms_of(z) == []  # the oldest call dropped


def test_one_digest_pass_of_a_transform_notes_its_release_and_its_rows_lineage(monkeypatch):
    from lightning_dp.record_checks import row_lineage

    scaler = PrivateStandardizer(0.0, 20.0, 2.0).fit(X, PrivacyLedger())
    digested = []
    for module in (released_transforms, row_lineage):
        real = module.row_digests
        monkeypatch.setattr(module, "row_digests", lambda t, real=real: digested.append(len(t)) or real(t))
    z = scaler.transform(X)
    assert sum(digested) == 4 * len(X)  # the inputs' and the outputs' value and sorted digests, each once
    assert [t.run for t in transforms_of(z)] == [scaler.run]
    assert (row_lineage.value_rows(z.double())[0] == row_lineage.own_rows(X)[0]).all()
