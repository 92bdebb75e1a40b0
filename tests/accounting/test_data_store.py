"""The data's record in the ledger store (accounting/data_store.py): the releases made on each training dataset,
written at the end of each fit, so that a fold fitted in a new process continues the earlier folds' (l04: one
process per fold stood alone); bounded; ``off`` turns it off; ``forget_data_releases`` clears it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from child_fits import printed, run_child, write_model
from torch.utils.data import TensorDataset

from lightning_dp.accounting import data_ledgers, data_store, forget_data_releases, ledger_store
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.errors import PrivacyConfigurationError

FOLDS = '''
import json, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning_dp import DPStrategy
from lightning_dp.data import PrivateStandardizer
from tiny import Tiny, trainer

steps = []
for fold, seed, standardise in json.loads(sys.argv[1]):
    x = torch.randn(250, 4, generator=torch.Generator().manual_seed(seed))
    idx = (torch.arange(250) % 5 != fold).nonzero().squeeze(1)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    features = PrivateStandardizer(-5, 5, 5.0).fit_transform(x[idx], strategy) if standardise else x[idx]
    loader = DataLoader(TensorDataset(features, (x[idx, 0] > 0).long()), batch_size=20)
    trainer(strategy).fit(Tiny(seed=None, features=4), loader)
    steps.append(strategy.ledger.steps)
print("STEPS " + json.dumps(steps))
'''


def _folds_in_a_new_process(tmp_path: Path, *folds: tuple[int, int, bool], warned: list | None = None) -> list[int]:
    """The releases of each fit of ``folds`` (fold, seed, standardised), run one after the other in one new
    process."""
    write_model(tmp_path)
    done = run_child(tmp_path, FOLDS, json.dumps(folds))
    if warned is not None:
        warned.append(done.stderr)
    return printed(done, "STEPS")


def test_by_default_a_fold_in_a_new_process_is_warned_of_the_earlier_folds_releases(tmp_path, monkeypatch):
    """LIGHTNING_DP_DATA_RECORDS unset ('warn'): fold 1 in a new process reports its own 3 + 10 releases and a
    warning names the earlier process's fit on its records (a run done again must not fail for a model thrown away:
    ``make demo`` twice); that process's fold 0 on other data (seed 1) is not named."""
    monkeypatch.delenv(data_store.ENV, raising=False)
    assert _folds_in_a_new_process(tmp_path, (0, 1, False), (0, 0, False)) == [10, 10]
    warned: list = []
    assert _folds_in_a_new_process(tmp_path, (1, 0, True), warned=warned) == [13]
    assert "1 private fit(s) in earlier processes" in warned[0] and "10 release(s)" in warned[0]
    assert "LIGHTNING_DP_DATA_RECORDS=compose" in warned[0]


def test_an_unknown_data_records_mode_is_refused(monkeypatch):
    monkeypatch.setenv(data_store.ENV, "always")
    with pytest.raises(PrivacyConfigurationError, match="expected 'warn'"):
        data_store.composes()


def test_a_fold_in_a_new_process_continues_the_earlier_folds_releases(tmp_path, monkeypatch):
    """LIGHTNING_DP_DATA_RECORDS=compose: fold 0 in one process (10 releases), fold 1 in another on the private
    standardiser's output of its rows (3 + 10 of its own): 23, not 13. Forgetting other data's releases drops
    nothing; these records', both files."""
    monkeypatch.setenv(data_store.ENV, "compose")
    assert _folds_in_a_new_process(tmp_path, (0, 0, False)) == [10]
    assert _folds_in_a_new_process(tmp_path, (1, 0, True)) == [23]
    store = Path(os.environ[ledger_store.ENV])
    assert len(list(store.glob("*" + data_store.SUFFIX))) == 2
    assert forget_data_releases(TensorDataset(torch.randn(100, 4))) == 0
    x = torch.randn(250, 4, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="understates"):
        assert forget_data_releases(TensorDataset(x[:100])) == 2  # the two folds on these records, on disk too
    assert not list(store.glob("*" + data_store.SUFFIX))


def _registered(rows: torch.Tensor, steps: int) -> PrivacyLedger:
    ledger = PrivacyLedger()
    ledger.run = f"run-{steps}-{len(rows)}"
    ledger.record(1.0, 0.1, steps)
    data_ledgers.register(data_ledgers.data_use(TensorDataset(rows)), ledger)
    data_ledgers.persist(ledger)
    return ledger


def test_the_stored_record_is_bounded_and_compared_on_its_sample(monkeypatch):
    monkeypatch.setattr(data_store, "MAX_DIGESTS", 300)
    x = torch.randn(4000, 6, generator=torch.Generator().manual_seed(0))
    _registered(x[:2000], 7)
    data_ledgers._RELEASES.clear()  # a new process: the store alone holds the fit
    [(use, ledger)] = data_ledgers.stored_uses()
    assert use.sample is not None and 0 < sum(len(d) for d in use.digests.values()) <= 600
    assert ledger.steps == 7
    assert data_ledgers.releases_on(data_ledgers.data_use(TensorDataset(x[1500:3500]))) == [ledger]
    assert data_ledgers.releases_on(data_ledgers.data_use(TensorDataset(x[2000:]))) == []  # disjoint: parallel
    assert data_ledgers.releases_on(data_ledgers.data_use(TensorDataset(torch.randn(2000, 6)))) == []  # other data
    with pytest.warns(UserWarning, match="understates"):
        assert forget_data_releases() == 1
    assert data_ledgers.stored_uses() == []


def test_the_store_keeps_the_newest_records_and_off_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.setattr(data_store, "KEPT", 2)
    for k in range(3):
        _registered(torch.randn(50, 3), k + 1)
    store = Path(os.environ[ledger_store.ENV])
    assert len(list(store.glob("*" + data_store.SUFFIX))) == 2
    monkeypatch.setenv(ledger_store.ENV, "off")
    data_ledgers._RELEASES.clear()
    assert data_ledgers.stored_uses() == []
    _registered(torch.randn(50, 3), 4)
    monkeypatch.setenv(ledger_store.ENV, str(store))
    assert len(list(store.glob("*" + data_store.SUFFIX))) == 2  # nothing written while off
    (store / ("broken" + data_store.SUFFIX)).write_bytes(b"not a record")
    with pytest.warns(RuntimeWarning, match="cannot be read as a data record"):
        assert len(data_ledgers.stored_uses()) == 2
    assert np.all([isinstance(ledger, PrivacyLedger) for _, ledger in data_ledgers.stored_uses()])
