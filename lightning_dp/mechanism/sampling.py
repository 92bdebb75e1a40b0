"""Poisson sampling: every example joins every step's batch independently with rate q.

Privacy amplification by subsampling (the accountants' "sampled Gaussian mechanism")
assumes exactly this scheme. Batch sizes are therefore random (Binomial(N, q)) and may
be zero; the mechanism divides by the *expected* batch B = qN, never the realised one.

Under data parallelism each rank samples only the examples of its own shard
(indices ``rank, rank + world, ...``) with the same q: every example is still included
independently with probability q exactly once per step, globally.
"""

from __future__ import annotations

import os
from typing import Iterator, Optional

import torch
from torch.utils.data import Sampler


def secure_seed() -> int:
    """A 63-bit seed from the operating system's entropy pool."""
    return int.from_bytes(os.urandom(8), "little") >> 1


class PoissonBatchSampler(Sampler[list[int]]):
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
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if steps_per_epoch <= 0:
            raise ValueError(f"steps_per_epoch must be positive, got {steps_per_epoch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps_per_epoch = steps_per_epoch
        self.rank = rank
        self.world_size = world_size
        self._indices = torch.arange(rank, num_samples, world_size)
        self._generator = torch.Generator().manual_seed(secure_seed() if seed is None else seed)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps_per_epoch):
            keep = torch.rand(len(self._indices), generator=self._generator) < self.sample_rate
            yield self._indices[keep].tolist()


def steps_per_epoch_for(sample_rate: float) -> int:
    """Batches per epoch so that an epoch visits N examples in expectation: round(1/q)."""
    return max(1, round(1.0 / sample_rate))
