"""The training records a dataset's items read from outside the dataset, as record sources for the statistics check.

A dataset need not hold its records: ``__getitem__`` may read them from a module-level global (``X[i]``) or from a
tensor another object holds (``self.dm.x_train[i]``), and scale them by statistics a LightningDataModule, a helper,
a closure or the dataset keeps (``(X[i] - self.dm.mean) / self.dm.std``). :func:`records_read` finds those arrays,
so that :func:`~.data_statistics.data_statistics_held` compares what is held with *their* statistics too.

The candidates are what the existing copies finder walks to
(:func:`~lightning_dp.record_checks.holders.held_arrays`) from the globals of the user's modules that define the
datasets' classes (:func:`~lightning_dp.fingerprints.state_walker.user_modules`) and from the datasets themselves:
tensors and NumPy arrays with a row per record (their first dimension a dataset's length) that are not the
datasets' own tensors. A candidate is a record source only if the items read it: exchanged in place, exactly
reversibly (:func:`~lightning_dp.record_checks.outside_records.exchange`), it changes the first or the last item
(read seeded, as the loader's fetcher reads it). Another population's array of the same size that no item reads
is not one (its statistics are public to this data). A dataset whose items differ from one read to the next
(state it writes as it reads) is not judged. Not seen: records read from files, arrays beyond the walk, and more
than :data:`MAX_CANDIDATES` candidates.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_dp.fingerprints.dataset_tokens import dataset_parts
from lightning_dp.fingerprints.state_walker import user_modules
from lightning_dp.record_checks.holders import held_arrays
from lightning_dp.record_checks.outside_records import exchange, exchangeable
from lightning_dp.records.fetch import fetch, seeded
from lightning_dp.records.record_fingerprint import fingerprint

MAX_CANDIDATES = 16
"""Arrays of a record per row tried at most (each costs two reads of an item)."""

_SEED = 20261130


def records_read(dataset: Any, tensors: Sequence[tuple[str, Tensor]],
                 max_elements: int = 1 << 27) -> list[tuple[str, Tensor]]:
    """(path, tensor) of the arrays outside ``tensors`` (the datasets' own) whose rows ``dataset``'s items read
    (module docstring); NumPy arrays as tensors over their memory. Arrays of more than ``max_elements`` (whose
    statistics the check does not compute) are not tried."""
    datasets, _ = dataset_parts(dataset)
    lengths = {n for d in datasets for n in [dataset_length(d)] if n > 1}
    try:
        size = len(dataset)
    except Exception:  # noqa: BLE001 — an iterable dataset: its items are not read by index
        return []
    if not lengths or not size:
        return []
    own = {id(t) for _, t in tensors}
    holders = [*((m.__name__, m) for m in user_modules(type(d) for d in datasets)),
               *((f"dataset {type(d).__name__}", d) for d in datasets)]
    candidates = [(path[4:] if path.startswith("the ") else path, value) for path, value in held_arrays(holders)
                  if id(value) not in own and (isinstance(value, Tensor) or type(value).__module__ == "numpy")
                  and getattr(value, "ndim", 0) >= 1 and value.shape[0] in lengths
                  and (value.numel() if isinstance(value, Tensor) else value.size) <= max_elements
                  and exchangeable(value)]
    candidates = list({id(v): (p, v) for p, v in candidates}.values())[:MAX_CANDIDATES]
    if not candidates:
        return []
    indices = sorted({0, size - 1})
    before = [_digest(dataset, i) for i in indices]
    if before != [_digest(dataset, i) for i in indices]:  # reads that write what the next one reads: not judged
        return []
    found = []
    for path, value in candidates:
        restore = exchange(value, fixed=True)
        try:
            changed = [_digest(dataset, i) for i in indices] != before
        finally:
            restore()
        if changed:
            found.append((path, as_tensor(value)))
    return found


def dataset_length(d: Any) -> int:
    """``len(d)``; 0 for a dataset whose length is unknown (an iterable)."""
    try:
        return len(d)
    except Exception:  # noqa: BLE001 — a dataset whose length is unknown
        return 0


def _digest(dataset: Any, index: int) -> Any:
    """Item ``index`` as the loader reads it (generators seeded), or the type of the error reading it raised."""
    try:
        with seeded(_SEED):
            found = fingerprint(fetch(dataset, [index]))
    except Exception as err:  # noqa: BLE001 — the user's __getitem__ on exchanged data
        return ("error", type(err).__name__)
    return None if found is None else found.digest


def as_tensor(value: Any) -> Tensor:
    """A tensor, detached, or a NumPy array as a tensor over its memory (a read-only array's warning silenced)."""
    if isinstance(value, Tensor):
        return value.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.as_tensor(value)
