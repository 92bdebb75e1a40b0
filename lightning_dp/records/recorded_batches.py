"""The sampler's own account of each step's examples: how many, and which.

The mechanism must know how many examples a step holds to verify every layer's example
dimension (:mod:`~lightning_dp.validators.example_dim`). Reading it from the batch
(the first tensor's leading dimension) would assume what is being verified: a time-major
collate gives ``[T, B]``. The batch sampler knows: :class:`RecordedBatches` keeps each batch's
indices, in order, until the training step takes them. Batch samplers run in the main process
even with loader workers, and batches arrive in the order their indices were drawn, so a queue
matches prefetched batches to steps; a new epoch (a new iterator) discards what an interrupted
epoch left (``limit_train_batches``).

A sampler that counts its steps (``inner.step``: the banded group cycle of
:class:`~lightning_dp.privacy.min_sep_sampling.MinSepPoissonBatchSampler`) starts each pass at ``next_index()``, the
index the mechanism gives its next release, so draws dropped unreleased (prefetched by an interrupted epoch) or a
state restored since the loader was built (``PrivateStep.load_state_dict``) never shift the cycle; each batch keeps
the index it was drawn at (:attr:`RecordedBatches.index`, checked at the release:
:mod:`~lightning_dp.validators.step_index`).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator, Optional, Sequence

from torch.utils.data import Sampler

from lightning_dp.errors import PrivacyConfigurationError


class RecordedBatches(Sampler[list[int]]):
    """Wraps a batch sampler of positions ``0..N-1``; yields dataset indices and records them.

    Args:
        inner: the batch sampler (e.g. Poisson) over positions in the population.
        population: dataset index of each position (``None``: position = dataset index), e.g.
            the indices of the user's ``SubsetRandomSampler``.
        next_index: the index of the next release, where a sampler counting its steps starts each pass.
    """

    def __init__(self, inner: Sampler[list[int]], population: Optional[Sequence[int]] = None,
                 next_index: Optional[Callable[[], int]] = None) -> None:
        self.inner = inner
        self.population = None if population is None else list(population)
        self.next_index = next_index
        self._queue: deque[list[int]] = deque()
        self._drawn_at: deque[Optional[int]] = deque()  # the sampler's step index of each queued batch
        self.index: Optional[int] = None
        """The sampler's step index of the batch taken last (``None``: a sampler without a step count)."""
        self._delivered: deque[Any] = deque()  # batches the loader handed the loop, not yet taken (DeliveringLoader)
        self.batch: Any = None
        """The batch the loader handed the loop for the indices taken last (``None``: not known)."""

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        self._queue.clear()
        self._drawn_at.clear()
        counts = hasattr(self.inner, "step")
        if counts and self.next_index is not None:
            self.inner.step = self.next_index()  # type: ignore[attr-defined]
        for batch in self.inner:
            indices = batch if self.population is None else [self.population[i] for i in batch]
            self._queue.append(indices)
            self._drawn_at.append(self.inner.step - 1 if counts else None)  # type: ignore[attr-defined]
            yield indices

    def restart(self) -> None:
        """The loader starts a new pass: batches handed out before are not taken any more."""
        self._delivered.clear()

    def delivered(self, batch: Any) -> None:
        """The loader handed ``batch`` to the loop (:class:`~lightning_dp.records.collate.DeliveringLoader`)."""
        self._delivered.append(batch)

    def take(self, delivered: bool = False) -> list[int]:
        """The dataset indices of the oldest batch not yet taken (the batch being trained on now); ``delivered``: only
        a batch the loader already handed to the loop may be taken (a plain loop's: not one only prefetched), once."""
        if delivered and not self._delivered:
            raise PrivacyConfigurationError(
                "step.begin() found no batch the Poisson loader handed to the loop that was not taken already: the "
                "ledger charges every release at the Poisson rate q, which holds only for a batch the private loader "
                "drew, released once. A batch reused for a second release, or a batch from a DataLoader of one's own, "
                "would be charged as drawn when it was not. Nothing was released. Iterate the loader poisson_loader() "
                "returned and call step.begin() once for each batch it yields.")
        if not self._queue:
            raise PrivacyConfigurationError(
                "A training step ran on a batch its Poisson sampler did not draw: the step's closure ran twice for one "
                "batch (a sharpness-aware optimizer, SAM, calling optimizer_closure again in optimizer_step) or a "
                "loop of one's own called the step without drawing. Each run of the closure is a release on data "
                "sampled once: the accounting would not hold. Nothing more was released. Run the closure once per "
                "step (optimizer.step(closure=optimizer_closure)).")
        self.batch = self._delivered.popleft() if self._delivered else None
        self.index = self._drawn_at.popleft() if self._drawn_at else None
        return self._queue.popleft()

    def first_indices(self, k: int, num_samples: int, rank: int = 0, world_size: int = 1) -> list[int]:
        """The first k dataset indices of shard ``rank`` of the ``num_samples`` positions (a fixed,
        public choice, independent of who was sampled: the probe's examples)."""
        chosen = list(range(rank, num_samples, world_size))[:k]
        return chosen if self.population is None else [self.population[i] for i in chosen]

    def positions(self, chosen: Sequence[int]) -> list[int]:
        """The dataset indices of population positions ``chosen``."""
        return list(chosen) if self.population is None else [self.population[i] for i in chosen]
