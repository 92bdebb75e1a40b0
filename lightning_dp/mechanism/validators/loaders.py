"""What Poisson sampling may replace in the user's training loader, and what it must refuse.

The strategy rebuilds the training loader around Poisson sampling (each example joins each
step independently with rate q = B/N). That is only right if the examples it samples from
are the ones the user meant to train on, and the accountant's N is their number:

- ``RandomSampler`` / ``SequentialSampler`` (``shuffle=True/False``) and Lightning's
  ``DistributedSampler``: the whole dataset; N = len(dataset).
- ``SubsetRandomSampler`` (a train/validation split over one dataset): Poisson sampling over
  its indices only; N = their number. The held-out examples are never touched.
- ``BatchSampler`` over one of the above: its ``batch_size`` is the expected batch.
- Anything else (``WeightedRandomSampler``, a custom sampler or batch sampler) decides who is
  trained on in a way Poisson sampling cannot reproduce: refused, with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from lightning_dp.errors import PrivacyConfigurationError


@dataclass(frozen=True)
class TrainingPopulation:
    """The examples Poisson sampling draws from, and the expected batch per process.

    Attributes:
        indices: dataset indices of the population (``None``: all of ``range(len(dataset))``).
        num_samples: N, the population's size (the accountant's N).
        batch_size: the loader's batch size, the expected Poisson batch per process.
    """

    indices: Optional[Sequence[int]]
    num_samples: int
    batch_size: int


_FIX = ("Remove the sampler (DPStrategy samples each example independently with q = batch_size/N), and express "
        "a train/validation split as torch.utils.data.Subset(dataset, train_indices) or "
        "SubsetRandomSampler(train_indices).")


def _unwrap(sampler: Any) -> Any:
    """The user's sampler behind Lightning's ``DistributedSamplerWrapper`` (if any)."""
    inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)
    return inner if isinstance(sampler, DistributedSampler) and inner is not None else sampler


def _population_of(sampler: Any, dataset_size: int) -> Optional[Sequence[int]]:
    sampler = _unwrap(sampler)
    if isinstance(sampler, SubsetRandomSampler):
        indices = [int(i) for i in sampler.indices]
        if len(set(indices)) != len(indices):
            raise PrivacyConfigurationError(
                "The training SubsetRandomSampler lists some index twice: Poisson sampling over it would give those "
                "examples two chances per step (their privacy loss would double). Pass each index once.")
        if any(not 0 <= i < dataset_size for i in indices):
            raise PrivacyConfigurationError("The training SubsetRandomSampler has indices outside the dataset.")
        return indices
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler.num_samples != dataset_size:
            raise PrivacyConfigurationError(
                "The training RandomSampler draws with replacement or a custom num_samples, which Poisson sampling "
                "does not reproduce. " + _FIX)
        return None
    if isinstance(sampler, (SequentialSampler, DistributedSampler)):
        return None
    raise PrivacyConfigurationError(
        f"The training DataLoader uses a {type(sampler).__name__}, which decides who is trained on in a way "
        "Poisson sampling cannot reproduce (replacing it silently could train on examples you held out or "
        "change the sampling probabilities). " + _FIX)


def training_population(dl: DataLoader) -> TrainingPopulation:
    """Check the user's training loader and return what Poisson sampling replaces it with.

    Raises:
        PrivacyConfigurationError: an iterable dataset, an unknown sampler or batch sampler, or no batch size.
    """
    dataset = dl.dataset
    if isinstance(dataset, IterableDataset):
        raise PrivacyConfigurationError(
            "Poisson sampling needs random access: the training dataset is an IterableDataset. "
            "Use a map-style Dataset (with __len__ and __getitem__).")
    batch_sampler = dl.batch_sampler
    if dl.batch_size is not None:
        batch_size, sampler = dl.batch_size, dl.sampler
    elif type(batch_sampler) is BatchSampler:
        batch_size, sampler = batch_sampler.batch_size, batch_sampler.sampler
    else:
        raise PrivacyConfigurationError(
            f"The training DataLoader uses a custom batch sampler ({type(batch_sampler).__name__}), whose batches "
            "Poisson sampling would replace: give the DataLoader batch_size=B (the expected batch) and no "
            "batch_sampler, or torch.utils.data.BatchSampler(sampler, batch_size=B, drop_last=False).")
    if not batch_size or batch_size < 1:
        raise PrivacyConfigurationError("Cannot read the expected batch size from the training DataLoader: "
                                        "give it `batch_size=`.")
    size = len(dataset)  # type: ignore[arg-type]
    indices = _population_of(sampler, size)
    n = size if indices is None else len(indices)
    if n == 0:
        raise PrivacyConfigurationError("The training set is empty.")
    return TrainingPopulation(indices, n, int(batch_size))
