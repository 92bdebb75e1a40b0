"""Records repeated by content: what a dataset that repeats its data looks like when no wrapper shows it.

A ``__len__`` of 3·n with ``__getitem__`` reading ``data[i % n]``, an oversampling index list inside a
custom dataset, two ``TensorDataset`` objects over the same tensors in a ``ConcatDataset``: Poisson
sampling gives each copy its own chance per step, so the record's privacy loss adds up over its copies.
Nothing in the dataset's structure says so (:mod:`.record_sources` sees only torch's wrappers); the
records do. Each checked record is read as the loader reads it (:func:`~lightning_dp.records.fetch.fetch`;
a dataset with a ``__getitems__`` of its own in batches of :data:`_BATCH`), with torch's, NumPy's and Python's
generators seeded alike for each read (copies of one record then agree even under random augmentation), and
fingerprinted (:mod:`~lightning_dp.records.record_fingerprint`):

- **the same memory twice** (equal content, and every tensor/array view of the two at one address of one
  buffer: an in-memory dataset mapping two indices to one row): refused, however few.
- **equal content**: natural data repeats too (two people's identical short messages), so what is refused
  is repetition on a scale chance does not explain. With m of the N records checked and P pairs of equal
  records among them, r̂ = P · (N − 1) / (m(m − 1)/2) estimates the mean number of *other* exact copies a
  record has (1 when the data are doubled, 2 when tripled; P(two random records are equal) · (N − 1)).
  Refused when r̂ ≥ :data:`REPEATED_COPIES` (and, for a sample, at least :data:`MIN_PAIRS` pairs seen).
  r̂ is a mean: one record repeated five times among 500 (a hard example upweighted) has r̂ ≈ 0.04, yet that
  person's privacy loss is five records'. So a record seen c ≥ 3 times is also refused when chance does not
  explain it (:func:`_chance_of`): records drawn from a distribution whose collision probability p is what the
  *other* equal pairs show, spread over 1/p equally likely values, give a value c times or more about
  (1/p) · P(Poisson(m·p) ≥ c) times; refused when that is under :data:`CHANCE` (no other pair: any triple).
  Natural data concentrated on one value (an empty text) is refused too: declare it.
- **any exact copy below these rules** is warned (:class:`RepeatedRecordsWarning`): how many checked records have
  a copy and the largest number of identical records (counts only), with the fixes; for a sample, what it cannot
  show (a pair is in it with probability ≈ (m/N)², a record with under ≈ 3N/m copies seldom thrice).

Which records: all of them when N ≤ :data:`CONTENT_CHECK_RECORDS` (exact for byte-identical copies);
otherwise a public random sample of that many, a birthday test: data doubled give
m(m − 1)/2 / (N − 1) ≈ 50 pairs in expectation at N = 10⁶, m = 10⁴ (≈ 5 at N = 10⁷; then detected with
probability ≈ 0.88). Reading stops early once :data:`CONTENT_CHECK_BYTES` have been digested (the records
read so far are still a random sample). The same records on every rank (the sample's seed is public): every
rank reaches the same verdict. Cost: one read and one digest per checked record (measured in docs/verification.md).

- **near-identical content** (:func:`_refuse_near_copies`): the same count on the records' digests with every
  floating-point tensor or array of 4 values or more rounded to a grid of 1e-3 of its scale, two grids offset by
  half a step (:func:`~lightning_dp.records.record_fingerprint.near_digest`): copies with jitter added (SMOTE-like
  oversampling) meet on one of them.

What it cannot see: copies that differ by more than the grid (re-encoded or resized images, a copy with its own
augmentation drawn from a generator of its own, a record that carries its position, jitter of 1e-3 of the scale or
more), near copies of records with fewer than 4 floating-point values, repetition below
:data:`REPEATED_COPIES` by content alone that chance could explain (warned, not refused: a record twice), and
repetition in a large dataset too sparse for the sample; records without a fingerprint (opaque objects) are not
checked. Empty records (``None`` for an unreadable file, dropped by the collate:
:mod:`~lightning_dp.records.empty_records`) are not counted: N and the records checked are those that hold data.
:class:`~lightning_dp.data.DistinctRecords` skips this check (and its warning) for data whose identical records are
different people's.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter, defaultdict
from typing import Any, Callable, Optional

import numpy as np
import torch

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.empty_records import is_empty
from lightning_dp.records.fetch import fetch, reads_per_index, reseed, seeded
from lightning_dp.records.record_fingerprint import NEAR_SCALE, Fingerprint, fingerprint, near_digest
from lightning_dp.record_checks.record_sources import REPEAT_FIX

CONTENT_CHECK_RECORDS = 10_000
"""Records read and digested: all of them up to this many, a random sample of this many beyond."""

CONTENT_CHECK_BYTES = 256 * 2**20
"""Digesting stops after this many bytes of record data (large records: fewer are checked)."""

HELD_BYTES = 256 * 2**20
"""Buffers kept alive so that an address names one buffer while records are compared (in-memory datasets hold
theirs anyway; beyond this, later views are compared by content only)."""

REPEATED_COPIES = 0.05
"""Refused when records have on average this many other exact copies or more (5 % of them with one copy each)."""

CHANCE = 1e-3
"""Refused when the expected number of values repeated as often as the most repeated record, by chance
(:func:`_chance_of`), is under this."""

MIN_PAIRS = 3
"""Equal pairs a sample must show before its estimate is trusted (one chance pair in a huge dataset is not
repetition)."""

READ_SEED = 0x5EED
"""The seed every record is read with (public)."""

_SAMPLE_SEED = 0xD0C5
"""Seed of the public random order in which records are checked."""

_BATCH = 64
"""Records read per call from a dataset with a ``__getitems__`` of its own (the loader reads it in batches)."""


class RepeatedRecordsWarning(UserWarning):
    """Some training records have exact copies, too few to refuse: each copy is a chance more per step for one
    person's record, unless they are different people's (:class:`~lightning_dp.data.DistinctRecords`)."""


def check_repeated_records(dataset: Any, at: Callable[[int], int], n: int) -> None:
    """Refuse a population of ``n`` records (position k is dataset index ``at(k)``) that repeats records.

    Raises:
        PrivacyConfigurationError: the same memory read at two positions, or repetition by content beyond
            :data:`REPEATED_COPIES` (see the module docstring).
    """
    found = _fingerprints(dataset, at, n)
    if found is None or len(found[0]) < 2:
        return
    prints, near, read = found
    n = round(n * len(prints) / read)  # the records that hold data (empty ones, None, are not copies: zoo28 d02)
    _refuse_same_memory(prints)
    _refuse_repeated_content(prints, n)
    _refuse_near_copies(near, n)


def checked_positions(n: int) -> np.ndarray:
    """The population positions checked, in the order they are read: all ``n`` up to :data:`CONTENT_CHECK_RECORDS`,
    else that many drawn without replacement, from a public seed (the same on every rank and run)."""
    return np.random.default_rng(_SAMPLE_SEED).choice(n, size=min(n, CONTENT_CHECK_RECORDS), replace=False)


def _fingerprints(dataset: Any, at: Callable[[int], int], n: int
                  ) -> Optional[tuple[dict[int, Fingerprint], list[dict[int, bytes]], int]]:
    """Fingerprints of the checked records that hold data by dataset index, their digests on the two grids of
    :func:`~lightning_dp.records.record_fingerprint.near_digest`, and how many records were read (``None``: some
    record has no fingerprint). Empty records (:func:`~lightning_dp.records.empty_records.is_empty`: ``None`` for an
    unreadable file, which the collate drops) hold no data: all alike, they are no one's copies."""
    order = [at(int(p)) for p in checked_positions(n)]
    step = 1 if reads_per_index(dataset) else _BATCH
    prints: dict[int, Fingerprint] = {}
    near: list[dict[int, bytes]] = [{}, {}]
    digested = held = read = 0
    buffers: set[int] = set()
    with seeded(READ_SEED):
        for start in range(0, len(order), step):
            indices = order[start:start + step]
            reseed(READ_SEED)
            for index, record in zip(indices, _records(dataset, indices)):
                read += 1
                if is_empty(record):
                    continue
                found = fingerprint(record)
                if found is None:
                    return None
                new = {_buffer_key(o): _nbytes(o) for o in found.owners if _buffer_key(o) not in buffers}
                if held + sum(new.values()) <= HELD_BYTES:
                    held += sum(new.values())
                    buffers.update(new)
                else:  # compared by content only
                    found = Fingerprint(found.digest, (), (), found.nbytes)
                prints[index] = found
                for grid, offset in zip(near, (0.0, 0.5)):
                    grid[index] = near_digest(record, offset) or found.digest
                digested += found.nbytes
            if digested >= CONTENT_CHECK_BYTES:
                break
    return prints, near, max(read, 1)


def _records(dataset: Any, indices: list[int]) -> list[Any]:
    """The records of ``indices`` as the loader's fetcher reads them in one batch (one by one if its batch is not a
    list of records)."""
    items = fetch(dataset, indices)
    if isinstance(items, (list, tuple)) and len(items) == len(indices):
        return list(items)
    if len(indices) == 1:
        return [items]
    return [record for index in indices for record in _records(dataset, [index])]


def _buffer_key(buffer: Any) -> int:
    """A torch storage by its address (each ``untyped_storage()`` call makes a new handle), an array by identity."""
    return int(buffer.data_ptr()) if isinstance(buffer, torch.UntypedStorage) else id(buffer)


def _nbytes(buffer: Any) -> int:
    return int(buffer.nbytes() if isinstance(buffer, torch.UntypedStorage) else buffer.nbytes)


def _refuse_same_memory(prints: dict[int, Fingerprint]) -> None:
    places: dict[tuple[Any, ...], int] = {}
    for index, found in prints.items():
        if not found.places:
            continue
        key = (found.digest, found.places)
        if key in places:
            first, second = sorted((places[key], index))
            raise PrivacyConfigurationError(
                f"The training dataset reads one record more than once: indices {first} and {second} give the same "
                "record from the same memory (a __getitem__ that maps several indices to one row: a __len__ larger "
                "than the data with index % n, an oversampling index list). Poisson sampling gives every index its "
                "own chance per step, so that record's privacy loss would add up over its copies. " + REPEAT_FIX)
        places[key] = index


def _refuse_repeated_content(prints: dict[int, Fingerprint], n: int) -> None:
    counts = Counter(found.digest for found in prints.values())
    pairs = sum(c * (c - 1) // 2 for c in counts.values())
    m = len(prints)
    copies = pairs * (n - 1) / (m * (m - 1) / 2)
    if pairs == 0:
        return
    checked = "all" if m == n else f"a random sample of {m}"
    most = max(counts.values())
    if copies < REPEATED_COPIES or (m < n and pairs < MIN_PAIRS):
        if most < 3 or _chance_of(most, pairs - most * (most - 1) // 2, m) >= CHANCE:
            _warn_copies(counts, m, n)
            return
        lead = (f"One training record occurs {most} times (in {checked} of the {n} records: more often than chance "
                "explains, given how rarely the others repeat")
    else:
        lead = (f"The training records repeat: they have on average {copies:.2g} other exact copies each (estimated "
                f"from {checked} of the {n} records")
    first, second = _an_equal_pair(prints, counts)
    raise PrivacyConfigurationError(
        f"{lead}; e.g. indices {first} and {second} hold identical records). That is what a "
        "__len__ that repeats the data (index % n), oversampling or a ConcatDataset of copies looks like, and a "
        "repeated record gets a chance per copy in every step: its privacy loss adds up over its copies. "
        + REPEAT_FIX + " If these are different people's records that happen to be identical, declare it: "
        "lightning_dp.data.DistinctRecords(dataset).")


def _chance_of(c: int, other_pairs: int, m: int) -> float:
    """How many values would occur ``c`` times or more among ``m`` records by chance: records drawn from 1/p equally
    likely values, p the collision probability the ``other_pairs`` show (0 when there are none)."""
    p = other_pairs / (m * (m - 1) / 2)
    if p <= 0:
        return 0.0
    lam = m * p
    if c <= lam:
        return 1.0 / p
    tail = sum(math.exp(-lam + k * math.log(lam) - math.lgamma(k + 1)) for k in range(c, c + 400))
    return tail / p


def _warn_copies(counts: Counter, m: int, n: int) -> None:
    """Exact copies too few to refuse: warned, with counts only (never the records)."""
    with_copies = sum(c for c in counts.values() if c > 1)
    sample = "" if m == n else (
        f" Only a random sample of {m} of the {n} records was checked: a pair of copies is in it with probability "
        f"about {(m / n) ** 2:.2g}, and a record with fewer than about {math.ceil(3 * n / m)} copies seldom shows "
        "three times, so there may be more copies than these.")
    warnings.warn(
        f"lightning_dp: {with_copies} of the {m} training records checked have exact copies among them (the largest "
        f"group: {max(counts.values())} identical records).{sample} If one person's record is repeated (oversampling, "
        "a record upweighted by copying it), each copy is one more chance per step, and that person's privacy loss "
        "is that of as many records as copies while the ledger counts one: deduplicate the data (weight losses "
        "instead of copying records). If these are different people's identical records, declare it: "
        "lightning_dp.data.DistinctRecords(dataset); for several records per person, use user-level units "
        "(DPStrategy(privacy_unit=lightning_dp.Users(user_ids, ...))).", RepeatedRecordsWarning, stacklevel=2)


def _refuse_near_copies(near: list[dict[int, bytes]], n: int) -> None:
    """Records equal but for a small perturbation (copies with jitter added: SMOTE-like oversampling), counted as
    :func:`_refuse_repeated_content` counts exact copies, on the grid where the most pairs meet."""
    m = len(near[0])
    counts = max((Counter(grid.values()) for grid in near), key=lambda c: sum(k * (k - 1) // 2 for k in c.values()))
    pairs = sum(c * (c - 1) // 2 for c in counts.values())
    copies = pairs * (n - 1) / (m * (m - 1) / 2)
    if pairs == 0 or copies < REPEATED_COPIES or (m < n and pairs < MIN_PAIRS):
        return
    grid = next(g for g in near if Counter(g.values()) == counts)
    first, second = _an_equal_pair({i: Fingerprint(d, (), (), 0) for i, d in grid.items()}, counts)
    raise PrivacyConfigurationError(
        f"The training records repeat: they have on average {copies:.2g} other near-identical copies each (equal to "
        f"{NEAR_SCALE:g} of their scale; e.g. indices {first} and {second}). That is what oversampling with jitter "
        "added to the copies (SMOTE-like) looks like: a record and its perturbed copies are one person's data, each "
        "copy with its own chance in every step, so the privacy loss adds up over them. " + REPEAT_FIX
        + " If these are different people's records that happen to be this close, declare it: "
        "lightning_dp.data.DistinctRecords(dataset).")


def _an_equal_pair(prints: dict[int, Fingerprint], counts: Counter) -> tuple[int, int]:
    by_digest: defaultdict[bytes, list[int]] = defaultdict(list)
    for index, found in prints.items():
        if counts[found.digest] > 1:
            by_digest[found.digest].append(index)
    first, second = sorted(min(by_digest.values(), key=min))[:2]
    return first, second
