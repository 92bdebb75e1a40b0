"""The DP-SignSGD release of one step under data parallelism (ALGORITHMS.md §6).

Each rank is a worker: it clips its own Poisson batch per example, adds its OWN noise
σC to its sum, and sends only sign(·) as int8; the vote sign(Σ_m signs) is written to
``p.grad``. Unlike the noised-mean mechanism, every rank adds noise: privacy is per
worker, with respect to its local data, against an untrusted aggregator.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.mechanism.grad_sample.base import ClippedBatch
from lightning_dp.mechanism.sampling import secure_seed
from lightning_dp.mechanism.sign_vote import all_reduce_votes, worker_sign


class SignVotePrivatizer:
    """Writes the majority vote of the workers' noisy signs into ``p.grad``.

    Args:
        all_reduce: in-place SUM all-reduce of one tensor (``None`` for one worker).
        world_size: number of workers (ranks).
        seed: seed of this worker's noise generator (tests only; default from the OS).
    """

    def __init__(
        self, all_reduce: Optional[Callable[[Tensor], None]] = None, world_size: int = 1, seed: Optional[int] = None
    ) -> None:
        self.all_reduce = all_reduce
        self.world_size = world_size
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            seed = secure_seed() if self._seed is None else self._seed
            self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[device]

    def privatize(
        self, batch: ClippedBatch, params: Sequence[nn.Parameter], noise_multiplier: float, max_grad_norm: float
    ) -> None:
        """p.grad ← sign(Σ_m sign(S_m + σ C z_m)) for every parameter (ties give 0)."""
        signs = [
            worker_sign(batch.sums[p], noise_multiplier, max_grad_norm, self._generator(p.device)) for p in params
        ]
        if self.all_reduce is not None and self.world_size > 1:
            votes = all_reduce_votes(signs, all_reduce=self.all_reduce, world_size=self.world_size)
        else:
            votes = signs
        for p, vote in zip(params, votes):
            p.grad = vote.to(p.dtype)
