"""Interactions a random draw switches on (validators/batch_check.py, records/generator_states.py): MixUp applied with a
probability, tossed from torch's, NumPy's or Python's generator in ``training_step`` or in the collate. The batch
check tosses the real step's own coin (every step whose coin lands is refused before its release) and, for a step
that draws at all, other seeds besides; examples kept apart by their draws (per-example noise, crops, label smoothing,
dropout) still train."""

from __future__ import annotations

import random
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[1] / "privacy" / "boundary"))
from cases import Classifier, parameters, unchanged  # noqa: E402

from lightning_dp import DPStrategy, PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators import schedule  # noqa: E402

P = 0.1  # a rare coin: the check's own seed (0) never lands it for any of the three generators

COINS = {"torch": lambda: float(torch.rand(())), "numpy": lambda: float(np.random.rand()),
         "python": lambda: random.random()}


def data(n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def run(model, dataset=None, steps=2, collate_fn=None, **kwargs):
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, **kwargs)
    loader = DataLoader(dataset if dataset is not None else data(), batch_size=32, collate_fn=collate_fn)
    quiet_trainer(strategy=strategy, max_steps=steps).fit(model, loader)
    return strategy


@pytest.fixture
def seeded_checks(monkeypatch):
    """The checks' own choices (which examples, which other seeds) from a fixed seed: the outcome is deterministic."""
    monkeypatch.setattr(schedule, "random", types.SimpleNamespace(Random=lambda: random.Random(3)))


def mix(x, y):
    perm = torch.arange(len(x)).flip(0)
    return 0.7 * x + 0.3 * x[perm], y, y[perm]


class CoinMixUp(Classifier):
    """timm's Mixup(prob=P): the batch is mixed when a coin from ``generator`` lands under P."""

    def __init__(self, generator: str) -> None:
        super().__init__()
        self.coin = COINS[generator]
        self.states: dict[int, object] = {}  # the step's NumPy state as its training_step finds it

    def on_train_batch_start(self, batch, batch_idx):
        self.states[self.global_step] = (torch.get_rng_state(), np.random.get_state(), random.getstate())

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.coin() < P:
            x, y, other = mix(x, y)
            logits = self(x)
            return 0.7 * F.cross_entropy(logits, y) + 0.3 * F.cross_entropy(logits, other)
        return F.cross_entropy(self(x), y)


def landed(model: CoinMixUp, step: int) -> bool:
    """Whether the real step ``step``'s coin landed (its generators' states as its training_step found them)."""
    cpu, numpy_state, python_state = model.states[step]
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    torch.set_rng_state(cpu)
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    try:
        return model.coin() < P
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


@pytest.mark.parametrize("generator", sorted(COINS))
def test_the_check_tosses_the_real_steps_own_coin(generator, monkeypatch):
    """No other seed (k = 0), every step checked: the run is refused at exactly the first step whose own coin lands,
    and every step before it, released, did not mix."""
    monkeypatch.setattr("lightning_dp.validators.step_checks.FIRST_DRAWS", 0)
    monkeypatch.setattr("lightning_dp.validators.step_checks.LATER_DRAWS", 0)
    model = CoinMixUp(generator)
    model.states.clear()
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step (\d+).*a random draw switches "
                                                        r"an interaction on") as info:
        run(model, steps=60, verify="every_step", public_state=["states"])
    refused = int(re.search(r"at step (\d+)", str(info.value)).group(1))
    assert landed(model, refused)
    assert not any(landed(model, step) for step in range(refused))


@pytest.mark.parametrize("generator", sorted(COINS))
def test_a_coin_the_first_step_does_not_land_is_refused_at_the_first_step(generator, seeded_checks):
    """The real first step's coin does not land (seeds chosen so): the other seeds' rounds land it before any
    release."""
    model = CoinMixUp(generator)
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 0.*a random draw switches an "
                                                        r"interaction on"):
        run(model, public_state=["states"])
    assert not landed(model, 0)
    assert unchanged(before, model), "a release happened"


class RandomChoiceMix:
    """torchvision v2's RandomChoice([MixUp, Identity]) in the collate, from Python's generator."""

    def __call__(self, items):
        x = torch.stack([a for a, _ in items])
        y = F.one_hot(torch.stack([b for _, b in items]), 2).float()
        if random.random() < P:
            x, y, other = mix(x, y)
            y = 0.7 * y + 0.3 * other
        return x, y


class SoftTargets(Classifier):
    def training_step(self, batch, batch_idx):
        x, t = batch
        return torch.sum(-t * F.log_softmax(self(x), -1), -1).mean()


def test_a_coin_in_the_collate_is_refused(seeded_checks):
    model = SoftTargets()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"a random draw switches an interaction on"):
        run(model, collate_fn=RandomChoiceMix())
    assert unchanged(before, model), "a release happened"


class NoisyInputs(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x + 0.1 * torch.randn_like(x)), y)


class RandomCrop(Classifier):
    """A random shift of each example's features (a crop per example) and, sometimes, a flip of all of them."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        shifts = torch.randint(0, 4, (len(x),))
        x = torch.stack([row.roll(int(s)) for row, s in zip(x, shifts)])
        if np.random.rand() < 0.5:
            x = x.flip(1)
        return F.cross_entropy(self(x), y)


class RandomSmoothing(Classifier):
    """Label smoothing with a random strength per example."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        eps = 0.2 * torch.rand(len(x), 1)
        target = (1 - eps) * F.one_hot(y, 2).float() + eps / 2
        return torch.sum(-target * F.log_softmax(self(x), -1), -1).mean()


class Dropout(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 2))


@pytest.mark.filterwarnings("ignore::lightning_dp.errors.RandomStepWarning")
@pytest.mark.parametrize("factory", [NoisyInputs, RandomCrop, RandomSmoothing, Dropout])
def test_draws_that_keep_examples_apart_train(factory):
    strategy = run(factory(), steps=4, verify="every_step")
    assert strategy.ledger.steps == 4


class HookCoin(CoinMixUp):
    """The coin tossed in on_train_batch_start (a callback deciding per batch), MixUp applied in training_step."""

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.mixing = self.coin() < P

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.mixing:
            x, y, other = mix(x, y)
            logits = self(x)
            return 0.7 * F.cross_entropy(logits, y) + 0.3 * F.cross_entropy(logits, other)
        return F.cross_entropy(self(x), y)


def test_a_coin_tossed_in_the_batch_start_hook_is_the_real_steps_too(monkeypatch):
    """The passes start from the generators as the step began and replay its batch-start hook: the hook's coin too."""
    monkeypatch.setattr("lightning_dp.validators.step_checks.FIRST_DRAWS", 0)
    monkeypatch.setattr("lightning_dp.validators.step_checks.LATER_DRAWS", 0)
    model = HookCoin("numpy")
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step (\d+)") as info:
        run(model, steps=60, verify="every_step", public_state=["states", "mixing"])
    refused = int(re.search(r"at step (\d+)", str(info.value)).group(1))
    assert landed(model, refused)
    assert not any(landed(model, step) for step in range(refused))
