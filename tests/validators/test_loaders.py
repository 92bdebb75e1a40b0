"""Which training loaders Poisson sampling may replace (validators/loaders.py), and end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.validators.loaders import training_population

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier as Small  # noqa: E402


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


# ---------------------------------------------------------------- samplers whose data source is not the dataset
def _prefix(d: TensorDataset) -> Subset:
    return Subset(d, range(10))


@pytest.mark.parametrize("make,match", [
    (lambda d: DataLoader(d, batch_size=4, sampler=SequentialSampler(_prefix(d))),
     "SequentialSampler draws from another"),
    (lambda d: DataLoader(d, batch_size=4, sampler=RandomSampler(_prefix(d))), "RandomSampler draws from another"),
    (lambda d: DataLoader(d, batch_sampler=BatchSampler(SequentialSampler(_prefix(d)), 4, False)), "another dataset"),
    (lambda d: DataLoader(d, batch_size=4, sampler=DistributedSampler(_prefix(d), num_replicas=1, rank=0)),
     "DistributedSampler draws from another"),
    (lambda d: DataLoader(d, batch_size=4, sampler=DistributedSampler(d, num_replicas=2, rank=0)), "built for 2"),
    (lambda d: DataLoader(d, batch_size=4, sampler=DistributedSampler(d, num_replicas=3, rank=0, shuffle=False,
                                                                       drop_last=True)), "never draws the last 1"),
])
def test_samplers_over_other_records_are_refused_naming_the_fix(make, match):
    world = 3 if "last" in match else 1
    with pytest.raises(PrivacyConfigurationError, match=match) as err:
        training_population(make(_data()), rank=0, world_size=world)
    assert "Give the DataLoader the dataset" in str(err.value) or "Remove the DistributedSampler" in str(err.value)


def test_samplers_over_all_the_records_stand_for_the_whole_dataset():
    """A data source as long as the dataset reads all its positions; a DistributedSampler that is this rank's
    shard of it (as Lightning's is) stands for the whole dataset too."""
    data, twin = _data(), _data()
    for dl, rank, world in ((DataLoader(data, batch_size=4, sampler=RandomSampler(twin)), 0, 1),
                            (DataLoader(data, batch_size=4, sampler=SequentialSampler(range(40))), 0, 1),
                            (DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 2, rank=1)), 1, 2)):
        pop = training_population(dl, rank=rank, world_size=world)
        assert (pop.indices, pop.num_samples) == (None, 40)


def _fit_refused(dl: DataLoader, match: str) -> None:
    model = TinyClassifier()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match=match):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=2).fit(model, dl)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), "a release happened"


@pytest.mark.parametrize("make,match", [
    (lambda d: DataLoader(d, batch_size=4, sampler=SequentialSampler(_prefix(d))), "SequentialSampler draws from"),
    (lambda d: DataLoader(d, batch_size=4, sampler=RandomSampler(_prefix(d))), "RandomSampler draws from"),
    (lambda d: DataLoader(d, batch_size=4, sampler=RandomSampler(d, replacement=True)), "replacement"),
    (lambda d: DataLoader(d, batch_size=4, sampler=DistributedSampler(d, num_replicas=2, rank=0)), "built for 2"),
])
def test_the_strategy_sees_the_users_sampler_behind_lightnings(make, match):
    """Lightning puts its DistributedSampler(dataset) in place of a RandomSampler or SequentialSampler before the
    strategy sees the loader, and keeps a user's DistributedSampler: both used to be taken for the whole dataset."""
    _fit_refused(make(_data()), match)


def test_a_users_distributed_sampler_for_this_run_trains_on_the_whole_dataset():
    data = _data()
    strategy = DPStrategy(noise_multiplier=1.0, sampler_seed=0)
    quiet_trainer(strategy=strategy, max_steps=2).fit(
        TinyClassifier(), DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0)))
    assert strategy.num_samples == 40 and strategy.ledger.steps == 2


class _LoaderInHook(TinyClassifier):
    def train_dataloader(self):
        data = _data()
        return DataLoader(data, batch_size=4, sampler=SequentialSampler(_prefix(data)))


def test_a_prefix_sampler_from_train_dataloader_is_refused():
    with pytest.raises(PrivacyConfigurationError, match="SequentialSampler draws from another"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=2).fit(_LoaderInHook())


class _Curriculum(pl.LightningDataModule):
    """Rebuilds its training loader every epoch on the records the model finds easiest (``keep`` of them), or on all
    of them in that order (``keep=1``)."""

    def __init__(self, keep: float, seed: int = 0) -> None:
        super().__init__()
        self.keep = keep
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(seed))
        self.train_set = TensorDataset(x, (x[:, 0] > 0).long())

    def train_dataloader(self) -> DataLoader:
        x, y = self.train_set.tensors
        with torch.no_grad():
            losses = torch.nn.functional.cross_entropy(self.trainer.lightning_module(x), y, reduction="none")
        order = losses.argsort().tolist()
        return DataLoader(Subset(self.train_set, order[: int(self.keep * len(order))]), batch_size=16)


def test_a_population_chosen_again_each_epoch_is_refused_and_a_new_order_of_it_trains():
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, sampler_seed=0), max_steps=12,
                            reload_dataloaders_every_n_epochs=1)
    with pytest.raises(PrivacyConfigurationError, match="rebuilt on another set of the training dataset's records"):
        trainer.fit(Small(), datamodule=_Curriculum(0.75))
    strategy = DPStrategy(noise_multiplier=1.0, sampler_seed=0)
    quiet_trainer(strategy=strategy, max_steps=12, reload_dataloaders_every_n_epochs=1).fit(
        Small(), datamodule=_Curriculum(1.0, seed=1))  # other records: its own ledger
    assert strategy.ledger.steps == 12
