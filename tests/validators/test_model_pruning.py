"""Pruning under DPStrategy (validators/model_pruning.py, validators/layers.pruned).

A model pruned before the fit (masks fixed) trains on every engine that serves it, its pruned weights staying zero.
Lightning's ``ModelPruning`` callback (zoo28 l01/l02: magnitudes of the released weights at each epoch's end, with the
lottery-ticket reset) trains on, its writes accepted as post-processing and the engine re-attached to the renamed
parameter (the same Parameter object: the optimizer's). Pruning during the fit by other code is refused by name, naming
what is served."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from conftest import quiet_trainer
from pytorch_lightning.callbacks import ModelPruning
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


def _fit(model: pl.LightningModule, engine: str = "auto", **kwargs) -> DPStrategy:
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, per_sample=engine)
    quiet_trainer(strategy=dp, **kwargs).fit(model, _loader())
    return dp


@pytest.mark.parametrize("engine", ["auto", "ghost", "vmap"])
def test_a_model_pruned_before_the_fit_trains_and_its_pruned_weights_stay_zero(engine):
    model = Net()
    prune.l1_unstructured(model.net[0], "weight", amount=0.5)
    mask = model.net[0].weight_mask.clone()
    before = model.net[0].weight_orig.detach().clone()
    dp = _fit(model, engine, max_steps=3)
    assert dp.ledger.steps == 3
    assert torch.equal(model.net[0].weight_mask, mask)
    assert not torch.equal(model.net[0].weight_orig.detach(), before)  # trained (noise on masked entries: allowed)
    model.net[0](torch.zeros(1, 8))  # the hook recomputes the pruned weight
    assert torch.all(model.net[0].weight[mask == 0] == 0)


def test_model_pruning_at_epoch_ends_trains_on_with_the_same_parameters():
    model = Net()
    weight = model.net[0].weight
    dp = _fit(model, max_epochs=3, callbacks=[ModelPruning("l1_unstructured", amount=0.5, verbose=0)])
    steps = dp.ledger.steps
    assert steps >= 6, "every epoch's steps were released, not only the first's"
    assert model.net[0].weight is weight  # made permanent at the end: the very Parameter the optimizer stepped
    assert weight in model.trainer.optimizers[0].param_groups[0]["params"]
    assert float((weight == 0).float().mean()) >= 0.5  # pruned at each epoch's end (amount compounds)
    assert dp.private_step.verified  # the probe ran again on the pruned layers before their first release


def test_model_pruning_with_the_lottery_ticket_reset_trains_on():
    """The remaining weights reset to the initial ones (copied before the fit: public) at each epoch's end."""
    model = Net()
    first = model.net[2].weight.detach().clone()
    reset = []

    class Watch(pl.Callback):  # after ModelPruning's on_train_epoch_end (callbacks run in order)
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                kept = pl_module.net[2].weight_mask.bool()
                reset.append(torch.equal(pl_module.net[2].weight_orig.detach()[kept], first[kept]))

    callback = ModelPruning("l1_unstructured", amount=0.3, use_lottery_ticket_hypothesis=True, verbose=0)
    dp = _fit(model, max_epochs=2, callbacks=[callback, Watch()])
    assert reset == [True]
    assert dp.ledger.steps >= 4 + 2, "the second epoch trained on after the reset"


class PruneFromData(Net):
    """A hook of the user's pruning by the training data's feature magnitudes (SNIP-like): refused by name."""

    def on_train_epoch_end(self) -> None:
        if self.current_epoch == 0:
            x = self.trainer.train_dataloader.dataset.tensors[0]
            scores = x.abs().mean(0).expand_as(self.net[0].weight)
            prune.l1_unstructured(self.net[0], "weight", amount=0.5, importance_scores=scores)


def test_pruning_during_the_fit_by_other_code_is_refused_by_name():
    model = PruneFromData()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)pruned during the fit.*ModelPruning.*Prune before"):
        _fit(model, max_epochs=2)
    assert model.trainer.strategy.ledger.steps <= 4  # epoch 0's releases only: nothing after the pruning


class DataScores(prune.BasePruningMethod):
    """A pruning method of the user's: its mask from the training features' magnitudes (SNIP-like, un-noised)."""

    PRUNING_TYPE = "unstructured"
    features: Tensor = torch.zeros(0)

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        scores = DataScores.features.abs().mean(0)
        keep = (scores >= scores.median()).float()
        return default_mask * (keep.expand_as(t) if keep.numel() == t.shape[-1] else torch.ones_like(t))


def test_model_pruning_with_a_pruning_method_of_the_users_is_refused():
    """ModelPruning(pruning_fn=<a BasePruningMethod class of the user's>): its mask may come from anything (here the
    training features): not accepted as post-processing — refused by name; the built-in L1Unstructured class trains."""
    DataScores.features = _loader().dataset.tensors[0]
    model = Net()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)pruned during the fit.*not a subclass"):
        _fit(model, max_epochs=2, callbacks=[ModelPruning(DataScores, amount=0.5, verbose=0)])
    _fit(Net(), max_epochs=2, callbacks=[ModelPruning(prune.L1Unstructured, amount=0.5, verbose=0)])
