"""The records the loader really draws: one fixed record per index, each record once.

The privacy unit is one record of the dataset the training loader reads. Poisson sampling draws dataset
*indices*, each independently with rate q, and the accountant charges each index's chances; that is each
record's privacy loss only if

1. **an index reads one fixed record.** Reading a batch of indices twice, with torch's, NumPy's and
   Python's random generators seeded alike, must give the same records (a ``__getitem__`` drawing a random
   text chunk, or augmenting from a generator of its own such as an unseeded ``numpy.random.default_rng()``,
   does not: then which data a step uses is not who was sampled). And the batch read in another order (rotated
   by one) with that seed must not give the same records in the same order (it does when the record is drawn
   from the seeded generator whatever the index). A few public positions (:data:`FIXED_RECORD_PROBES`), three
   reads (positions holding an empty record, ``None`` for an unreadable file, are passed over:
   :mod:`~lightning_dp.records.empty_records`).
2. **a record has one index.** Repetition that torch's wrappers show (a Subset index listed twice, a
   dataset concatenated with itself) is refused before anything is read (:mod:`.record_sources`);
   repetition inside a dataset's own ``__getitem__`` is looked for in the records
   (:mod:`.repeated_records`, skipped for :class:`~lightning_dp.data.DistinctRecords`); under user-level DP, where a
   user's own records may repeat, copies held by *different* users (one person counted as two users:
   :mod:`.user_copies`).
3. **a record is its own data**: no two records read the same rows of the arrays the dataset holds (overlapping
   windows, records mixed with their neighbours or with a partner from a shuffled copy of the data, statistics of
   the whole tensor cached on the first read: :mod:`.shared_records`; not for user-level DP). What the reads write
   besides the records is noted before the first read (:mod:`.read_writes`).
4. **an empty batch can be read**: a ``__getitems__`` must accept the empty list of indices Poisson sampling
   draws for an empty step (the loader's fetcher calls it; :mod:`~lightning_dp.records.fetch`).

Records are read as the loader's fetcher reads them. :func:`check_records` runs once per training loader,
before training (:meth:`~lightning_dp.privacy.private_step.PrivateStep.poisson_loader`), in the main
process. Errors name positions, never data values.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.data import Subset

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.distinct_records import DistinctRecords
from lightning_dp.records.empty_records import is_empty
from lightning_dp.records import user_generators
from lightning_dp.records.fetch import fetch, seeded, watched
from lightning_dp.records.record_fingerprint import fingerprint
from lightning_dp.record_checks.record_sources import check_sources
from lightning_dp.record_checks.repeated_records import READ_SEED, check_repeated_records
from lightning_dp.record_checks.read_writes import ReadWrites
from lightning_dp.record_checks.shared_records import check_shared_records
from lightning_dp.record_checks.user_copies import check_copies_across_users

FIXED_RECORD_PROBES = 4
"""Positions read, as one batch, three times (spread evenly over the population: first, last and between)."""

_FIXED_FIX = ("DP's privacy unit is a fixed record per index: make __getitem__(i) return record i (e.g. the i-th "
              "chunk of the text, not a random one). If the randomness is augmentation, draw it from torch's random "
              "generator (or NumPy's or Python's global one), which the probe seeds per index, or use "
              "lightning_dp.data.AugmentedViews.")


def check_records(dataset: Any, indices: Optional[Sequence[int]], num_samples: int, users: Any = None) -> None:
    """Check the population (``indices`` of ``dataset``; ``None``: all ``num_samples`` of them) as the module
    docstring says. ``users``: the privacy unit's :class:`~lightning_dp.units.Users` (user-level DP; ``None``: the
    example). A user is sampled once per step however many records it holds: records repeated within a user (its
    identical messages) are allowed, copies held by different users are not (:mod:`.user_copies`).

    Raises:
        PrivacyConfigurationError: naming what is wrong and the fix.

    The checks' reads are watched as one (:class:`~lightning_dp.records.fetch.watched`): a statistic they leave on
    the dataset (a warm-up they complete) is refused after them, once these checks have named what they find.
    """
    with watched(dataset), user_generators.looked_for_once():  # only the dataset's code runs between the reads
        _check_records(dataset, indices, num_samples, users)


def _check_records(dataset: Any, indices: Optional[Sequence[int]], num_samples: int, users: Any) -> None:
    per_user = users is not None
    writes = None if per_user else ReadWrites(dataset)  # before any read: what reads write besides the records
    check_same_on_every_rank(dataset)  # first read: a collective, which every rank must reach
    check_sources(dataset, indices)
    _check_empty_read(dataset)

    def at(position: int) -> int:
        return position if indices is None else int(indices[position])

    _check_fixed_records(dataset, at, num_samples)
    if not _declared_distinct(dataset):
        if per_user:
            check_copies_across_users(dataset, at, num_samples, users.user_of(dataset))
        else:
            check_repeated_records(dataset, at, num_samples)
    if not per_user:
        check_shared_records(dataset, at, num_samples, writes)


RANK_PROBES = 16
"""Records read on every rank (spread evenly over the dataset) to compare the ranks' datasets."""


def check_same_on_every_rank(dataset: Any) -> None:
    """Under several processes, refuse training datasets that differ between the ranks: their lengths, or the
    records at :data:`RANK_PROBES` positions spread over them (fingerprints, compared through two all-reduces of a
    digest). Poisson sampling draws the same indices on every rank from one population, and the accounting is for
    that population: a train/validation split drawn per rank (an unseeded ``default_rng``, ``seed + rank``), a
    per-rank shuffle or subsample makes one record two ranks' different indices (drawn twice in a step, at twice the
    rate) and the ranks' N and q disagree. Every rank reaches the same verdict."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    try:
        n = len(dataset)
    except TypeError:  # an iterable dataset: refused where the loader is built
        return
    positions = sorted({round(k * (n - 1) / max(1, RANK_PROBES - 1)) for k in range(RANK_PROBES)}) if n else []
    digest = hashlib.blake2b(str(n).encode(), digest_size=8)
    try:
        with seeded(READ_SEED):
            for record in fetch(dataset, positions):
                found = fingerprint(record)
                digest.update(found.digest if found is not None else b"opaque")
    except Exception:  # noqa: BLE001  (a dataset the later checks refuse by name: the collectives still run)
        digest.update(b"unreadable")
    mine = int.from_bytes(digest.digest(), "little", signed=True)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    values = torch.tensor([n, mine], dtype=torch.int64, device=device)
    highest, lowest = values.clone(), values.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    if not torch.equal(highest, lowest):
        what = "lengths" if int(highest[0]) != int(lowest[0]) else "records"
        raise PrivacyConfigurationError(
            f"The training datasets differ between the ranks (their {what}: "
            f"{int(lowest[0])}–{int(highest[0])} records). Poisson sampling draws the same indices on every rank "
            "from one population and the accounting is for that population: a split, shuffle or subsample drawn per "
            "rank (an unseeded numpy.random.default_rng(), a seed plus the rank) puts one record at different indices "
            "on different ranks — drawn twice in a step, at twice the rate — and the ranks' N and q disagree. Nothing "
            "was released. Build the dataset alike on every rank (a fixed seed in the datamodule's setup, the same "
            "for all ranks: pl.seed_everything(seed) before fit, not seed + rank).")


def _check_empty_read(dataset: Any) -> None:
    many = getattr(dataset, "__getitems__", None)
    if not many:
        return
    try:
        many([])
    except Exception as err:  # noqa: BLE001  (the user's __getitems__, any failure)
        raise PrivacyConfigurationError(
            f"The training dataset's __getitems__ fails on an empty list of indices ({type(err).__name__}). Poisson "
            "sampling draws each record independently, so a step's batch can be empty, and the loader then calls "
            "__getitems__([]): make it return [] (an empty list of records).") from err


def _check_fixed_records(dataset: Any, at: Callable[[int], int], n: int) -> None:
    """Read a few public indices as one batch, twice with one seed and once rotated by one place with it: the same
    batch must give the same records, and the rotated batch must not give the records in the same order (it does
    when each record is drawn whatever its index, or when all of them are equal). Batches, as the loader reads
    them: a ``__getitems__`` that works on its batch as a whole is read as it is meant to be."""
    chosen = _probed(dataset, at, n)
    first, again, rotated = (_read(dataset, order) for order in (chosen, chosen, chosen[1:] + chosen[:1]))
    if first is None or again is None or rotated is None:
        return  # no fingerprint: not checked
    if first != again:
        raise PrivacyConfigurationError(
            f"The training dataset gives different records for the same index: indices {chosen}, read twice with "
            "torch's, NumPy's and Python's random generators seeded alike, gave different records (a random chunk "
            "drawn in __getitem__, or randomness from a generator of the dataset's own such as "
            "numpy.random.default_rng()). Poisson sampling draws indices, so a step would use data other than the "
            "records it sampled. " + _FIXED_FIX)
    if len(chosen) > 1 and first == rotated:
        raise PrivacyConfigurationError(
            f"The training dataset ignores its index: indices {chosen} read in another order, with the same seed, gave "
            "the same records in the same order (a record drawn at random in __getitem__ whatever the index, e.g. a "
            "random text chunk). Poisson sampling draws indices, so a step would use data other than the records "
            "it sampled. " + _FIXED_FIX)


def _probed(dataset: Any, at: Callable[[int], int], n: int) -> list[int]:
    """The indices :func:`_check_fixed_records` reads: :data:`FIXED_RECORD_PROBES` positions spread evenly over the
    population; when some of them read an empty record (``None`` for an unreadable file, which the collate drops:
    :mod:`~lightning_dp.records.empty_records`; all empty ones are alike whatever the index), the first positions
    holding data among up to 16 times as many spread alike, each read alone with the seed (zoo28 d02b)."""
    def spread(k: int) -> list[int]:
        return sorted({at(round(j * (n - 1) / max(1, k - 1))) for j in range(k)})

    chosen = spread(FIXED_RECORD_PROBES)
    if not any(is_empty(_read_one(dataset, i)) for i in chosen):
        return chosen
    holding = [i for i in spread(min(n, 16 * FIXED_RECORD_PROBES)) if not is_empty(_read_one(dataset, i))]
    if len(holding) <= FIXED_RECORD_PROBES:
        return holding or chosen
    return [holding[round(j * (len(holding) - 1) / (FIXED_RECORD_PROBES - 1))] for j in range(FIXED_RECORD_PROBES)]


def _read_one(dataset: Any, index: int) -> Any:
    """The record at ``index`` as the loader reads it alone, the generators seeded."""
    with seeded(READ_SEED):
        items = fetch(dataset, [index])
    return items[0] if isinstance(items, (list, tuple)) and len(items) == 1 else items


def _read(dataset: Any, indices: list[int]) -> Optional[bytes]:
    """The digest of the batch ``indices`` read as the loader reads it, the generators seeded (``None``: opaque)."""
    with seeded(READ_SEED):
        found = fingerprint(fetch(dataset, indices))
    return None if found is None else found.digest


def _declared_distinct(dataset: Any) -> bool:
    """Whether the loader's dataset, or the one a chain of Subsets of it takes, is a :class:`DistinctRecords`."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return isinstance(dataset, DistinctRecords)
