"""Copies of a record held by different users (record_checks/user_copies.py): data doubled and re-numbered, or some
people's rows appended again under new ids, is refused under Users (one person counted as two users); a user's own
repeats, and two users sharing one or two identical short records, train; DistinctRecords declares the copies."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError, Users
from lightning_dp.data import DistinctRecords

D = 4


def _people(n_people: int = 64, per: int = 4) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``per`` records for each of ``n_people`` people (close to their own centre, far from the others')."""
    g = torch.Generator().manual_seed(0)
    uid = torch.arange(n_people).repeat_interleave(per)
    x = torch.randn(n_people, D, generator=g)[uid] + 0.3 * torch.randn(len(uid), D, generator=g)
    return x, (x[:, 0] > 0).long(), uid.tolist()


def _fit(dataset, ids: list, k: int = 8) -> DPStrategy:
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0,
                          privacy_unit=Users(ids, users_per_batch=k, max_examples_per_user=4))
    quiet_trainer(strategy=strategy, max_steps=2).fit(TinyClassifier(), DataLoader(dataset, batch_size=32))
    return strategy


def test_data_doubled_and_renumbered_is_refused_before_any_release():
    x, y, _ = _people()
    doubled = TensorDataset(torch.cat([x, x]), torch.cat([y, y]))  # pd.concat([df, df]); user = row // 4
    ids = (torch.arange(2 * len(x)) // 4).tolist()
    model = TinyClassifier()
    before = [p.detach().clone() for p in model.parameters()]
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0,
                          privacy_unit=Users(ids, users_per_batch=8, max_examples_per_user=4))
    with pytest.raises(PrivacyConfigurationError, match="Records of different users are identical.*drop_duplicates"):
        quiet_trainer(strategy=strategy, max_steps=2).fit(model, DataLoader(doubled, batch_size=32))
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert strategy.ledger.steps == 0


def test_some_peoples_rows_appended_again_under_new_ids_are_refused():
    x, y, ids = _people()
    half = len(x) // 2
    merged = TensorDataset(torch.cat([x, x[:half]]), torch.cat([y, y[:half]]))
    with pytest.raises(PrivacyConfigurationError, match="Records of different users are identical"):
        _fit(merged, ids + [u + 1000 for u in ids[:half]])


def test_jittered_copies_under_new_ids_are_refused():
    x, y, ids = _people()
    copy = x + 1e-6 * torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    with pytest.raises(PrivacyConfigurationError, match="Records of different users are near-identical"):
        _fit(TensorDataset(torch.cat([x, copy]), torch.cat([y, y])), ids + [u + 1000 for u in ids])


@pytest.mark.parametrize("shared", [1, 2])
def test_users_sharing_one_or_two_identical_short_records_train(shared):
    x, y, ids = _people()
    for k in range(shared):  # the same "ok" message: user 0's record k is also user 1's and user 2's
        x[4 + k], x[8 + k] = x[k], x[k]
        y[4 + k], y[8 + k] = y[k], y[k]
    strategy = _fit(TensorDataset(x, y), ids)
    assert strategy.ledger.steps == 2 and strategy.ledger.unit == "user"


def test_a_users_own_repeats_train_however_many_and_count_once_against_others():
    x, y, ids = _people()
    x[0:4] = x[0]  # user 0 sent one record four times
    y[0:4] = y[0]
    x[4], y[4] = x[0], y[0]  # ...and user 1 sent it once: one coincidence, not four
    assert _fit(TensorDataset(x, y), ids).ledger.steps == 2


def test_declared_distinct_records_train_under_users():
    x, y, _ = _people()
    doubled = DistinctRecords(TensorDataset(torch.cat([x, x]), torch.cat([y, y])))
    assert _fit(doubled, (torch.arange(2 * len(x)) // 4).tolist()).ledger.steps == 2
