"""What the first step's forward calls, for the probe's diagnosis (validators/step_calls.py): per-example gradient
norms the step computes itself with torch.func to weight its loss (zoo29 n14) are refused, and the refusal names
torch.func, not only ``torch.autograd.grad(..., create_graph=True)`` the user never wrote."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.errors import PrivacyConfigurationError


class _NormWeighted(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        params = {k: v.detach() for k, v in self.named_parameters()}

        def loss(p, xi, yi):
            return F.cross_entropy(functional_call(self, p, (xi[None],)), yi[None])

        g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.sqrt(sum((v.flatten(1) ** 2).sum(1) for v in g.values()))
        w = (norms / norms.sum()).detach() * len(x)  # normalised over the batch: the examples interact
        return (w * F.cross_entropy(self(x), y, reduction="none")).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_per_example_norms_taken_by_torch_func_in_the_step_are_refused_naming_torch_func():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(PrivacyConfigurationError, match="torch.func's transforms") as caught:
        quiet_trainer(strategy=dp, max_steps=1).fit(
            _NormWeighted(), DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16))
    assert "DPStrategy's work" in str(caught.value)
    assert dp.ledger.steps == 0
