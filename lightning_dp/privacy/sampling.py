"""Poisson sampling: every example joins every step's batch independently with rate q.

Privacy amplification by subsampling (the accountants' "sampled Gaussian mechanism")
assumes exactly this scheme. Batch sizes are therefore random (Binomial(N, q)) and may
be zero; the mechanism divides by the *expected* batch B = qN, never the realised one.

Under data parallelism each rank samples only the examples of its own shard
(indices ``rank, rank + world, ...``) with the same q: every example is still included
independently with probability q exactly once per step, globally.

Plain Poisson sampling is the one-group case of b-min-separated sampling
(:class:`~lightning_dp.privacy.min_sep_sampling.MinSepPoissonBatchSampler`), which
implements both.
"""

from __future__ import annotations

from typing import Optional

from lightning_dp.privacy.min_sep_sampling import MinSepPoissonBatchSampler
from lightning_dp.secure_random import secure_seed

__all__ = ["PoissonBatchSampler", "secure_seed", "steps_per_epoch_for"]


class PoissonBatchSampler(MinSepPoissonBatchSampler):
    """Yields ``steps_per_epoch`` batches of indices, each index kept with probability q.

    Args:
        num_samples: size N of the dataset.
        sample_rate: q in (0, 1].
        steps_per_epoch: number of batches per epoch (usually round(1/q)).
        rank: this process's shard (0 for a single process).
        world_size: number of shards.
        seed: seed of the sampler's private generator; ``None`` draws one from the OS.
            Batch membership is secret: never derive it from a public seed in production.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: Optional[int] = None,
    ) -> None:
        super().__init__(num_samples, sample_rate, steps_per_epoch, 1, rank, world_size, seed)


def steps_per_epoch_for(sample_rate: float) -> int:
    """Batches per epoch so that an epoch visits N examples in expectation: round(1/q)."""
    return max(1, round(1.0 / sample_rate))
