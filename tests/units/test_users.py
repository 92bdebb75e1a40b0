"""Users (units/users.py): ids that differ only in case or whitespace are warned (one person, two users); a sweep of
user-level fits of fresh modules on the same data composes per user (accounting/data_ledgers.py keeps the unit of
the releases a fresh ledger continues)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError, Users, ledger_epsilon


def _data(n_users: int = 32, per: int = 4) -> tuple[TensorDataset, list[int]]:
    x = torch.randn(n_users * per, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x[:, 0] > 0).long()), torch.arange(n_users).repeat_interleave(per).tolist()


def _strategy(ids: list, unit: bool = True) -> DPStrategy:
    users = Users(ids, users_per_batch=4, max_examples_per_user=4) if unit else None
    return DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, privacy_unit=users)


def test_ids_differing_only_in_case_or_whitespace_are_warned_with_counts_only():
    dataset, ids = _data()
    spelt = [f"User{u}@X.org" if k % 2 else f" user{u}@x.org" for k, u in enumerate(ids)]
    with pytest.warns(UserWarning, match="64 of the 64 user ids differ from another only in letter case") as seen:
        quiet_trainer(strategy=_strategy(spelt), max_steps=1).fit(TinyClassifier(), DataLoader(dataset, batch_size=8))
    assert not any("@" in str(w.message) for w in seen)


def test_distinct_ids_are_not_warned():
    dataset, ids = _data()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_trainer(strategy=_strategy([f"user{u}@x.org" for u in ids]), max_steps=1).fit(
            TinyClassifier(), DataLoader(dataset, batch_size=8))
    assert not [w for w in seen if "letter case" in str(w.message)]


def test_a_sweep_of_user_level_fits_of_fresh_modules_composes_per_user():
    dataset, ids = _data()
    first = _strategy(ids)
    quiet_trainer(strategy=first, max_steps=3).fit(TinyClassifier(), DataLoader(dataset, batch_size=8))
    second = _strategy(ids)  # the next point of the sweep: a fresh module, the same records
    quiet_trainer(strategy=second, max_steps=2).fit(TinyClassifier(), DataLoader(dataset, batch_size=8))
    assert second.ledger.unit == "user" and second.ledger.steps == 5
    assert ledger_epsilon(second.ledger, 1e-5) > ledger_epsilon(first.ledger, 1e-5)


def test_an_example_level_fit_on_records_released_per_user_is_refused():
    dataset, ids = _data()
    quiet_trainer(strategy=_strategy(ids), max_steps=2).fit(TinyClassifier(), DataLoader(dataset, batch_size=8))
    with pytest.raises(PrivacyConfigurationError, match=r"trained per user .* one ε per example cannot count them"):
        quiet_trainer(strategy=_strategy(ids, unit=False), max_steps=1).fit(
            TinyClassifier(), DataLoader(dataset, batch_size=8))
