"""Ordinary fits with Lightning's own callbacks and a LightningDataModule are not refused by the boundary's newer
checks (docs/release_boundary.md, rule 3): a scheduler made mid-fit (SWA's SWALR wraps ``optimizer.step``), the
average copied into the model when training ends, a datamodule whose ``hparams`` are read for a checkpoint."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from cases import Classifier, data, strategy
from conftest import quiet_trainer
from pytorch_lightning.callbacks import ModelCheckpoint, StochasticWeightAveraging
from torch.utils.data import DataLoader


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size  # no save_hyperparameters(): Lightning makes `_hparams` when a checkpoint reads them

    def setup(self, stage: str) -> None:
        self.train, self.held_out = data(64), data(32, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.held_out, batch_size=16)


class Validated(Classifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx))


def test_swa_and_a_checkpointed_datamodule_train_to_the_end(tmp_path):
    model = Validated()
    dp = strategy()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    trainer = quiet_trainer(strategy=dp, max_epochs=3, callbacks=[swa, ModelCheckpoint(dirpath=tmp_path,
                            monitor="val_loss")], enable_checkpointing=True)
    trainer.fit(model, datamodule=Data())
    assert dp.ledger.steps == 12
    assert list(tmp_path.glob("*.ckpt")), "a checkpoint was written"
    averaged = swa._average_model  # the average SWA copied into the model when training ended
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), averaged.parameters()))
