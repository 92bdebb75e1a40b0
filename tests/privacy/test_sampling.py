import math

import pytest
import torch
from scipy import stats

from lightning_dp.privacy.sampling import PoissonBatchSampler, steps_per_epoch_for


def test_batch_sizes_follow_binomial():
    n, q, steps = 500, 0.05, 4000
    sampler = PoissonBatchSampler(n, q, steps, seed=1)
    sizes = torch.tensor([len(b) for b in sampler], dtype=torch.float64)
    # Mean: z-test at 4.5 sigma; variance: chi-square-like bound on the sample variance.
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean().item() - mean) < 4.5 * math.sqrt(var / steps)
    ratio = sizes.var().item() / var
    lo, hi = stats.chi2.ppf([0.0005, 0.9995], steps - 1) / (steps - 1)
    assert lo < ratio < hi
    # Full distribution: goodness of fit over binned counts.
    counts = torch.bincount(sizes.long(), minlength=n + 1).numpy()
    ks = range(10, 41)
    expected = [stats.binom.pmf(k, n, q) * steps for k in ks]
    observed = [counts[k] for k in ks]
    rest_obs = steps - sum(observed)
    rest_exp = steps - sum(expected)
    chi = stats.chisquare(observed + [rest_obs], expected + [rest_exp])
    assert chi.pvalue > 1e-4


def test_each_example_included_independently_with_rate_q():
    n, q, steps = 50, 0.2, 5000
    hits = torch.zeros(n)
    for batch in PoissonBatchSampler(n, q, steps, seed=2):
        hits[batch] += 1
    rate = hits / steps
    assert (rate - q).abs().max().item() < 4.5 * math.sqrt(q * (1 - q) / steps)


def test_empty_batches_are_yielded_not_skipped():
    sampler = PoissonBatchSampler(10, 0.01, 200, seed=3)
    batches = list(sampler)
    assert len(batches) == 200
    assert sum(len(b) == 0 for b in batches) > 100


def test_shards_partition_the_dataset():
    n = 101
    seen = set()
    for rank in range(3):
        for batch in PoissonBatchSampler(n, 1.0, 1, rank=rank, world_size=3, seed=0):
            assert all(i % 3 == rank for i in batch)
            seen.update(batch)
    assert seen == set(range(n))


def test_unseeded_samplers_differ():
    a = list(PoissonBatchSampler(1000, 0.5, 1))
    b = list(PoissonBatchSampler(1000, 0.5, 1))
    assert a != b


@pytest.mark.parametrize("kwargs", [dict(sample_rate=0.0), dict(sample_rate=1.5), dict(num_samples=0), dict(steps_per_epoch=0)])
def test_bad_arguments(kwargs):
    args = dict(num_samples=10, sample_rate=0.1, steps_per_epoch=1)
    args.update(kwargs)
    with pytest.raises(ValueError):
        PoissonBatchSampler(**args)


def test_steps_per_epoch_covers_n_in_expectation():
    assert steps_per_epoch_for(0.1) == 10
    assert steps_per_epoch_for(0.03) == 33
    assert steps_per_epoch_for(1.0) == 1
