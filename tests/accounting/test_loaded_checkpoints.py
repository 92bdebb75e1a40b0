"""A module built by ``load_from_checkpoint`` continues its checkpoint's ledger in another process
(accounting/loaded_checkpoints.py; zoo24 f2: a new process's fit after ``load_from_checkpoint`` counted 8 of 16
releases). The second fit runs in a subprocess, a new Python process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from child_fits import ledgers, run_child, write_model
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

import lightning_dp
from lightning_dp.accounting import ledger_epsilon, module_ledgers
from lightning_dp.accounting.epsilon import epsilon
from lightning_dp.accounting.loaded_checkpoints import CHECKPOINT_KEY, continue_ledger

SIGMA, Q, DELTA = 1.0, 32 / 256, 1e-5

CHILD = '''
import json, sys
from tiny import Tiny, loader, trainer
from lightning_dp.accounting import data_ledgers, module_ledgers

out = {}
for name in sys.argv[1:]:
    model = Tiny.load_from_checkpoint(name)
    t = trainer()
    t.fit(model, loader())
    out[name] = t.strategy.ledger.state_dict()
    module_ledgers._BY_CONTENT.clear(); module_ledgers._SKETCHES.clear()  # each checkpoint as if in its own process
    data_ledgers._clear()  # (the data's record too: both fits train on the same records)
print("LEDGERS " + json.dumps(out))
'''


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    write_model(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tiny", None)
    import tiny
    yield tiny
    sys.modules.pop("tiny", None)


def _first_fit(tiny, tmp_path: Path) -> Path:
    """Fit 1 (8 releases): a full checkpoint, a weights-only one, and the full one without the entry."""
    t = tiny.trainer(enable_checkpointing=True, callbacks=[
        ModelCheckpoint(dirpath=tmp_path / "saved", filename="weights", save_weights_only=True)])
    t.fit(tiny.Tiny(), tiny.loader())
    assert t.strategy.ledger.steps == 8
    t.save_checkpoint(tmp_path / "full.ckpt")
    stripped = torch.load(tmp_path / "full.ckpt", weights_only=False)
    weights_only = torch.load(tmp_path / "saved" / "weights.ckpt", weights_only=False)
    assert CHECKPOINT_KEY in stripped and CHECKPOINT_KEY in weights_only
    del stripped[CHECKPOINT_KEY]
    torch.save(stripped, tmp_path / "none.ckpt")
    (tmp_path / "saved" / "weights.ckpt").rename(tmp_path / "weights.ckpt")
    return tmp_path


def _in_a_new_process(folder: Path, *names: str, **environ: str) -> dict[str, lightning_dp.PrivacyLedger]:
    return ledgers(run_child(folder, CHILD, *names, timeout=120, **environ))


def test_load_from_checkpoint_in_a_new_process_continues_the_ledger(tiny, tmp_path):
    """Full and weights-only checkpoints: the new process's fit counts 16 releases, ε composed over both fits; a
    checkpoint without the entry (not a private fit's) starts fresh. The checkpoint alone: the ledger store off (it
    would find the stripped checkpoint's weights too: tests/accounting/test_ledger_store.py)."""
    folder = _first_fit(tiny, tmp_path)
    ledgers = _in_a_new_process(folder, "full.ckpt", "weights.ckpt", "none.ckpt", LIGHTNING_DP_LEDGER_STORE="off")
    for name in ("full.ckpt", "weights.ckpt"):
        ledger = ledgers[name]
        assert ledger.steps == 16, name
        assert len({e.run for e in ledger.entries}) == 2  # the first fit's run, then the new one
        assert ledger_epsilon(ledger, DELTA) == pytest.approx(epsilon(SIGMA, Q, 16, DELTA), rel=1e-9)
    assert ledgers["none.ckpt"].steps == 8


def test_load_from_checkpoint_in_the_same_process_counts_each_release_once(tiny, tmp_path):
    """In the process that trained the weights the record is found twice (the weights' digests, the checkpoint's
    entry): one history, 16 releases, not 24."""
    folder = _first_fit(tiny, tmp_path)
    for i, name in enumerate(("full.ckpt", "weights.ckpt")):
        t = tiny.trainer()
        t.fit(tiny.Tiny.load_from_checkpoint(folder / name), tiny.loader())
        # the first fit's 8 once, then 8 of its own; the second load also continues the first load's fit on the same
        # records (the data's record, accounting/data_ledgers.py): 24, a run of 8 each
        assert t.strategy.ledger.steps == 16 + 8 * i, name
        assert len({e.run for e in t.strategy.ledger.entries}) == 2 + i


def test_only_the_weights_a_fit_trained_carry_the_loaded_record():
    """The checkpoint names the weights the releases changed: a fresh module holding an untrained layer's values
    (the same seed) carries no record; one holding a trained layer's does. Without the entry nothing changes."""
    ledger = lightning_dp.PrivacyLedger()
    ledger.record(SIGMA, Q, 8)
    torch.manual_seed(0)
    loaded = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert not continue_ledger(loaded, {"state_dict": {}})
    assert module_ledgers.record_of(loaded) is None
    assert continue_ledger(loaded, {CHECKPOINT_KEY: {"ledger": ledger.state_dict(), "trained_weights": ["1.weight"]}})
    assert module_ledgers.record_of(loaded).steps == 8  # the module object itself
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fresh[1].weight.data.normal_()
    assert module_ledgers.record_of(fresh) is None  # layer 0 as the seed built it: not trained
    fresh[1].load_state_dict(loaded[1].state_dict())
    assert module_ledgers.record_of(fresh).steps == 8


def test_lightnings_loader_is_wrapped_once():
    from pytorch_lightning.core import saving

    from lightning_dp.accounting.loaded_checkpoints import install

    assert install("pytorch_lightning") and install("pytorch_lightning")
    assert getattr(saving._load_state, "__lightning_dp_continues_ledger__", False)
    assert not getattr(saving._load_state.__wrapped__, "__lightning_dp_continues_ledger__", False)
    assert pl.LightningModule.load_from_checkpoint  # the public entry point is Lightning's own, untouched


def test_a_checkpoint_without_the_names_takes_each_varying_trainable_weight_for_trained():
    """An older checkpoint (no ``trained_weights``): a copy of any of its weights that are not constant continues
    the record; a constant one (a zero bias, a norm's ones) does not hand it to a fresh module."""
    ledger = lightning_dp.PrivacyLedger()
    ledger.record(SIGMA, Q, 8)
    loaded = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert continue_ledger(loaded, {CHECKPOINT_KEY: {"ledger": ledger.state_dict()}})
    fresh = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert module_ledgers.record_of(fresh) is None  # its LayerNorm holds the loaded one's ones and zeros
    fresh[0].load_state_dict(loaded[0].state_dict())
    assert module_ledgers.record_of(fresh).steps == 8
