"""The sanity check's validation hooks run inside ``trainer.fit`` before the training loader exists: what they keep
after reading the training records is refused as training starts (validators/sanity_reads.py, zoo39 L02, L25)."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from cases import Classifier, data, parameters, unchanged
from conftest import quiet_trainer
from torch.utils.data import DataLoader

from lightning_dp import DPStrategy, PrivacyConfigurationError


class Data(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.train_set, self.val_set = data(64, seed=0), data(32, seed=3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=16)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=16)


class Prior(Classifier):
    """A logit bias from a label prior set at each validation's end; ``source``: the datamodule's set it counts."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.register_buffer("prior", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.prior

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def on_validation_epoch_end(self) -> None:
        y = getattr(self.trainer.datamodule, self.source).tensors[1]
        self.prior.copy_(torch.bincount(y, minlength=2).float().div(len(y)).log())


class Validated(Classifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


class Counts(pl.Callback):
    """Reads the training labels at validation's end and keeps nothing of them."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.bincount(trainer.datamodule.train_set.tensors[1], minlength=2)  # (the sanity check's and each epoch's)



def fit(model: pl.LightningModule, **kwargs: Any) -> None:
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    quiet_trainer(strategy=dp, max_epochs=2, **kwargs).fit(model, datamodule=Data())


def test_a_training_prior_kept_by_the_sanity_check_is_refused_before_any_release() -> None:
    model = Prior("train_set")
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match="sanity check"):
        fit(model)
    assert unchanged(before, model)


def test_a_prior_of_the_validation_set_trains() -> None:
    model = Prior("val_set")
    fit(model)
    assert bool((model.prior != 0).all())


def test_a_sanity_check_that_reads_the_training_data_and_keeps_nothing_trains() -> None:
    fit(Validated(), callbacks=[Counts()], limit_val_batches=1)
