"""The optimizer's update and the schedulers' updates judged on 2 CPU processes (gloo; validators/judged_updates.py,
judged_schedules.py): an update of the user's code computed from the ĝ it was handed trains alike on every rank (the
runs again stay paired across ranks); one that reads the training data is refused on every rank."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from ddp_helpers import SeededClassifier, classification_data
from torch.utils.data import DataLoader

from lightning_dp import DPStrategy

DATA = classification_data(120)


class SignSGD(torch.optim.SGD):
    """A step of the user's: the sign of ĝ, and — ``reads`` — the output bias pulled toward the training mean."""

    def __init__(self, module: Any, reads: bool) -> None:
        super().__init__(module.parameters(), lr=0.05)
        self.module, self.reads, self.count = [module], reads, 0

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = closure() if closure is not None else None
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])
        if self.reads:
            bias = self.module[0].net[2].bias
            bias.copy_(self.module[0].trainer.train_dataloader.dataset.tensors[0].mean(0)[:3])
        return loss


class WithSignSGD(SeededClassifier):
    def __init__(self, reads: bool) -> None:
        super().__init__()
        self.reads = reads

    def train_dataloader(self) -> DataLoader:
        return DataLoader(DATA, batch_size=10)

    def configure_optimizers(self) -> Any:
        optimizer = SignSGD(self, self.reads)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.9 ** k), "interval": "step"}}


def _fit(model: pl.LightningModule) -> pl.Trainer:
    strategy = DPStrategy(start_method="fork", timeout=timedelta(seconds=15), noise_multiplier=1.0, max_grad_norm=1.0,
                          sampler_seed=0)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    return trainer


def test_an_update_of_the_users_code_from_the_release_trains_on_every_rank() -> None:
    model = WithSignSGD(reads=False)
    before = [p.detach().clone() for p in model.parameters()]
    _fit(model)  # (no rank raised: the runs again on every rank agreed)
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # rank 0's weights came back


def test_an_update_reading_the_training_data_is_refused_under_ddp() -> None:
    with pytest.raises(Exception, match="The optimizer's update read the training data"):
        _fit(WithSignSGD(reads=True))
