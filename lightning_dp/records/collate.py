"""A collate function that survives the empty batches of Poisson sampling."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from lightning_dp.records.empty_records import is_empty
from lightning_dp.records.fresh_randomness import reads_draw
from lightning_dp.records.fetch import fetch
from lightning_dp.records.stateless import FetchState, NotedBatches, NotingWorkerInit, WatchedCollate


def _empty_like(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: _empty_like(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_empty_like(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_empty_like(v) for v in batch)
    return batch


class EmptySafeCollate:
    """Wraps a collate function; an empty index list gives a batch of size 0.

    The empty batch has the structure, dtypes and trailing shapes of a real one
    (record 0 read as the loader's fetcher reads it, :func:`~lightning_dp.records.fetch.fetch`:
    through the dataset's ``__getitems__`` when it has one; collated and sliced to length 0),
    so code that only looks at shapes keeps working. Picklable, for DataLoader workers.
    """

    def __init__(self, dataset: Dataset, collate_fn: Callable[[Sequence[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate

    def __call__(self, examples: Sequence[Any]) -> Any:
        if hasattr(examples, "__len__") and all(is_empty(e) for e in examples):  # none, or only unreadable records
            if len(examples):
                try:
                    return self.collate_fn(examples)
                except Exception:  # noqa: BLE001  (the Kaggle collate that drops None fails on what is left: [])
                    pass
            return _empty_like(self.collate_fn(fetch(self.dataset, [self._template()])))
        return self.collate_fn(examples)

    def _template(self) -> int:
        """The first index whose record holds data (:mod:`~lightning_dp.records.empty_records`; 0 when none of the
        first 64 does): its batch, sliced to length 0, is the empty batch's template."""
        found = getattr(self, "_found", None)
        if found is None:
            found = next((i for i in range(min(len(self.dataset), 64))  # type: ignore[arg-type]
                          if not is_empty(fetch(self.dataset, [i])[0])), 0)
            self._found = found
        return found


_EMPTY: "weakref.WeakKeyDictionary[Any, dict[int, bool]]" = weakref.WeakKeyDictionary()
"""A training dataset -> whether each index read so far by :func:`rows_held` is an empty record."""


def rows_held(dataset: Any, indices: list[int], batch: Any) -> list[int]:
    """The indices of the step whose records are rows of its collated ``batch``: all of them, unless the batch has
    fewer rows than indices and exactly that many of them read an empty record (``None`` for an unreadable file, which
    the collate dropped: :mod:`~lightning_dp.records.empty_records`); then those that hold data, in order. Each index
    is read once (its emptiness kept for the dataset's life), and only on such steps."""
    rows = batch_size_of(batch)
    if rows < 0 or rows >= len(indices):
        return indices
    holding = held_records(dataset, indices)
    return holding if len(holding) == rows else indices


def held_records(dataset: Any, indices: Sequence[int]) -> list[int]:
    """The ``indices`` whose records hold data (not :func:`~lightning_dp.records.empty_records.is_empty`), in order:
    each index read alone once for the dataset's life (the batches the first batch check builds from the population,
    :mod:`~lightning_dp.records.constructed_batches`, and the steps of :func:`rows_held`)."""
    try:
        known = _EMPTY.setdefault(dataset, {})
    except TypeError:  # a dataset without weak references: not kept
        known = {}
    for i in indices:
        if i not in known:
            records = fetch(dataset, [i])
            known[i] = isinstance(records, (list, tuple)) and len(records) == 1 and is_empty(records[0])
    return [i for i in indices if not known[i]]


def batch_size_of(batch: Any) -> int:
    """Leading dimension of the first tensor found in ``batch`` (-1 if there is none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else -1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size_of(item)
            if size >= 0:
                return size
    return -1


def loader_like(dl: DataLoader, batch_sampler: Any, collate: Callable[[list[Any]], Any],
                state: FetchState | None = None, fresh: Any = None) -> DataLoader:
    """A loader over ``dl``'s dataset drawing ``batch_sampler``'s batches, collated by ``collate``, with ``dl``'s
    workers, pinning, timeout, worker init, multiprocessing context and persistence. Its fetches are stateless: each
    process's dataset and collate object are compared after every batch with the state noted before that fetch (in
    a worker: after ``dl``'s ``worker_init_fn``, then after each batch), and around the library's reads of the dataset
    (:mod:`~lightning_dp.records.stateless`; ``state``: created before the checks' first read — here when not
    given). ``fresh``: a :class:`~lightning_dp.records.fresh_randomness.FreshRandomness` that seeds the global
    generators afresh around each record's read."""
    state = state or FetchState(dl.dataset, dl.collate_fn).noted()
    init = NotingWorkerInit(dl.worker_init_fn, state) if dl.num_workers > 0 else dl.worker_init_fn
    kwargs: dict[str, Any] = dict(
        num_workers=dl.num_workers, collate_fn=WatchedCollate(collate, state),
        pin_memory=dl.pin_memory, timeout=dl.timeout, worker_init_fn=init,
        multiprocessing_context=dl.multiprocessing_context, persistent_workers=dl.persistent_workers,
    )
    if dl.num_workers > 0:
        kwargs["prefetch_factor"] = dl.prefetch_factor
    loader = DeliveringLoader(dl.dataset, batch_sampler=batch_sampler, **kwargs)
    loader.fetch_state, loader.fresh = state, fresh
    return loader


class DeliveringLoader(DataLoader):
    """A DataLoader that tells its batch sampler (a :class:`~lightning_dp.records.recorded_batches.RecordedBatches`)
    each batch it hands the loop, in order: a plain loop's step may take only a batch it was handed, once
    (:mod:`~lightning_dp.validators.plain_loop`), never one the workers only prefetched. Its fetch state
    (:mod:`~lightning_dp.records.stateless`) is noted right before each fetch without workers (:class:`NotedBatches`),
    and before each pass with them: what the user's hooks write between batches or passes (``set_epoch``) is not a
    fetch's (the library's reads are compared around themselves, :class:`~lightning_dp.records.fetch.watched`)."""

    fetch_state: Any = None
    fresh: Any = None

    @property
    def _index_sampler(self) -> Any:  # what torch's iterators draw the batches of indices from
        batches = super()._index_sampler
        if self.fresh is not None:
            batches = FreshBatches(batches, self.fresh, reads_draw(self.dataset))
        if self.num_workers == 0 and self.fetch_state is not None:  # noted once the generators are seeded for it
            batches = NotedBatches(batches, self.fetch_state)
        return batches

    def __iter__(self) -> Any:
        if self.num_workers > 0 and self.fetch_state is not None:
            self.fetch_state.note()
        sampler = self.batch_sampler
        if hasattr(sampler, "restart"):
            sampler.restart()
        for batch in super().__iter__():
            if hasattr(sampler, "delivered"):
                sampler.delivered(batch)
            yield batch


class FreshBatches:
    """The batches of indices handed to the fetcher (in the main process or sent to a worker), each wrapped to seed
    the global generators afresh around each record's read (:mod:`~lightning_dp.records.fresh_randomness`)."""

    def __init__(self, batches: Any, fresh: Any, per_record: bool = True) -> None:
        self.batches = batches
        self.fresh = fresh
        self.per_record = per_record  # False: the dataset's reads draw nothing (a TensorDataset): once per batch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        for indices in self.batches:
            yield self.fresh.batch(indices, self.per_record)
