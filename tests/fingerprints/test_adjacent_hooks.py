"""Silent hooks of several callbacks called one after another by Lightning's callback loop share the fingerprint
between them (fingerprints/adjacent_hooks.py, issue 38): a late write by any of them is still refused at its call, and
code that runs between two of them (a callback's own ``state_key``) stops the sharing, so a write the later hook makes
back to the value the earlier one left is still seen."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators import judged_writes  # noqa: E402

torch.set_num_threads(1)


class Flagged(Classifier):
    """Sets a Python flag to 1 in every step (the same write each step: accepted) and holds a counter buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.flag = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.flag = 1
        return super().training_step(batch, batch_idx)


class Silent(pl.Callback):
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        assert trainer.global_step >= 0


class AlsoSilent(Silent):
    pass


class LateCounter(pl.Callback):
    """Silent until step 5, then the counter buffer set from the training data."""

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step >= 5:
            pl_module.count.copy_(trainer.train_dataloader.dataset.tensors[0].mean())


class ClearsTheFlag(pl.Callback):
    """No hook of its own; its ``state_key`` (read by Lightning's loop before each of its hook calls) clears the
    module's flag."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = [module]

    @property
    def state_key(self) -> str:
        self.module[0].flag = 0
        return type(self).__name__


class LateFlag(pl.Callback):
    """Silent until step 5, then the flag set back to 1 when a statistic of the training data is positive."""

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step >= 5 and float(trainer.train_dataloader.dataset.tensors[0][:, 0].abs().mean()) > 0:
            pl_module.flag = 1


def _fit(model: pl.LightningModule, callbacks: list, steps: int = 10) -> pl.Trainer:
    trainer = quiet_trainer(strategy=strategy(), max_steps=steps, callbacks=callbacks, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(data(64), batch_size=8))
    return trainer


def _shared(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each watched call's answer: whether its fingerprint before was the last one's after."""
    answers: list[bool] = []
    real = judged_writes.only_the_loop_between

    def told(*args: Any) -> bool:
        answers.append(real(*args))
        return answers[-1]
    monkeypatch.setattr(judged_writes, "only_the_loop_between", told)
    return answers


def test_silent_callbacks_share_and_a_late_write_of_the_last_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = _shared(monkeypatch)
    model = Flagged()
    with pytest.raises(PrivacyConfigurationError, match="wrote nothing at its first call") as refusal:
        _fit(model, [Silent(), AlsoSilent(), LateCounter()])
    assert "count" in str(refusal.value) and "LateCounter.on_before_zero_grad" in str(refusal.value)
    assert model.trainer.global_step == 5
    assert answers and all(answers)  # the second and third of each step shared the fingerprint


def test_silent_callbacks_train_with_shared_fingerprints(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = _shared(monkeypatch)
    assert _fit(Flagged(), [Silent(), AlsoSilent()], steps=6).global_step == 6
    assert answers and all(answers)


def test_code_between_two_silent_callbacks_stops_the_sharing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag is 1 after the first callback; ``ClearsTheFlag.state_key`` sets it to 0 between them; the late writer
    sets it to 1 again from step 5. Compared with the first one's fingerprint, the clearing would be charged to the
    late writer (refused at step 1) and its write at step 5 would change nothing; taken anew, its write is refused at
    step 5 and nothing before."""
    answers = _shared(monkeypatch)
    model = Flagged()
    with pytest.raises(PrivacyConfigurationError, match="wrote nothing at its first call") as refusal:
        _fit(model, [Silent(), ClearsTheFlag(model), LateFlag()])
    assert "flag" in str(refusal.value) and "LateFlag.on_before_zero_grad" in str(refusal.value)
    assert model.trainer.global_step == 5
    assert answers and not any(answers)
