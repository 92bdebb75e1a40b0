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
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import StackDataset, Subset

_FORWARDING = (Subset.__getitems__, StackDataset.__getitems__)
"""torch's own ``__getitems__``: each reads index by index from the dataset(s) it wraps (or their ``__getitems__``)."""


def fetch(dataset: Any, indices: Sequence[int]) -> Any:
    """The fetcher's ``items`` for ``indices`` (before the collate): ``dataset.__getitems__(indices)`` when
    defined, else ``[dataset[i] for i in indices]``."""
    many = getattr(dataset, "__getitems__", None)
    if many:
        return many(list(indices))
    return [dataset[i] for i in indices]


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
    """Inside: torch's CPU generator, NumPy's global generator and Python's ``random`` seeded with ``seed``.
    Their states are restored on exit."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            reseed(seed)
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def reseed(seed: int) -> None:
    """Seed the three generators of :func:`seeded` (call inside it: nothing is restored here)."""
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def read_examples(dataset: Any, collate: Callable[[Any], Any], indices: Sequence[int], fixed: bool = False) -> Any:
    """The examples ``indices`` read as the loader's fetcher reads them (:func:`fetch`) and collated; ``fixed``:
    example i read with the generators seeded by i (states restored after), unless the dataset reads a batch in one
    call (:func:`reads_per_index`). See :meth:`~lightning_dp.privacy.private_step.PrivateStep.examples`."""
    if not (fixed and reads_per_index(dataset)):
        return collate(fetch(dataset, indices))
    items = []
    with seeded(0):  # the generators' states saved once, restored after the last example
        for i in indices:
            reseed(int(i))
            items.append(dataset[i])
    return collate(items)
