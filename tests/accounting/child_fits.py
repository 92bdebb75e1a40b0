"""Fits in a new Python process, for the tests of accounting/ that a record must reach across processes (the ledger
store, the data's record, a loaded checkpoint's entry): the child scripts' tiny module (``tiny.py``: :data:`MODEL`)
and a runner that starts a child script with the test's folder and this checkout first on its path and reads back
what it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from lightning_dp.accounting.ledger import PrivacyLedger

ROOT = Path(__file__).resolve().parents[2]

MODEL = '''
import torch
import pytorch_lightning as pl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_dp import DPStrategy


class Tiny(pl.LightningModule):
    def __init__(self, seed=0, features=8):
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)


def trainer(strategy=None, **kw):
    kw.setdefault("enable_checkpointing", False)
    strategy = strategy or DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, **kw)


def fit(model, **kw):
    t = trainer(**kw)
    t.fit(model, loader())
    return t.strategy.ledger
'''
"""``tiny.py``: ``Tiny`` (seeded by ``seed``; ``None``: not seeded), ``loader`` (256 seeded records of 8 features,
batches of 32: 8 releases an epoch), ``trainer`` (one epoch under a ``DPStrategy`` of σ = 1) and ``fit``."""


def write_model(folder: Path) -> None:
    """Write :data:`MODEL` as ``folder/tiny.py`` (the child scripts import it; a test may too)."""
    (folder / "tiny.py").write_text(MODEL)


def run_child(folder: Path, script: str, *args: str, timeout: int = 300, **environ: str) -> subprocess.CompletedProcess:
    """Run ``script`` (written as ``folder/child.py``) with ``args`` in a new Python process in ``folder``, with
    ``folder`` and this checkout first on its path and ``environ`` set; asserts that it succeeded."""
    (folder / "child.py").write_text(script)
    path = os.pathsep.join([str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(folder / "child.py"), *args], cwd=folder,
                          env={**os.environ, "PYTHONPATH": path, **environ}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def printed(done: subprocess.CompletedProcess, tag: str) -> Any:
    """The JSON value a child printed on its line ``"<tag> <json>"``."""
    lines = [x for x in done.stdout.splitlines() if x.startswith(tag + " ")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(lines[0][len(tag) + 1:])


def ledgers(done: subprocess.CompletedProcess) -> dict[str, PrivacyLedger]:
    """The ledgers a child printed as ``LEDGERS {name: state_dict}``."""
    out = {}
    for name, state in printed(done, "LEDGERS").items():
        out[name] = PrivacyLedger()
        out[name].load_state_dict(state)
    return out
