"""b-min-separated (cyclic Poisson) sampling: group t mod b only, within-group rate q_g, cycle survives epochs."""

import math

import numpy as np
import pytest

from lightning_dp.privacy.sampling import PoissonBatchSampler
from lightning_dp.privacy.min_sep_sampling import (
    MinSepPoissonBatchSampler,
    group_sample_rate,
    min_sep_expected_batch_size,
    min_sep_steps_per_epoch,
)


def _run(sampler, epochs):
    return [batch for _ in range(epochs) for batch in sampler]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_examples_only_appear_in_their_groups_steps(world_size):
    n, b, epochs = 200, 3, 3
    for rank in range(world_size):
        sampler = MinSepPoissonBatchSampler(n, 0.5, 7, bands=b, rank=rank, world_size=world_size, seed=rank)
        last_seen = {}
        for t, batch in enumerate(_run(sampler, epochs)):  # 7 steps per epoch: the cycle must continue across epochs
            for i in batch:
                assert i % world_size == rank
                assert sampler.group_of(i) == t % b
                assert t - last_seen.get(i, -b) >= b  # min separation, directly
                last_seen[i] = t
        assert sampler.step == 7 * epochs


def test_groups_partition_the_dataset_across_ranks():
    n, b, world = 103, 4, 3
    samplers = [MinSepPoissonBatchSampler(n, 0.1, 4, b, rank=r, world_size=world, seed=0) for r in range(world)]
    members = [[i for s in samplers for i in s.groups[g].tolist()] for g in range(b)]
    flat = sorted(i for group in members for i in group)
    assert flat == list(range(n))  # every example in exactly one group
    sizes = [len(group) for group in members]
    assert max(sizes) - min(sizes) <= world  # balanced up to one per shard


def test_per_step_inclusion_rate_is_the_group_rate():
    n, b, q, steps = 3000, 3, 0.3, 60
    sampler = MinSepPoissonBatchSampler(n, q, steps_per_epoch=steps, bands=b, seed=1)
    counts = np.zeros((b, n))
    for t, batch in enumerate(sampler):
        counts[t % b, batch] += 1
    visits = steps // b
    for g in range(b):
        in_group = np.array([sampler.group_of(i) == g for i in range(n)])
        assert counts[g, ~in_group].sum() == 0  # nobody outside the active group
        trials = visits * in_group.sum()
        rate = counts[g, in_group].sum() / trials
        assert abs(rate - q) < 5 * math.sqrt(q * (1 - q) / trials)
        # a wrong rate (e.g. the global q/b or q·b) would be far outside
        assert abs(rate - q / b) > 10 * math.sqrt(q * (1 - q) / trials)


def test_expected_batch_is_group_rate_times_group_size():
    n, b, q = 6000, 4, 0.2
    sampler = MinSepPoissonBatchSampler(n, q, steps_per_epoch=400, bands=b, seed=2)
    sizes = np.array([len(batch) for batch in sampler])
    expected = min_sep_expected_batch_size(n, q, b)
    assert expected == pytest.approx(q * n / b)
    assert abs(sizes.mean() - expected) < 5 * math.sqrt(expected * (1 - q) / len(sizes))


def test_one_band_is_plain_poisson_sampling():
    a = MinSepPoissonBatchSampler(500, 0.1, 20, bands=1, rank=1, world_size=2, seed=7)
    p = PoissonBatchSampler(500, 0.1, 20, rank=1, world_size=2, seed=7)
    assert list(a) == list(p)


def test_state_dict_continues_the_group_cycle():
    b = 4
    first = MinSepPoissonBatchSampler(100, 1.0, steps_per_epoch=6, bands=b, seed=0)
    list(first)
    resumed = MinSepPoissonBatchSampler(100, 1.0, steps_per_epoch=6, bands=b, seed=1)
    resumed.load_state_dict(first.state_dict())
    batch = next(iter(resumed))
    assert {resumed.group_of(i) for i in batch} == {6 % b}  # not group 0
    with pytest.raises(ValueError, match="bands"):
        MinSepPoissonBatchSampler(100, 1.0, 6, bands=3).load_state_dict(first.state_dict())


def test_helpers():
    assert group_sample_rate(50, 1000, 4) == pytest.approx(0.2)
    assert group_sample_rate(50, 1000, 1) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="exceeds N"):
        group_sample_rate(300, 1000, 4)
    assert min_sep_steps_per_epoch(0.2, 4) == 20  # each of 4 groups visited 5 times: N examples per epoch
    assert min_sep_steps_per_epoch(0.2, 4) % 4 == 0


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="bands"):
        MinSepPoissonBatchSampler(10, 0.5, 4, bands=0)
    with pytest.raises(ValueError, match="exceeds num_samples"):
        MinSepPoissonBatchSampler(3, 0.5, 4, bands=4)
    with pytest.raises(ValueError, match="within-group"):
        MinSepPoissonBatchSampler(10, 1.5, 4, bands=2)
    with pytest.raises(ValueError, match="shard"):
        MinSepPoissonBatchSampler(10, 0.5, 4, bands=2, rank=0, world_size=2).group_of(3)
