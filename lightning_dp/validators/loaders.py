"""What Poisson sampling may replace in the user's training loader, and what it must refuse.

The strategy rebuilds the training loader around Poisson sampling (each example joins each
step independently with rate q = B/N). That is only right if the examples it samples from
are the ones the user meant to train on, and the accountant's N is their number:

- ``RandomSampler`` / ``SequentialSampler`` (``shuffle=True/False``) and Lightning's
  ``DistributedSampler``: the whole dataset; N = len(dataset). Such a sampler reads positions
  0 … len(data_source) − 1 of the loader's dataset, whatever its ``data_source`` holds: one whose
  data source is shorter (a sampler over a prefix or over another dataset) is refused. A
  ``DistributedSampler`` the user built must be one shard of the loader's dataset for this run's
  processes (its ``num_replicas`` and ``rank``), as Lightning's is.
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
    Subset,
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


def _population_of(sampler: Any, dataset_size: int, rank: int, world_size: int) -> Optional[Sequence[int]]:
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
    if isinstance(sampler, (RandomSampler, SequentialSampler)):
        _check_source(sampler.data_source, dataset_size, type(sampler).__name__)
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler.num_samples != dataset_size:
            raise PrivacyConfigurationError(
                "The training RandomSampler draws with replacement or a custom num_samples, which Poisson sampling "
                "does not reproduce. " + _FIX)
        return None
    if isinstance(sampler, DistributedSampler):
        _check_shard(sampler, dataset_size, rank, world_size)
        return None
    if isinstance(sampler, SequentialSampler):
        return None
    raise PrivacyConfigurationError(
        f"The training DataLoader uses a {type(sampler).__name__}, which decides who is trained on in a way "
        "Poisson sampling cannot reproduce (replacing it silently could train on examples you held out or "
        "change the sampling probabilities). " + _FIX)


def _check_source(source: Any, dataset_size: int, what: str) -> None:
    """A sampler over ``source`` reads positions 0 … len(source) − 1 of the loader's dataset: all of it only if
    ``source`` is as long."""
    size = len(source)
    if size != dataset_size:
        raise PrivacyConfigurationError(
            f"The training DataLoader's {what} draws from another dataset than the DataLoader reads (its data source "
            f"has {size} records, the DataLoader's dataset {dataset_size}): your loader reads positions "
            f"0 … {size - 1} of the DataLoader's dataset whatever the sampler's dataset holds, and Poisson sampling "
            "must draw the records your loader draws. Give the DataLoader the dataset you mean to train on "
            "(DataLoader(train_set, batch_size=B, shuffle=True)), or a split as SubsetRandomSampler(train_indices).")


def _check_shard(sampler: DistributedSampler, dataset_size: int, rank: int, world_size: int) -> None:
    """A DistributedSampler stands for the whole dataset only as one shard of it for this run's processes."""
    _check_source(sampler.dataset, dataset_size, "DistributedSampler")
    if (sampler.num_replicas, sampler.rank) != (world_size, rank):
        raise PrivacyConfigurationError(
            f"The training DataLoader's DistributedSampler is built for {sampler.num_replicas} process(es) (this one "
            f"rank {sampler.rank}), but the run has {world_size} (this one rank {rank}): your loader would train on "
            "another share of the data than Poisson sampling draws. Remove the DistributedSampler: DPStrategy "
            "samples each process's shard itself (Lightning's use_distributed_sampler=True, the default, is all "
            "it needs).")
    if sampler.drop_last and not sampler.shuffle and dataset_size % world_size:
        raise PrivacyConfigurationError(
            "The training DataLoader's DistributedSampler(shuffle=False, drop_last=True) never draws the last "
            f"{dataset_size % world_size} record(s), which Poisson sampling would train on. Remove the "
            "DistributedSampler (DPStrategy samples each process's shard itself), or pass a Subset without them.")


def training_population(dl: DataLoader, rank: int = 0, world_size: int = 1,
                        batches_per_step: int = 1) -> TrainingPopulation:
    """Check the user's training loader and return what Poisson sampling replaces it with (``rank`` of
    ``world_size`` processes: the shard a ``DistributedSampler`` must be; the expected batch ``batches_per_step``
    of its batches: gradient accumulation, :mod:`lightning_dp._accumulation`).

    Raises:
        PrivacyConfigurationError: an iterable dataset, an unknown sampler or batch sampler, a sampler over
            another dataset or shard, or no batch size.
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
    indices = _population_of(sampler, size, rank, world_size)
    n = size if indices is None else len(indices)
    if n == 0:
        raise PrivacyConfigurationError("The training set is empty.")
    return TrainingPopulation(indices, n, int(batch_size) * int(batches_per_step))


def record_set(dataset: Any) -> tuple[int, frozenset[int]]:
    """(identity of the dataset under its ``Subset`` wrappers, the set of its indices they keep): which records a
    training loader trains on, whatever their order."""
    indices: Optional[list[int]] = None
    while isinstance(dataset, Subset):
        indices = list(dataset.indices) if indices is None else [int(dataset.indices[i]) for i in indices]
        dataset = dataset.dataset
    if indices is None:
        try:
            indices = list(range(len(dataset)))
        except TypeError:
            indices = []
    return id(dataset), frozenset(int(i) for i in indices)


def population_changed_error(before: int, now: int) -> PrivacyConfigurationError:
    """The refusal of a training loader rebuilt on another set of the same dataset's records."""
    return PrivacyConfigurationError(
        f"The training loader was rebuilt on another set of the training dataset's records ({before} → {now} "
        "records): the accounting is for one population, each record sampled at rate q in every step. A subset "
        "chosen each epoch (a self-paced curriculum keeping the low-loss examples, hard-example mining, resampling "
        "by class) is chosen from the private data, and a record left out of some epochs is not sampled at q. Nothing "
        "more was released. Train on the whole population every epoch; weight examples inside the loss instead.")

