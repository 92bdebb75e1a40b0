"""Composition across fits on the same records (zoo26 e06): fresh models trained on one dataset in one process — k-fold
cross-validation, the k models ensembled — continue the releases already made on those records
(accounting/data_ledgers.py), each fit's once."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, Subset, TensorDataset

import lightning_dp._strategy_glue as strategy_module
from lightning_dp import DPStrategy, PrivacyBudget
from lightning_dp.accounting import epsilon, ledger_epsilon


DELTA = 1e-5
N, K, BATCH = 250, 5, 20  # folds of 200 records: q = 0.1, 10 steps per epoch


def _data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _fit(module, loader, strategy=None, **kwargs):
    strategy = strategy or DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, **kwargs)
    trainer.fit(module, loader)
    return trainer


def _folds():
    fold = torch.arange(N) % K
    return [(fold != k).nonzero().squeeze(1) for k in range(K)]


@pytest.fixture
def said(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(strategy_module, "rank_zero_info", lambda message, *a, **k: lines.append(message))
    return lines


@pytest.mark.parametrize("copies", [False, True], ids=["subset", "copied-rows"])
def test_five_fold_cross_validation_reports_the_composed_epsilon(said, copies):
    ds = _data()
    steps, budget = [], PrivacyBudget(delta=DELTA)
    for k, idx in enumerate(_folds()):
        torch.manual_seed(k)
        fold = TensorDataset(*(t[idx] for t in ds.tensors)) if copies else Subset(ds, idx.tolist())
        trainer = _fit(TinyClassifier(), DataLoader(fold, batch_size=BATCH),
                       callbacks=[budget] if k == K - 1 else [])
        steps.append(trainer.strategy.ledger.steps)
    assert steps == [10, 20, 30, 40, 50]  # was [10] * 5: each fold's ledger restarted at zero
    # every record is in 4 of the 5 models; the ledger counts all 5 fits (an upper bound: a record's own loss
    # is the composition of the 4 fits it was in, each subsampled at q = 0.1)
    composed = epsilon(1.0, 0.1, 50, DELTA)
    assert ledger_epsilon(trainer.strategy.ledger, DELTA) == pytest.approx(composed, rel=1e-9)
    assert budget.epsilon == pytest.approx(composed, rel=1e-9)
    assert budget.epsilon > 1.7 * epsilon(1.0, 0.1, 10, DELTA)  # one fold's ε: what each reported before
    assert sum("continues the releases already made on this data" in line for line in said) == K - 1


def test_a_fresh_model_on_other_data_does_not_compose(said):
    _fit(TinyClassifier(), DataLoader(_data(0), batch_size=BATCH))
    other = _fit(TinyClassifier(), DataLoader(_data(1), batch_size=BATCH))
    assert other.strategy.ledger.steps == 12  # one epoch of 250 records at 20 a batch: its own releases only
    assert not any("this data" in line for line in said)


def test_disjoint_parts_of_one_dataset_compose_in_parallel():
    ds = _data()
    first = _fit(TinyClassifier(), DataLoader(Subset(ds, range(0, 100)), batch_size=BATCH))
    second = _fit(TinyClassifier(), DataLoader(Subset(ds, range(100, 200)), batch_size=BATCH))
    assert first.strategy.ledger.steps == second.strategy.ledger.steps == 5  # no record in both: ε = the max
    third = _fit(TinyClassifier(), DataLoader(Subset(ds, range(50, 150)), batch_size=BATCH))
    assert third.strategy.ledger.steps == 15  # reads records of both


def test_the_same_module_refit_composes_once(said):
    ds = _data()
    module = TinyClassifier()
    _fit(module, DataLoader(ds, batch_size=BATCH))
    again = _fit(module, DataLoader(ds, batch_size=BATCH))
    assert again.strategy.ledger.steps == 24  # the module's record continued, the data's not added again
    assert not any("this data" in line for line in said)
    fresh = _fit(TinyClassifier(), DataLoader(ds, batch_size=BATCH))
    assert fresh.strategy.ledger.steps == 36  # both fits of the module, once each, then its own


def test_a_target_counts_what_earlier_fits_on_the_records_spent():
    ds = _data()
    _fit(TinyClassifier(), DataLoader(Subset(ds, range(200)), batch_size=BATCH),
         DPStrategy(noise_multiplier=2.0, max_grad_norm=1.0))
    strategy = DPStrategy(target_epsilon=3.0, target_delta=DELTA, max_grad_norm=1.0)
    _fit(TinyClassifier(), DataLoader(Subset(ds, range(50, 250)), batch_size=BATCH), strategy)
    assert strategy.ledger.steps == 20
    assert 0.99 * 3.0 < ledger_epsilon(strategy.ledger, DELTA) <= 3.0  # σ fit for 10 new steps after 10 spent



@pytest.mark.parametrize("module_record", [True, False], ids=["module-record", "data-record-alone"])
@pytest.mark.parametrize("epochs", [1, 3])
def test_resuming_an_earlier_checkpoint_counts_the_releases_made_after_it(tmp_path, module_record, epochs):
    """zoo28 l09: a fit of 5 steps checkpoints at step 3; a fit of a fresh module resumed from that checkpoint in the
    same process continues the first fit's 5 releases, not the checkpoint's 3: steps 4-5 were released (their
    weights, outputs, the module itself may be kept; nothing proves them discarded). Each ledger entry names its fit,
    so the data's record (a union by run) extends the checkpoint's 3 to the first fit's 5, as the module's record
    does. 8 steps an epoch: with max_epochs=1 (the red team's trainer) the resumed fit stops at step 8, 5 releases of
    its own (10 in all, which is right); with room for max_steps=10, 7 (12 in all)."""
    import os
    from pathlib import Path

    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_dp.accounting import module_ledgers

    data, batch = _data(), 32  # 250 records: 8 batches an epoch
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    first = _fit(TinyClassifier(), DataLoader(data, batch_size=batch), max_steps=5, enable_checkpointing=True,
                 callbacks=[checkpoints])
    assert first.strategy.ledger.steps == 5
    run = first.strategy.ledger.entries[0].run
    if not module_record:  # the weights' record not found (as in a new process without the store's .ledger files)
        module_ledgers._BY_CONTENT.clear()
        module_ledgers._SKETCHES.clear()
        for stored in Path(os.environ["LIGHTNING_DP_LEDGER_STORE"]).glob("*.ledger"):
            stored.unlink()
    copy = TensorDataset(*(t.clone() for t in data.tensors))  # the same records in new memory
    resumed = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=10,
                            max_epochs=epochs)
    resumed.fit(TinyClassifier(), DataLoader(copy, batch_size=batch), ckpt_path=str(tmp_path / "step=3.ckpt"))
    own = 5 if epochs == 1 else 7
    assert resumed.global_step == 3 + own
    ledger = resumed.strategy.ledger
    assert ledger.steps == 5 + own  # every release made on the records: the first fit's 5, then this fit's own
    assert sum(e.steps for e in ledger.entries if e.run == run) == 5
