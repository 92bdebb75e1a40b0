"""Lightning's EMAWeightAveraging with DPStrategy: post-processing of the released parameters only,
and checkpoints keep both the ledger and the average (issue 21, item 2)."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint

from lightning_dp import DPStrategy

DECAY = 0.8


class _Released(Callback):
    """The parameters after every optimizer step (each one a function of the noisy releases)."""

    def __init__(self) -> None:
        self.trajectory: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.trajectory.append([p.detach().clone() for p in pl_module.parameters()])


def test_the_average_is_the_ema_of_the_released_parameters():
    released = _Released()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, public_state=["_Released"])  # the test's observer
    module = TinyClassifier()
    quiet_trainer(strategy=strategy, max_steps=12, callbacks=[released, EMAWeightAveraging(decay=DECAY)]).fit(
        module, make_loader(n=100, batch_size=10))
    assert len(released.trajectory) == 12 and strategy.ledger.steps == 12
    average = released.trajectory[0]
    for theta in released.trajectory[1:]:
        average = [DECAY * a + (1 - DECAY) * t for a, t in zip(average, theta)]
    for p, a in zip(module.parameters(), average):  # at train end the module holds the average
        torch.testing.assert_close(p.detach(), a, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(average[0], released.trajectory[-1][0])  # averaging did something


def test_checkpoint_and_resume_keep_the_ledger_and_the_average(tmp_path):
    first = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    ema = EMAWeightAveraging(decay=DECAY)
    quiet_trainer(strategy=first, max_epochs=1, enable_checkpointing=True,
                  callbacks=[ema, ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(
        TinyClassifier(), make_loader(n=100, batch_size=10))
    saved = int(ema._average_model.n_averaged)
    resumed_ema = EMAWeightAveraging(decay=DECAY)
    resumed = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=resumed, max_epochs=2, callbacks=[resumed_ema]).fit(
        TinyClassifier(), make_loader(n=100, batch_size=10), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.ledger.steps == first.ledger.steps + 10
    assert int(resumed_ema._average_model.n_averaged) == saved + 10  # the average continued, not restarted
