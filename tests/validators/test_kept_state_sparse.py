"""Kept state held as sparse tensors (a graph model's adjacency, in an attribute or a buffer): fingerprinted by its
indices and values (lightning_dp/validators/kept_state.py), so a clean fit trains and a write from the batch is
refused. Sparse tensors have no storage of their own: keying them by data pointer crashed the first step."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.errors import PrivacyConfigurationError


class GraphModel(pl.LightningModule):
    """Node features smoothed over a fixed sparse adjacency (COO buffer, CSR attribute), then a linear layer."""

    def __init__(self, write: str = "") -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.register_buffer("adjacency", torch.eye(4).to_sparse())
        self.csr = torch.eye(4).to_sparse_csr()
        self.write = write

    def training_step(self, batch, batch_idx):
        x, y = batch
        smoothed = torch.sparse.mm(self.adjacency, x.t()).t() + (self.csr @ x.t()).t()
        if self.write == "buffer":
            self.adjacency.mul_(1.0 + float(x.abs().mean()))
        elif self.write == "attribute":
            self.csr.values().add_(float(x.mean()))
        return nn.functional.cross_entropy(self.net(smoothed), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model: GraphModel) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0), max_steps=2)
    trainer.fit(model, DataLoader(data, batch_size=16))


def test_a_model_keeping_sparse_state_trains():
    model = GraphModel()
    before = model.adjacency.to_dense().clone()
    _fit(model)
    assert torch.equal(model.adjacency.to_dense(), before)


@pytest.mark.parametrize("where", ["buffer", "attribute"])
def test_a_write_to_sparse_state_from_the_batch_is_refused(where):
    with pytest.raises(PrivacyConfigurationError, match="adjacency" if where == "buffer" else "csr"):
        _fit(GraphModel(write=where))
