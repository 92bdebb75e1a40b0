"""A collate that drops sampled records by the batch's own values (zoo29 e02/e05) is refused, and the refusal leads
with its cause (validators/example_dim.py: ``lookup_use_error``), not with a layer called without the examples."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.errors import PrivacyConfigurationError


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _below_median(batch):
    x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
    keep = x[:, 0] <= x[:, 0].median()  # who is kept depends on the other records
    return x[keep], y[keep]


def _majority(batch):
    x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
    keep = y == y.mode().values
    return x[keep], y[keep]


def _fit(collate) -> DPStrategy:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 4, generator=g)
    data = TensorDataset(x, (x[:, 1] > 0).long())
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=dp, max_steps=2).fit(_Net(), DataLoader(data, batch_size=16, collate_fn=collate))
    return dp


@pytest.mark.parametrize("collate", [_below_median, _majority])
def test_records_dropped_by_the_batch_are_refused_by_their_cause(collate):
    with pytest.raises(PrivacyConfigurationError, match=r"^(The first step's probe failed: )?The step sampled \d+ "
                       r"examples, but the model was called on fewer rows") as caught:
        _fit(collate)
    assert "Keep every sampled record" in str(caught.value)


def test_a_collate_keeping_every_record_trains():
    def stacked(batch):
        return torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])

    assert _fit(stacked).ledger.steps == 2
