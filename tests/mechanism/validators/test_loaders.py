"""Which training loaders Poisson sampling may replace (validators/loaders.py), and end to end."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.mechanism.validators.loaders import training_population


def _data(n: int = 40) -> TensorDataset:
    x = torch.randn(n, 4)
    return TensorDataset(x, (x[:, 0] > 0).long())


def test_plain_loaders_use_the_whole_dataset():
    for dl in (DataLoader(_data(), batch_size=5, shuffle=True), DataLoader(_data(), batch_size=5)):
        pop = training_population(dl)
        assert (pop.indices, pop.num_samples, pop.batch_size) == (None, 40, 5)


def test_subset_random_sampler_is_the_population():
    pop = training_population(DataLoader(_data(), batch_size=4, sampler=SubsetRandomSampler(range(10, 30))))
    assert list(pop.indices) == list(range(10, 30)) and pop.num_samples == 20


def test_batch_sampler_gives_its_batch_size():
    dl = DataLoader(_data(), batch_sampler=BatchSampler(RandomSampler(_data()), batch_size=7, drop_last=False))
    assert training_population(dl).batch_size == 7


@pytest.mark.parametrize("make,match", [
    (lambda d: DataLoader(d, batch_size=4, sampler=WeightedRandomSampler(torch.ones(40), 40)), "WeightedRandomSampler"),
    (lambda d: DataLoader(d, batch_size=4, sampler=RandomSampler(d, replacement=True)), "replacement"),
    (lambda d: DataLoader(d, batch_sampler=[[0, 1], [2, 3]]), "custom batch sampler"),
    (lambda d: DataLoader(d, batch_size=4, sampler=SubsetRandomSampler([1, 1, 2])), "twice"),
])
def test_samplers_poisson_cannot_stand_in_for_are_refused(make, match):
    with pytest.raises(PrivacyConfigurationError, match=match):
        training_population(make(_data()))


class _Evens(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return self.n // 2


def test_custom_sampler_is_refused_naming_the_fix():
    with pytest.raises(PrivacyConfigurationError, match="Subset"):
        training_population(DataLoader(_data(), batch_size=4, sampler=_Evens(40)))


class _SeenExamples(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.update(int(v) for v in x[:, 3].round())
        return super().training_step((x, y), batch_idx)


def test_held_out_examples_are_never_trained_on():
    """A SubsetRandomSampler split: Poisson sampling over the train indices only, N = their number."""
    n = 60
    x = torch.randn(n, 4)
    x[:, 3] = torch.arange(n, dtype=torch.float32)  # the example's own index, to see who was trained on
    data = TensorDataset(x, (x[:, 0] > 0).long())
    train = list(range(20, 60))  # not a prefix: positions must be mapped to these indices
    model, strategy = _SeenExamples(), DPStrategy(noise_multiplier=1.0, sampler_seed=0, public_state=["seen"])
    quiet_trainer(strategy=strategy, max_epochs=3).fit(model, DataLoader(data, batch_size=10,
                                                                         sampler=SubsetRandomSampler(train)))
    assert strategy.num_samples == 40 and strategy.sample_rate == pytest.approx(0.25)
    assert model.seen and model.seen <= set(train)
    assert len(model.seen) > 30  # the split is honoured, not merely a few examples drawn


def test_batch_sampler_of_seven_trains_with_expected_batch_seven():
    data = _data(70)
    dl = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), batch_size=7, drop_last=False))
    strategy = DPStrategy(noise_multiplier=1.0)
    quiet_trainer(strategy=strategy, max_steps=3).fit(TinyClassifier(), dl)
    assert strategy.expected_batch_size == 7 and strategy.ledger.steps == 3


def test_weighted_sampler_is_refused_by_the_strategy():
    data = _data()
    dl = DataLoader(data, batch_size=4, sampler=WeightedRandomSampler(torch.ones(40), 40))
    with pytest.raises(PrivacyConfigurationError, match="WeightedRandomSampler"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=1).fit(TinyClassifier(), dl)
