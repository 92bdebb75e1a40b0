"""PrivacyBudget on 2 CPU processes (gloo): the ε every rank holds at the end is the ledger's.

Issue 23 item 3: under DDP ``callback_metrics`` said 1.552 against a true 2.837 (the value of
the last logging step). The ledger is the same on every rank, so every rank must end with the
ledger's ε at the strategy's δ. Processes are forked by Lightning's launcher (as in
tests/test_ddp.py); each rank writes what it saw to ``<tmp>/eps<rank>.pt``.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from ddp_helpers import SeededClassifier, classification_data, loader

from lightning_dp import DPStrategy, PrivacyBudget
from lightning_dp.accounting import ledger_epsilon

WORLD, DELTA = 2, 1e-5


class _EndRecorder(pl.Callback):
    """Saves, per rank, the ε in callback_metrics / progress-bar metrics once fit is over."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {
            "callback": float(trainer.callback_metrics["privacy/epsilon"]),
            "progress_bar": float(trainer.progress_bar_metrics["privacy/epsilon"]),
            "ledger": trainer.strategy.ledger.state_dict(),
        }
        torch.save(record, self.out_dir / f"eps{trainer.global_rank}.pt")


def test_every_rank_ends_with_the_ledgers_epsilon(tmp_path):
    strategy = DPStrategy(target_epsilon=3.0, target_delta=DELTA, max_grad_norm=1.0,
                          start_method="fork", timeout=timedelta(seconds=30))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=7, log_every_n_steps=50,
        callbacks=[PrivacyBudget(), _EndRecorder(tmp_path)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(SeededClassifier(), loader(classification_data(200), 10))
    spent = ledger_epsilon(strategy.ledger, DELTA)  # the main process's copy of the ledger
    assert strategy.ledger.steps == 7 and spent == pytest.approx(3.0, abs=0.02)
    records = [torch.load(tmp_path / f"eps{rank}.pt") for rank in range(WORLD)]
    for rank, record in enumerate(records):
        assert record["ledger"] == strategy.ledger.state_dict(), rank
        assert record["callback"] == pytest.approx(spent, rel=1e-12), rank
        assert record["progress_bar"] == pytest.approx(spent, rel=1e-12), rank
    assert float(trainer.callback_metrics["privacy/epsilon"]) == pytest.approx(spent, rel=1e-12)  # rank 0's, returned
