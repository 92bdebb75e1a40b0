"""How one fit's records fall into its privacy units, and how many of an earlier fit's units a later fit's user covers.

A ledger's entries count one unit of the fit that made it: a record (a fit per example), or one of *its* users
(``Users(ids)``). A later fit per user continues them (:func:`~lightning_dp.accounting.data_ledgers.continue_on_data`)
for its own users, whose records may lie in several of the earlier fit's units: a user of 4 records whose earlier fit
gave each record its own id, or ids regrouped (``(row + 2) // 4`` after ``row // 4``). Removing that user removes the
earlier units it holds whole (one clipped term each, as in the group of docs/user_level.md) and *changes* those it
holds in part (their clipped term is replaced by another: up to 2C apart, counted as two). So the earlier releases
count for the user by group privacy over k, each entry (σ, q) as (σ/k, 1 − (1 − q)^k)
(:func:`~lightning_dp.accounting.data_ledgers.per_user`; docs/user_level.md, "Users, then other users"), k
:func:`covering`: the most, over the later users, of (earlier units held whole) + 2 × (earlier units held in part).
1 when each later user is one earlier user (the same partition, whatever the ids); m (the most records one user
holds) after a fit per example, whose units are records; at most 2m.

A :class:`Partition` keeps, per record, its unit's number (users numbered in order of first record: a function of the
ids, never an id) beside the record's row digests (:func:`~lightning_dp.record_checks.stored_sources.identifying_rows`
and :func:`~lightning_dp.record_checks.row_lineage.dataset_rows`, the kinds the data's record is matched by) and,
within a process, its index in the dataset under the ``Subset``/``ConcatDataset`` wrappers (held weakly). It is kept
with the data's record (:mod:`~lightning_dp.accounting.data_ledgers`) and written to the ledger store with it
(:mod:`~lightning_dp.accounting.data_store`), its digests keyed (:func:`stored_form`,
:mod:`~lightning_dp.accounting.store_key`); a later partition is compared with a stored one keyed alike. Equal rows
of two earlier units are counted as both (conservative).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from torch.utils.data import ConcatDataset, Subset

import lightning_dp.accounting.store_key as store_key
from lightning_dp.record_checks.row_lineage import dataset_rows
from lightning_dp.record_checks.stored_sources import identifying_rows

MAX_PAIRS = 1 << 18
"""The most (digest, unit) pairs a partition keeps over all its kinds (a larger one is not kept: its fit's units
are then unknown, and a later fit is charged the worst case, k = m)."""

Pairs = tuple[np.ndarray, np.ndarray]
"""(row digests, sorted; the unit of each)."""


@dataclass
class Partition:
    """One fit's records grouped into its units (module docstring).

    Attributes:
        digests: per kind of row digest, :data:`Pairs` (a record's digest beside its unit's number).
        bases: (a weak reference to a dataset under its wrappers, indices of it, sorted; the unit of each).
        keyed: whether ``digests`` are the ledger store's keyed ones (:mod:`~.store_key`: a stored partition's).
    """

    digests: dict[tuple, Pairs] = field(default_factory=dict)
    bases: list[tuple[weakref.ref, np.ndarray, np.ndarray]] = field(default_factory=list)
    keyed: bool = False
    _stored: dict[bytes, "Partition"] = field(default_factory=dict, repr=False, compare=False)

    def size(self) -> int:
        """How many (digest, unit) pairs it holds."""
        return sum(len(d) for d, _ in self.digests.values())


class UserGroups:
    """A fit's users (``Users``) over its training ``dataset``: called, the most records one user holds (m, the group
    size of releases per example: :func:`~lightning_dp.accounting.data_ledgers.per_user`); :meth:`partition`, how
    its records fall into users. Computed once, when first asked."""

    def __init__(self, users: Any, dataset: Any) -> None:
        self.users, self.dataset = users, dataset
        self._unit: Optional[np.ndarray] = None
        self._partition: Optional[Partition] = None

    def units(self) -> np.ndarray:
        """The unit number of each record of the dataset (users numbered in order of their first record)."""
        if self._unit is None:
            ids = self.users.ids_for(self.dataset)
            user = self.users.user_of(self.dataset)
            try:
                n = min(len(ids), len(self.dataset))
            except TypeError:
                n = len(ids)
            number: dict[Any, int] = {}
            self._unit = np.fromiter((number.setdefault(user(i), len(number)) for i in range(n)), np.int64, n)
        return self._unit

    def __call__(self) -> int:
        units = self.units()
        return int(np.bincount(units).max()) if len(units) else 1

    def partition(self) -> Partition:
        """The records' units, by row digest and by dataset index (:class:`Partition`)."""
        if self._partition is None:
            self._partition = partition_of(self.dataset, self.units())
        return self._partition


def bases_of(dataset: Any, rows: Optional[list[int]], depth: int = 0) -> list[tuple[Any, Optional[list[int]]]]:
    """The datasets under ``dataset``'s ``Subset``, ``ConcatDataset`` and record-declaring wrappers, with the indices
    of each that positions ``rows`` of ``dataset`` read."""
    if depth > 16:
        return [(dataset, rows)]
    if isinstance(dataset, Subset):
        own = [int(i) for i in dataset.indices]
        size = len(dataset.dataset)  # type: ignore[arg-type]
        own = [i + size if i < 0 else i for i in own]
        return bases_of(dataset.dataset, own if rows is None else [own[i] for i in rows], depth + 1)
    if isinstance(dataset, ConcatDataset):
        out, start = [], 0
        for part, end in zip(dataset.datasets, dataset.cumulative_sizes):
            picked = list(range(end - start)) if rows is None else [i - start for i in rows if start <= i < end]
            if picked:
                out += bases_of(part, None if rows is None else picked, depth + 1)
            start = end
        return out
    inner = vars(dataset).get("dataset") if type(dataset).__name__ == "DistinctRecords" else None
    if inner is not None:
        return bases_of(inner, rows, depth + 1)
    return [(dataset, rows)]


def partition_of(dataset: Any, units: np.ndarray) -> Partition:
    """The :class:`Partition` of ``dataset``'s records ``0…len(units)−1`` into ``units``."""
    out = Partition()
    kinds: dict[tuple, list[Pairs]] = {}
    start = 0
    for base, rows in bases_of(dataset, list(range(len(units)))):
        index = np.asarray(rows if rows is not None else range(len(units)), dtype=np.int64)
        unit = units[start:start + len(index)]
        start += len(index)
        try:
            order = np.argsort(index, kind="stable")
            out.bases.append((weakref.ref(base), index[order], unit[order]))
        except TypeError:  # an object without weak references: by content only
            pass
        for kind, per_row in {**identifying_rows(base), **dataset_rows(base)}.items():
            keep = index < len(per_row)
            digests, owners = per_row[index[keep]], unit[keep]
            picked = digests != 0
            kinds.setdefault(kind, []).append((digests[picked], owners[picked]))
    for kind, parts in kinds.items():
        digests = np.concatenate([d for d, _ in parts])
        owners = np.concatenate([u for _, u in parts])
        order = np.lexsort((owners, digests))
        out.digests[kind] = (digests[order], owners[order])
    if out.size() > MAX_PAIRS:
        out.digests = {}
    return out


def covering(earlier: Optional[Partition], later: Partition) -> Optional[int]:
    """k: the most units of ``earlier`` that the records of one unit of ``later`` meet, one met in part twice (module
    docstring), over the kinds of digest and the datasets both hold; ``None`` when it cannot be told (``earlier``
    unknown, nothing in common, a record matching too many earlier ones)."""
    if earlier is None:
        return None
    if earlier.keyed and not later.keyed:  # a stored partition's keys: this one's compared under the same key
        secret = store_key.secret()
        if secret is None:
            return None
        later = stored_form(later, secret)
    found: list[int] = []
    for kind, (theirs, their_units) in earlier.digests.items():
        if kind in later.digests:
            found.append(_most(theirs, their_units, *later.digests[kind]))
    for ref, theirs, their_units in earlier.bases:
        for other, mine, my_units in later.bases:
            if ref() is not None and ref() is other():
                found.append(_most(theirs, their_units, mine, my_units))
    if not found or min(found) < 0:
        return None
    return max(found) or None


def _most(theirs: np.ndarray, their_units: np.ndarray, mine: np.ndarray, my_units: np.ndarray) -> int:
    """The most earlier units (``their_units`` of keys ``theirs``, sorted) that the keys ``mine`` of one later unit
    meet, a unit met in part counted twice (module docstring); −1 when equal keys repeat past :data:`MAX_PAIRS`
    matches."""
    low = np.searchsorted(theirs, mine, "left")
    count = np.searchsorted(theirs, mine, "right") - low
    total = int(count.sum())
    if not total:
        return 0
    if total > max(MAX_PAIRS, 4 * len(mine)):
        return -1
    offset = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    met = np.unique(np.stack([np.repeat(my_units, count), np.repeat(low, count) + offset], axis=1), axis=0)
    pairs, held = np.unique(np.stack([met[:, 0], their_units[met[:, 1]]], axis=1), axis=0, return_counts=True)
    whole = held >= np.bincount(their_units)[pairs[:, 1]]  # every record of the earlier unit is the later user's
    return int(np.bincount(pairs[:, 0], weights=np.where(whole, 1, 2)).max())


def stored_form(partition: Partition, secret: bytes) -> Partition:
    """``partition`` as the ledger store holds it: its digests :func:`~.store_key.keyed` under ``secret`` (sorted
    again), no dataset indices (cached)."""
    if partition.keyed:
        return partition
    out = partition._stored.get(secret)
    if out is None:
        out = Partition(keyed=True)
        for kind, (digests, units) in partition.digests.items():
            keys = store_key.keyed(digests, secret)
            order = np.lexsort((units, keys))
            out.digests[kind] = (keys[order], units[order])
        partition._stored.clear()
        partition._stored[secret] = out
    return out


def same_units(a: Optional[Partition], b: Optional[Partition]) -> bool:
    """Whether two partitions group the records alike (both ``None``, or equal digests and units)."""
    if a is None or b is None or a is b:
        return a is b
    if a.digests.keys() != b.digests.keys() or len(a.bases) != len(b.bases):
        return False
    same_rows = all(np.array_equal(x, y) for kind in a.digests for x, y in zip(a.digests[kind], b.digests[kind]))
    return same_rows and all(x[0]() is y[0]() and np.array_equal(x[1], y[1]) and np.array_equal(x[2], y[2])
                             for x, y in zip(a.bases, b.bases))


def to_state(partition: Optional[Partition], secret: bytes) -> Optional[list[list[Any]]]:
    """``partition``'s digests for the ledger store (``None``: none or unknown), keyed under ``secret``
    (:func:`stored_form`): per kind [repr(kind), digests, units] as int64 and int32 tensors (12 bytes a record and
    kind; dataset indices are of this process only)."""
    import torch

    if partition is None or not partition.digests:
        return None
    partition = stored_form(partition, secret)
    return [[repr(kind), torch.from_numpy(np.ascontiguousarray(d).view(np.int64)), torch.from_numpy(u.astype(np.int32))]
            for kind, (d, u) in partition.digests.items()]


def from_state(state: Optional[list[list[Any]]], keyed: bool = True) -> Optional[Partition]:
    """The :class:`Partition` :func:`to_state` wrote (``None`` stays ``None``; ``keyed=False``: a record of an earlier
    version, whose digests were written as they are); ``ValueError`` when malformed."""
    import ast

    import torch

    if state is None:
        return None
    out = Partition(keyed=keyed)
    for kind, digests, units in state:
        tensors = all(isinstance(t, torch.Tensor) and t.ndim == 1 for t in (digests, units))
        if not tensors or digests.dtype != torch.int64 or units.dtype != torch.int32 or digests.shape != units.shape:
            raise ValueError("malformed partition")
        keys, owners = digests.numpy().view(np.uint64), units.numpy().astype(np.int64)
        order = np.lexsort((owners, keys))
        out.digests[ast.literal_eval(kind)] = (keys[order], owners[order])
    return out
