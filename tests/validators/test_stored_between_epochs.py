"""What the training loader's datasets store stays fixed between epochs without a reload too (zoo17 c3,
record_checks/stored_records.check_stored_unchanged): records mixed with their neighbours in place, or bound anew, by a
callback at an epoch's start after a warm-up are refused before that epoch's first release; augmentation at each
fetch, and a decode buffer the reads fill, train."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError


def _data(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long()


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MixFromEpochOne(pl.Callback):
    """Offline mixup switched on after a warm-up epoch: each stored record mixed with its neighbour."""

    def __init__(self, dataset: TensorDataset, rebind: bool) -> None:
        self.dataset, self.rebind = dataset, rebind

    def on_train_epoch_start(self, trainer, module) -> None:
        if trainer.current_epoch == 1:
            x = self.dataset.tensors[0]
            mixed = 0.5 * (x + x.roll(1, 0))
            if self.rebind:
                self.dataset.tensors = (mixed, self.dataset.tensors[1])
            else:
                x.copy_(mixed)


class Decoded(Dataset):
    """Records decoded into a preallocated buffer of zeros as they are first read."""

    def __init__(self, seed: int = 0) -> None:
        self.x, self.y = _data(seed=seed)
        self.decoded = torch.zeros(64, 4)
        self.done: dict = {}

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Any:
        if i not in self.done:
            self.decoded[i] = self.x[i] * 2
            self.done[i] = True
        return self.decoded[i], self.y[i]


class Jittered(TensorDataset):
    def __getitem__(self, i: int) -> Any:
        x, y = super().__getitem__(i)
        return x + 0.01 * torch.randn(4), y


def _fit(dataset: Dataset, callbacks: list, steps: int = 10) -> DPStrategy:
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    pl.Trainer(strategy=dp, accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks
               ).fit(Model(), DataLoader(dataset, batch_size=16))
    return dp


@pytest.mark.parametrize("rebind", [False, True], ids=["in place", "bound anew"])
def test_records_mixed_after_a_warm_up_are_refused_before_the_epoch_s_release(rebind):
    dataset = TensorDataset(*_data())
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    trainer = pl.Trainer(strategy=dp, accelerator="cpu", max_steps=10, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[MixFromEpochOne(dataset, rebind)])
    with pytest.raises(PrivacyConfigurationError, match="holds the same records with other stored values"):
        trainer.fit(Model(), DataLoader(dataset, batch_size=16))
    assert dp.ledger.steps == 4  # the first epoch's releases; none with the mixed records


def test_augmentation_at_each_fetch_and_a_decode_buffer_train():
    assert _fit(Jittered(*_data()), []).ledger.steps == 10
    assert _fit(Decoded(seed=1), []).ledger.steps == 10  # other records: its own ledger
