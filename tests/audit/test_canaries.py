"""Canaries: coins, datasets that append the included ones, loss scores, Dirac gradient canaries."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.audit import (
    CanaryDataModule,
    CanaryDataset,
    GradientCanaryDataModule,
    GradientCanaryDataset,
    GradientCanaryModule,
    canary_losses,
    draw_coins,
    loss_scores,
    make_input_canaries,
)


def test_coins_are_fair_and_reproducible_from_the_recorded_seed():
    coins = draw_coins(4000, seed=7)
    assert torch.equal(coins, draw_coins(4000, seed=7))
    assert not torch.equal(coins, draw_coins(4000, seed=8))
    assert stats.binomtest(int(coins.sum()), 4000, 0.5).pvalue > 1e-3


def test_input_canaries_shape_values_and_coins():
    c = make_input_canaries(50, (1, 8, 8), num_classes=10, seed=3, amplitude=2.0)
    assert c.inputs.shape == (50, 1, 8, 8) and c.labels.shape == (50,)
    assert set(c.inputs.unique().tolist()) == {-2.0, 2.0}
    assert 0 <= int(c.labels.min()) and int(c.labels.max()) < 10
    assert torch.equal(c.included, draw_coins(50, 3))  # coins come from the recorded seed alone
    assert c.num_included == int(c.included.sum()) and len(c) == 50


def test_canary_dataset_appends_exactly_the_included_canaries():
    base = TensorDataset(torch.zeros(30, 4), torch.zeros(30, dtype=torch.long))
    c = make_input_canaries(20, (4,), num_classes=3, seed=1)
    ds = CanaryDataset(base, c)
    assert len(ds) == 30 + c.num_included
    appended = torch.stack([ds[i][0] for i in range(30, len(ds))])
    assert torch.equal(appended, c.inputs[c.included])
    assert torch.equal(torch.stack([ds[i][1] for i in range(30, len(ds))]), c.labels[c.included])


class _DM(pl.LightningDataModule):
    def setup(self, stage=None):
        self.ds = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=8)

    def test_dataloader(self):
        return DataLoader(self.ds, batch_size=40)


def test_canary_datamodule_changes_only_the_training_set():
    c = make_input_canaries(10, (4,), num_classes=3, seed=2)
    dm = CanaryDataModule(_DM(), c)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert len(loader.dataset) == 40 + c.num_included and loader.batch_size == 8
    assert len(dm.test_dataloader().dataset) == 40


def test_canary_losses_are_per_example_cross_entropy_and_keep_mode():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).train()
    c = make_input_canaries(7, (4,), num_classes=3, seed=4)
    losses = canary_losses(model, c, batch_size=3)
    expected = nn.functional.cross_entropy(model(c.inputs), c.labels, reduction="none").detach()
    assert torch.allclose(losses, expected, atol=1e-6) and model.training


def test_loss_scores_rank_lower_loss_higher():
    final = torch.tensor([0.1, 2.0, 1.0])
    assert loss_scores(final).argsort().tolist() == [1, 2, 0]
    reference = torch.tensor([0.2, 5.0, 1.0])
    assert loss_scores(final, reference).tolist() == pytest.approx([0.1, 3.0, 0.0])


class _Clf(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 3)

    def forward(self, x):
        return self.net(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def _per_example_grads(module: GradientCanaryModule, batch) -> list[torch.Tensor]:
    """Each example's gradient, from a batch of one (the engines' per-example convention)."""
    x, y, ids = batch
    grads = []
    for i in range(len(ids)):
        module.zero_grad()
        module.training_step((x[i:i + 1], y[i:i + 1], ids[i:i + 1]), 0).backward()
        grads.append(torch.cat([p.grad.flatten() for p in module.parameters()]))
    return grads


def test_dirac_canary_gradient_is_exactly_C_on_its_own_coordinate():
    torch.manual_seed(0)
    C, m = 0.7, 5
    module = GradientCanaryModule(_Clf(), num_canaries=m, norm=C)
    x = torch.randn(3, 4)
    batch = (x, torch.tensor([0, 2, 0]), torch.tensor([-1, 3, 1]))
    real, canary3, canary1 = _per_example_grads(module, batch)
    n_base = sum(p.numel() for p in module.base.parameters())
    assert torch.count_nonzero(real[n_base:]) == 0  # a real example never touches the canary table
    expected = torch.zeros(n_base + m)
    expected[n_base + 3] = C
    assert torch.equal(canary3, expected)  # norm exactly C, on coordinate 3 only
    assert canary1.norm().item() == pytest.approx(C) and canary1[n_base + 1] == C


def test_gradient_canary_scores_move_for_included_canaries_only():
    torch.manual_seed(0)
    module = GradientCanaryModule(_Clf(), num_canaries=4, norm=1.0)
    opt = module.configure_optimizers()
    assert len(opt.param_groups) == 2
    x = torch.randn(2, 4)
    opt.zero_grad()
    module.training_step((x, torch.tensor([0, 0]), torch.tensor([-1, 2])), 0).backward()
    opt.step()
    scores = module.scores()
    assert scores[2] > 0 and scores[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]


def test_gradient_canary_dataset_and_datamodule():
    base = TensorDataset(torch.ones(6, 4), torch.ones(6, dtype=torch.long))
    included = torch.tensor([True, False, True])
    ds = GradientCanaryDataset(base, included)
    assert len(ds) == 8
    assert ds[0][2].item() == -1 and [ds[6][2].item(), ds[7][2].item()] == [0, 2]
    assert torch.count_nonzero(ds[6][0]) == 0 and ds[6][1].item() == 0
    dm = GradientCanaryDataModule(_DM(), included)
    dm.setup("fit")
    assert len(dm.train_dataloader().dataset) == 42


def test_bad_arguments():
    with pytest.raises(ValueError):
        draw_coins(0, seed=1)
    with pytest.raises(ValueError):
        make_input_canaries(5, (4,), num_classes=1)
    with pytest.raises(ValueError):
        GradientCanaryModule(_Clf(), num_canaries=0, norm=1.0)
