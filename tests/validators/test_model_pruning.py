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
from lightning_dp.privacy.noise import GaussianNoise


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


def _fit(model: pl.LightningModule, engine: str = "auto", seeded: bool = False, **kwargs) -> DPStrategy:
    seeds = dict(sampler_seed=0, noise=GaussianNoise(seed=0)) if seeded else {}
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, per_sample=engine, **seeds)
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
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)pruned during the fit by ModelPruning with "
                       r"pruning_fn=DataScores, a pruning method of yours.*Accepted:.*random_unstructured") as caught:
        _fit(model, max_epochs=2, callbacks=[ModelPruning(DataScores, amount=0.5, verbose=0)])
    assert "other code than" not in str(caught.value), "it was ModelPruning that pruned (zoo30 p04)"
    _fit(Net(), max_epochs=2, callbacks=[ModelPruning(prune.L1Unstructured, amount=0.5, verbose=0)])


class RandomColumns(prune.BasePruningMethod):
    """A pruning method of the user's drawing a random mask (two input columns of the first layer)."""

    PRUNING_TYPE = "unstructured"

    def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
        mask = default_mask.clone()
        if t.dim() == 2 and t.shape[1] == 8:
            mask[:, torch.randperm(8)[:2]] = 0
        return mask


class SubclassedPruning(ModelPruning):
    """A subclass of Lightning's ModelPruning (its code may compute the masks otherwise)."""


@pytest.mark.parametrize("callback, named", [
    (lambda m: ModelPruning(RandomColumns, amount=0.1, parameters_to_prune=[(m.net[0], "weight")], verbose=0,
                            use_lottery_ticket_hypothesis=False), "ModelPruning with pruning_fn=RandomColumns"),
    (lambda m: SubclassedPruning("l1_unstructured", amount=0.5, verbose=0), "SubclassedPruning, a subclass"),
])
def test_the_refusal_of_a_model_pruning_it_does_not_accept_names_the_callback_and_the_fix(callback, named):
    """zoo30 p04: a random mask of the user's method is refused (its code is not judged), by a message that says it was
    ModelPruning, with what, and what is accepted — not "other code than Lightning's ModelPruning"."""
    model = Net()
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)pruned during the fit by {named}.*"
                       r"Fix: give ModelPruning one of those") as caught:
        _fit(model, max_epochs=2, callbacks=[callback(model)])
    assert "other code than" not in str(caught.value)


# ModelPruning's callables (amount, apply_pruning, use_lottery_ticket_hypothesis) are the user's code: what they write
# is not pruning (zoo29 p01, p02, p05); only what torch's pruning writes is accepted, the epoch schedules train on.

def _rows() -> tuple[Tensor, Tensor]:
    return _loader().dataset.tensors


def _gd_step(model: pl.LightningModule) -> None:
    """An un-noised full-batch gradient step on the training rows (zoo29 p01)."""
    x, y = _rows()
    with torch.enable_grad():
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()), allow_unused=True)
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            if g is not None:
                p.sub_(5.0 * g)


def test_an_amount_callable_training_on_the_rows_is_refused():
    model = Net()

    def amount(epoch: int) -> float:
        _gd_step(model)
        return 0.1

    callback = ModelPruning("l1_unstructured", amount=amount, use_lottery_ticket_hypothesis=False,
                            make_pruning_permanent=False, verbose=0)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)amount callable.*wrote.*parameter net\.0\.w"):
        _fit(model, max_epochs=2, callbacks=[callback])


class Prototypes(Net):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("protos", torch.zeros(2, 8))


def test_an_amount_callable_writing_class_means_into_a_buffer_is_refused():
    model = Prototypes()

    def amount(epoch: int) -> float:
        x, y = _rows()
        for c in (0, 1):
            model.protos[c].copy_(x[y == c].mean(0))
        return 0.2

    with pytest.raises(PrivacyConfigurationError, match=r"(?s)ModelPruning's amount callable.*wrote.*buffer protos"):
        _fit(model, max_epochs=1, callbacks=[ModelPruning("l1_unstructured", amount=amount, verbose=0)])


def test_a_lottery_ticket_callable_writing_label_frequencies_into_an_orig_is_refused():
    model = Net()

    def lottery(epoch: int) -> bool:
        _, y = _rows()
        with torch.no_grad():
            bias = getattr(model.net[2], "bias_orig", model.net[2].bias)
            bias.copy_(torch.stack([(y == 0).float().mean(), (y == 1).float().mean()]))
        return False

    callback = ModelPruning("l1_unstructured", amount=0.2, use_lottery_ticket_hypothesis=lottery, verbose=0)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)lottery_ticket_hypothesis callable.*wrote.*net\.2\.bias"):
        _fit(model, max_epochs=1, callbacks=[callback])


def test_an_apply_pruning_callable_zeroing_mask_entries_by_the_data_is_refused():
    """The mask buffer written before torch's pruning multiplies its new mask in: zeros chosen from the data."""
    model = Net()

    def apply(epoch: int) -> bool:
        if epoch == 1:
            x, _ = _rows()
            model.net[0].weight_mask[:, x.mean(0) > 0] = 0
        return True

    callback = ModelPruning("l1_unstructured", amount=0.1, apply_pruning=apply, verbose=0)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)apply_pruning callable.*wrote.*net\.0\.weight_mask"):
        _fit(model, max_epochs=2, callbacks=[callback])


def test_epoch_schedules_as_callables_train_on():
    """The safe twins: the share, the decision and the lottery-ticket reset as functions of the epoch only."""
    model = Net()
    callback = ModelPruning("l1_unstructured", amount=lambda e: 0.1 * (e + 1), apply_pruning=lambda e: e != 1,
                            use_lottery_ticket_hypothesis=lambda e: e == 0, verbose=0)
    dp = _fit(model, max_epochs=3, callbacks=[callback], seeded=True)  # the count below follows the weights' values
    assert dp.ledger.steps >= 12
    # Epoch 2's share (0.3 of the 128 weights, torch rounds to 38) was pruned: epoch 0's alone is 13, with epoch 1's 26.
    assert int((model.net[0].weight == 0).sum()) >= round(0.3 * 128)


def test_model_pruning_with_a_global_random_draw_and_no_permanence_trains_on():
    model = Net()
    dp = _fit(model, max_epochs=2, callbacks=[ModelPruning("random_unstructured", amount=0.3, verbose=0,
                                                           make_pruning_permanent=False)])
    assert dp.ledger.steps >= 8
    assert hasattr(model.net[0], "weight_mask")


class RowMeanInit(nn.Linear):
    """A layer of the user's whose ``reset_parameters`` sets its bias from the training rows once they are known."""

    rows: Tensor | None = None

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if RowMeanInit.rows is not None:
            with torch.no_grad():
                self.bias.copy_(RowMeanInit.rows.mean(0)[: self.out_features])


def test_a_lottery_ticket_resample_by_a_layer_of_the_users_is_refused():
    """Inside the pruning call (no callable of the user's): the resampled original comes from the layer's own
    ``reset_parameters``, the user's code: what it wrote is not torch's pruning. A torch layer's fresh draw trains."""
    model = Net()
    model.net[2] = RowMeanInit(16, 2)
    RowMeanInit.rows = _rows()[0]
    callback = ModelPruning("l1_unstructured", amount=0.2, resample_parameters=True, verbose=0)
    try:
        with pytest.raises(PrivacyConfigurationError, match=r"(?s)pruning call changed state.*net\.2\.bias_orig"):
            _fit(model, max_epochs=2, callbacks=[callback])
    finally:
        RowMeanInit.rows = None
    dp = _fit(Net(), max_epochs=2, callbacks=[ModelPruning("l1_unstructured", amount=0.2, resample_parameters=True,
                                                           verbose=0)])
    assert dp.ledger.steps >= 8
