"""The first step's probe on an ill-conditioned float32 model (validators/probe.py, ``_judged``): round-off that the
input's scale amplifies is judged again in float64, an interaction at the same scale is still refused."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.grad_sample import make_engine
from lightning_dp.validators.probe import ExampleIndependenceProbe, probe_tolerance

SCALE = 1000.0  # raw features in the thousands (incomes, prices): a tanh after the first layer saturates
SEEDS = (87, 90, 130, 210)  # initialisations whose float32 round-off, batch of 6 against alone, exceeds 64 ulps


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).long()


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _probe(net, loss_of, engine="ghost"):
    attached = make_engine(engine)
    attached.attach(net)
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    ExampleIndependenceProbe(net, attached, [p for _, p in named], [n for n, _ in named], loss_of,
                             probe_tolerance(torch.float32, False)).run(list(range(6)))


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_amplified_round_off_of_independent_examples_is_not_an_interaction(engine):
    x, y = _data()
    for seed in SEEDS:
        net = _net(seed)
        _probe(net, lambda idx: F.cross_entropy(net(x[idx] * SCALE), y[idx]), engine)


def test_an_interaction_at_the_same_scale_is_still_refused():
    x, y = _data()
    for seed in SEEDS:
        net = _net(seed)

        def loss_of(idx):
            h = torch.tanh(net[0](x[idx] * SCALE))
            return F.cross_entropy(net[2](h - h.mean(0)), y[idx])  # a batch-wide normalisation

        with pytest.raises(PrivacyConfigurationError, match="Examples interact"):
            _probe(net, loss_of)


def test_a_small_interaction_at_the_same_scale_is_still_refused():
    """A coupling of a few τ (within the window judged again) is still there in float64, and refused."""
    x, y = _data()
    net = _net(SEEDS[0])

    def loss_of(idx):
        out = net(x[idx] * SCALE)
        return F.cross_entropy(out + 1e-4 * out.mean(0), y[idx])

    with pytest.raises(PrivacyConfigurationError, match="Examples interact"):
        _probe(net, loss_of)


def test_an_interaction_only_float32_computes_is_refused_beyond_the_window():
    """Code that interacts only when it computes in float32 (the float64 replay finds nothing): refused, as float32
    saw it farther than the window."""
    x, y = _data()
    net = _net(SEEDS[0])

    def loss_of(idx):
        out = net(x[idx] * SCALE)
        if out.dtype == torch.float32:
            out = out + 0.1 * out.mean(0)
        return F.cross_entropy(out, y[idx])

    with pytest.raises(PrivacyConfigurationError, match="Examples interact"):
        _probe(net, loss_of)


class Unfrozen(pl.LightningModule):
    """The zoo's setup: features ×1000, the first layer frozen in ``__init__`` and trainable again from step 2 (the
    probe runs again then, on the layer whose gradient the scale amplifies)."""

    def __init__(self, seed):
        super().__init__()
        self.net = _net(seed)
        self.net[0].requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x * SCALE), y)

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == 2:
            self.net[0].requires_grad_(True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # lr 0: the weights at the second probe are the seed's


def test_a_frozen_first_layer_on_features_in_the_thousands_trains_when_unfrozen():
    torch.manual_seed(0)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    trainer = quiet_trainer(strategy=strategy, max_steps=4)
    trainer.fit(Unfrozen(SEEDS[0]), DataLoader(TensorDataset(*_data()), batch_size=16))
    assert trainer.global_step == 4
