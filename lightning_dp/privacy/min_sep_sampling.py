"""b-min-separated participation ("cyclic Poisson"): the sampling scheme banded DP-MF needs.

docs/algorithms.md §7; Choquette-Choo et al. 2023, "(Amplified) banded matrix factorization",
arXiv 2306.08153, Alg. 2 / Thm. 5. The data are split into b fixed groups; logical step t
Poisson-samples group t mod b only, each of its members independently with the *group* rate
q_g. An example of group g can therefore appear only in steps t ≡ g (mod b): any two of its
participations are ≥ b steps apart, so they hit disjoint rows of a b-banded strategy
(:mod:`lightning_dp.accounting.banded`). The expected global batch is q_g · N / b.

The partition is public and deterministic (it need not be secret; the analysis holds for any
fixed partition): within each rank's shard (indices ``rank, rank + world, …`` as in
:class:`~lightning_dp.privacy.sampling.PoissonBatchSampler`), the k-th index goes to group
k mod b. Who is sampled inside the active group is secret (private generator).

The group cycle is driven by a step counter that continues across epochs and must continue
across a resume (:meth:`MinSepPoissonBatchSampler.state_dict`): restarting it at 0 mid-run
could put two participations of an example less than b steps apart.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch.utils.data import Sampler

from lightning_dp.accounting.banded_coefficients import check_bands
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.secure_random import secure_seed, secure_uniform


class FrozenSampler(Sampler[list[int]]):
    """A sampler whose settings are the mechanism's: once built, only its step counter may be set. The ledger charges
    the plan's q; a rate, population or group set on the sampler afterwards (from the loss, at a batch's end) would
    draw at another q than the one charged (zoo16 smp1)."""

    def _freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "step" and getattr(self, "_frozen", False):
            raise PrivacyConfigurationError(
                f"The Poisson sampler's {name!r} is the mechanism's: the ledger charges the rate it was built with, "
                "so it is not set during a fit. Choose the batch size (hence q) before fit(), or declare another run.")
        object.__setattr__(self, name, value)


class MinSepPoissonBatchSampler(FrozenSampler):
    """Yields ``steps_per_epoch`` batches; batch t holds each member of group t mod b with probability q_g.

    Args:
        num_samples: size N of the dataset.
        sample_rate: q_g in (0, 1], the within-group Poisson rate (see :func:`group_sample_rate`).
        steps_per_epoch: number of batches per epoch (see :func:`min_sep_steps_per_epoch`).
        bands: b ≥ 1, the number of groups (= bands of the strategy; b = 1 is plain Poisson
            sampling, batch for batch the same as ``PoissonBatchSampler`` with the same seed).
        rank: this process's shard (0 for a single process).
        world_size: number of shards.
        seed: seed of the sampler's private generator; ``None`` draws one from the OS.
            Batch membership is secret: never derive it from a public seed in production.
        secure: draw the inclusion uniforms from the OS's CSPRNG (:mod:`.csprng`) instead of a
            seeded torch generator (``seed`` must then be ``None``).

    Example:
        >>> s = MinSepPoissonBatchSampler(100, 0.5, steps_per_epoch=8, bands=4, seed=0)
        >>> all(i % 4 == t % 4 for t, batch in enumerate(s) for i in batch)
        True
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int,
        bands: int,
        rank: int = 0,
        world_size: int = 1,
        seed: Optional[int] = None,
        secure: bool = False,
    ) -> None:
        if secure and seed is not None:
            raise ValueError("a secure sampler draws from the OS's CSPRNG: it takes no seed")
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate (the within-group rate q_g) must be in (0, 1], got {sample_rate}")
        if steps_per_epoch <= 0:
            raise ValueError(f"steps_per_epoch must be positive, got {steps_per_epoch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.bands = check_bands(bands)
        if self.bands > num_samples:
            raise ValueError(f"bands={bands} exceeds num_samples={num_samples}: some groups would be empty")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps_per_epoch = steps_per_epoch
        self.rank = rank
        self.world_size = world_size
        shard = torch.arange(rank, num_samples, world_size)
        self.groups: tuple[torch.Tensor, ...] = tuple(shard[g :: self.bands] for g in range(self.bands))
        self.step = 0
        self.secure = secure
        self._generator = torch.Generator().manual_seed(secure_seed() if seed is None else seed)
        self._freeze()

    def group_of(self, index: int) -> int:
        """The group of dataset index ``index`` (must belong to this rank's shard)."""
        if not 0 <= index < self.num_samples or index % self.world_size != self.rank:
            raise ValueError(f"index {index} is not in shard {self.rank} of {self.world_size}")
        return (index // self.world_size) % self.bands

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps_per_epoch):
            members = self.groups[self.step % self.bands]
            count = len(members)
            uniforms = secure_uniform(count) if self.secure else torch.rand(count, generator=self._generator)
            keep = uniforms < self.sample_rate
            self.step += 1
            yield members[keep].tolist()

    def state_dict(self) -> dict[str, Any]:
        """The step counter (which group comes next); never the generator (membership is secret)."""
        return {"step": self.step, "bands": self.bands}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the group cycle of a checkpointed run (``ValueError`` if b differs)."""
        if int(state["bands"]) != self.bands:
            raise ValueError(f"checkpoint sampler used bands={state['bands']}, this one bands={self.bands}")
        self.step = int(state["step"])


def group_sample_rate(batch_size: float, num_samples: int, bands: int) -> float:
    """q_g = b · B / N: the within-group rate giving an expected global batch B (b = 1: q = B/N).

    Raises ``ValueError`` when b · B > N (a group is smaller than the batch asked for).
    """
    bands = check_bands(bands)
    if num_samples <= 0 or batch_size <= 0:
        raise ValueError(f"batch_size and num_samples must be positive, got {batch_size}, {num_samples}")
    rate = bands * batch_size / num_samples
    if rate > 1.0:
        raise ValueError(
            f"bands × batch_size = {bands} × {batch_size} exceeds N = {num_samples}: each of the b groups holds only "
            f"N/b examples; lower bands or the batch size"
        )
    return float(rate)


def min_sep_steps_per_epoch(sample_rate: float, bands: int) -> int:
    """Steps per epoch visiting N examples in expectation: b · round(1/q_g), a multiple of b
    (every group is visited equally often in each epoch)."""
    bands = check_bands(bands)
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    return bands * max(1, round(1.0 / sample_rate))


def min_sep_expected_batch_size(num_samples: int, sample_rate: float, bands: int) -> float:
    """The expected global batch B = q_g · N / b, the public divisor of the mechanism."""
    return sample_rate * num_samples / check_bands(bands)


__all__ = [
    "MinSepPoissonBatchSampler",
    "group_sample_rate",
    "min_sep_expected_batch_size",
    "min_sep_steps_per_epoch",
]
