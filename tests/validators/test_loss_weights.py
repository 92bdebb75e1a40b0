"""Learned loss weights (uncertainty weighting, Kendall et al. 2018: exp(-s)·L + s per task, with s a parameter of
the LightningModule): applied to a loss already averaged over the batch they are no per-example use the engines can
serve (refused, the message names the per-example form); applied to each example's loss they are a broadcast over
the examples, served exactly."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError


class UncertaintyWeighted(pl.LightningModule):
    def __init__(self, per_example: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.per_example = per_example
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.cls, self.reg = nn.Linear(8, 2), nn.Linear(8, 1)
        self.log_vars = nn.Parameter(torch.zeros(2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net(x)
        reduction = "none" if self.per_example else "mean"
        first = F.cross_entropy(self.cls(h), y, reduction=reduction)
        second = F.mse_loss(self.reg(h).squeeze(-1), x[:, 1], reduction=reduction)
        s = self.log_vars
        loss = torch.exp(-s[0]) * first + s[0] + torch.exp(-s[1]) * second + s[1]
        return loss.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_weights_on_each_examples_loss_train(engine):
    model = UncertaintyWeighted(per_example=True)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, per_sample=engine)
    quiet_trainer(strategy=strategy, max_steps=3).fit(model, _loader())
    assert strategy.ledger.steps == 3 and bool(model.log_vars.detach().ne(0).all())


def test_weights_on_the_batch_mean_are_refused_naming_the_per_example_form():
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, per_sample="ghost")
    with pytest.raises(PrivacyConfigurationError, match=r"log_vars.*reduction='none'"):
        quiet_trainer(strategy=strategy, max_steps=3).fit(UncertaintyWeighted(per_example=False), _loader())
    assert strategy.ledger.steps == 0


class _ZooWeighted(UncertaintyWeighted):
    """The per-example form as the zoo harness trains it (SGD, lr = 1)."""

    def __init__(self) -> None:
        super().__init__(per_example=True)

    def loss(self, batch):
        return self.training_step(batch, 0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def _zoo():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "zoo"))
    import zoo

    return zoo


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_weights_on_each_examples_loss_are_exact(engine):
    """Each example's gradient of exp(-s)·L_i + s, the log-variances' included (d/ds_k = 1 − exp(-s_k)·L_ik),
    equals a per-example loop of torch autograd."""
    zoo = _zoo()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g)
    zoo.assert_exact(_ZooWeighted, TensorDataset(x, (x[:, 0] > 0).long()), per_sample=engine)


def test_opacus_hooks_refuse_the_weights_naming_the_engines_that_serve_them():
    """Opacus sees a parameter only through a layer's call: the refusal names log_vars and ghost/vmap (it named the
    torch.func fallback's argument rule before)."""
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, per_sample="opacus_hooks")
    with pytest.raises(PrivacyConfigurationError, match=r"<root> \(UncertaintyWeighted\): holds parameters of its "
                       r"own \(log_vars\).*served by 'ghost' and 'vmap'"):
        quiet_trainer(strategy=strategy, max_steps=1).fit(UncertaintyWeighted(per_example=True), _loader())
