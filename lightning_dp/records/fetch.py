"""Reading records exactly as the training loader's fetcher does.

torch's map-style fetcher (``torch/utils/data/_utils/fetch.py``, ``_MapDatasetFetcher.fetch``) reads one
batch of indices as

    items = dataset.__getitems__(indices)      when the dataset defines it (and it is truthy)
    items = [dataset[i] for i in indices]      otherwise

and hands ``items`` to the collate function. A ``__getitems__`` may do what ``__getitem__`` does not
(read a batch at once, pad or normalise it, return another layout), so everything that builds a batch
besides the loader (the first step's probe, physical batches, the empty batch's template, the record
checks) reads through :func:`fetch`: it sees exactly the records the loader trains on.

Seeded reads (:func:`seeded`) seed torch's CPU generator, NumPy's global generator and Python's
``random`` alike, and restore all three after: a dataset that augments from any of them gives the same
record for the same index and seed.

Every read here of a training loader's dataset is watched (:data:`WATCHED`, :mod:`~lightning_dp.records.stateless`):
the dataset's and collate object's state is noted before it and compared after, so a statistic the library's own
reads would set (a warm-up the checks' reads complete) is refused as the loader's fetches are.
"""

from __future__ import annotations

import os
import random
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import StackDataset, Subset

from lightning_dp.records import user_generators
from lightning_dp.replays.starting_state import Generators, put_back_after

_FORWARDING = (Subset.__getitems__, StackDataset.__getitems__)
"""torch's own ``__getitems__``: each reads index by index from the dataset(s) it wraps (or their ``__getitems__``)."""


WATCHED: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
"""``id(dataset)`` → the :class:`~lightning_dp.records.stateless.FetchState` of the training loader built over it
(registered in the process that built it, while the state lives): the library's reads of that dataset are compared."""


class watched:
    """Around a library read of ``dataset`` (:func:`fetch`, :func:`read_examples`): its fetch state noted before and
    compared after (the read's own writes judged, not those of the code between reads). Not nested, only in the
    process that built the loader, and not inside the loader's own fetch (a collate reading its empty batch's
    template)."""

    __slots__ = ("state", "indices", "read")  # read(indices, seeds): the read again, seeded as for ``seeds``

    def __init__(self, dataset: Any, indices: Optional[Sequence[int]] = None,
                 read: Optional[Callable[[Any], Any]] = None) -> None:
        state = WATCHED.get(id(dataset)) if WATCHED else None
        ok = state is not None and state.dataset is dataset and state.home == os.getpid() and not state.depth
        self.state = state if ok else None
        self.indices, self.read = indices, read  # a write is judged by reading them again (records/fetch_reruns.py)

    def __enter__(self) -> None:
        if self.state is not None:
            self.state.depth += 1
            self.state.note(None if self.indices is None else list(self.indices), self.read)

    def __exit__(self, kind: Any, *_: Any) -> bool:
        if self.state is not None:
            self.state.depth -= 1
            if kind is None:
                self.state.check()
        return False


def fetch(dataset: Any, indices: Sequence[int]) -> Any:
    """The fetcher's ``items`` for ``indices`` (before the collate): ``dataset.__getitems__(indices)`` when
    defined, else ``[dataset[i] for i in indices]``. Watched (:class:`watched`)."""
    def read(indices: Sequence[int], seeds: Any = None) -> Any:  # the generators are the caller's: seeds unused
        many = getattr(dataset, "__getitems__", None)
        if many:
            return many(list(indices))
        return [dataset[i] for i in indices]

    with watched(dataset, indices, read):
        return read(indices)


def reads_per_index(dataset: Any) -> bool:
    """Whether the fetcher's batch is ``[dataset[i] for i in indices]``: no ``__getitems__``, or torch's own
    (``Subset``'s, ``StackDataset``'s) over datasets that read per index. Only then can one index be read
    alone (with its own seed) and stand for its place in a batch."""
    many = getattr(dataset, "__getitems__", None)
    if not many:
        return True
    if getattr(many, "__func__", None) not in _FORWARDING:
        return False
    inner = dataset.datasets if isinstance(dataset, StackDataset) else [dataset.dataset]
    return all(reads_per_index(d) for d in (inner.values() if isinstance(inner, dict) else inner))


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Inside: torch's CPU generator, NumPy's global generator, Python's ``random`` and the generators the model and
    the callbacks hold (:mod:`~lightning_dp.records.user_generators`) seeded with ``seed``. Their states are restored
    on exit."""
    with put_back_after(lambda: Generators(cuda="none")), user_generators.forked() as found:
        reseed(seed)
        user_generators.reseed(seed, found)  # the model's and callbacks' own generators too (one walk for both)
        yield


def reseed(seed: int) -> None:
    """Seed the three generators of :func:`seeded` (call inside it: nothing is restored here)."""
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def read_examples(dataset: Any, collate: Callable[[Any], Any], indices: Sequence[int], fixed: bool = False) -> Any:
    """The examples ``indices`` read as the loader's fetcher reads them (:func:`fetch`) and collated; ``fixed``:
    example i read with the generators seeded by i (states restored after), unless the dataset reads a batch in one
    call (:func:`reads_per_index`). See :meth:`~lightning_dp.privacy.private_step.PrivateStep.examples`. Watched
    with the collate (:class:`watched`)."""
    def read(indices: Sequence[int], seeds: Optional[Sequence[int]] = None) -> Any:  # seeds: each read's, if not i
        if not (fixed and reads_per_index(dataset)):
            return collate(fetch(dataset, indices))
        items = []
        with seeded(0):  # the generators' states saved once, restored after the last example
            for i, seed in zip(indices, indices if seeds is None else seeds):
                reseed(int(seed))
                items.append(dataset[i])
        return collate(items)

    with watched(dataset, indices, read):
        return read(indices)
