"""A training record with an inf or NaN feature, under DPStrategy and a plain PrivateStep loop (docs/algorithms.md,
"Non-finite gradients"): it adds nothing to a release, so the weights stay finite whether or not it is sampled
(a NaN release would show the step that sampled it); the first step's probe leaves it out and says nothing (how many
records are not finite is the data's); a dataset holding a NaN is not taken for one written by the step (a NaN is
equal to itself where state is put back)."""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.engine_api import ClippedBatch
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep
from lightning_dp.validators.finite_release import check_finite_release


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


FEATURES = torch.zeros(0)
"""The training features, also a global of the script (as a script keeps them): the replays put the globals of the
user's modules back, and must not take a tensor holding a NaN for one the step wrote."""


def _data(value: float, rows=(1, 5, 9)) -> TensorDataset:
    global FEATURES
    g = torch.Generator().manual_seed(0)
    FEATURES = torch.randn(64, 4, generator=g)
    y = (FEATURES[:, 0] > 0).long()
    for r in rows:  # in the first batch (the probe's examples) and later ones; not one another's near copies
        FEATURES[r, 2] = value / (1 + r)
    return TensorDataset(FEATURES, y)


@pytest.mark.parametrize("engine", ["ghost", "vmap", "opacus_hooks"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 3e38], ids=["inf", "nan", "3e38"])
def test_a_non_finite_record_trains_and_leaves_the_weights_finite(engine, value):
    model = Classifier()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, per_sample=engine)
    trainer = quiet_trainer(strategy=strategy, max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(_data(value), batch_size=16))
    assert not _reported(caught)  # how many records are not finite is the data's: not reported
    assert trainer.global_step == 4 and strategy.ledger.steps == 4
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _reported(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "not finite" in str(w.message)]


def test_a_plain_loop_over_non_finite_records_stays_finite():
    data = _data(float("inf"), rows=range(0, 64, 3))  # a third of the records: every batch holds some
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = PrivateStep(1.0, max_grad_norm=1.0, noise=GaussianNoise(), engine="ghost")
    step.attach(model, optimizer)
    loader = step.poisson_loader(DataLoader(data, batch_size=16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))
        for x, y in loader:
            if step.begin():
                F.cross_entropy(model(x), y).backward()
            step.release(optimizer=optimizer)
            optimizer.step()
            optimizer.zero_grad()
    assert not _reported(caught)
    assert step.steps_taken == len(loader) > 0
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_sum_left_non_finite_is_refused_before_the_noise():
    p = nn.Parameter(torch.zeros(3))
    finite = ClippedBatch({p: torch.ones(3)}, None, torch.tensor([1.0, 2.0]), 2)
    check_finite_release(finite, [p], "ghost")
    left_out = ClippedBatch({p: torch.ones(3)}, None, torch.tensor([1.0, float("nan")]), 2)
    check_finite_release(left_out, [p], "ghost")  # a norm not finite, its example left out: released
    poisoned = ClippedBatch({p: torch.tensor([1.0, float("nan"), 0.0])}, None, torch.tensor([1.0, float("inf")]), 2)
    with pytest.raises(PrivacyConfigurationError, match="not finite"):
        check_finite_release(poisoned, [p], "ghost")


def _standardised_batch(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A collate_fn standardising each batch by its own mean and (unbiased) std: NaN on a batch of one."""
    x = torch.stack([a for a, _ in items])
    return (x - x.mean(0)) / (x.std(0) + 1e-6), torch.stack([b for _, b in items])


def test_a_batch_standardised_in_the_collate_is_refused_naming_the_batch_statistic():
    """zoo31 c02: refused as "not finite" on the probe's first example, the text named only the model's forward."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16, collate_fn=_standardised_batch)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)not finite.*statistic over the batch's examples"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0),
                      max_steps=2).fit(Classifier(), loader)
