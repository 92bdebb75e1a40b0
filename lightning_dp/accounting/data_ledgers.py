"""The releases made on each training dataset in this process: the record of the data, beside the module's.

The privacy unit is the record. A module's ledger (:mod:`~lightning_dp.accounting.module_ledgers`) follows the
weights: a second fit of the same module, a copy of its weights, an EMA of them continue it. A *fresh* model trained
on the same records does not descend from those weights, yet each record it reads has already been released by the
earlier fits. k-fold cross-validation is the common case: per fold a fresh model and a fresh ``DPStrategy`` on 4/5 of
the rows, the k models ensembled; every record is in k − 1 released models, so its privacy loss is the composition of
those fits (Dwork & Roth 2014, Thm. 3.16), not one fit's ε.

This module keeps, process-wide, each private fit's ledger against the data it reads (:func:`register`, at the fit's
training loader), and a later fit whose data share a record with earlier fits continues their releases
(:func:`continue_on_data`): its ε, ``target_epsilon``'s calibration and ``PrivacyBudget`` count them.

The same data (:class:`DataUse`, compared by :func:`shares_records`):

* the same dataset object under ``Subset``/``ConcatDataset`` wrappers (``random_split`` folds, ``Subset(ds,
  train_idx)``), at index sets that overlap. Index sets of one dataset that are disjoint (a dataset split in parts,
  one model per part) are parallel composition: each fit's ledger stands alone;
* otherwise rows of the same content (``TensorDataset(X[idx], y[idx])``: copies in new memory): the row digests of
  the items that identify the records (:func:`~lightning_dp.record_checks.stored_sources.identifying_rows`, handed in by
  the strategy), one fit's records holding at least :data:`OVERLAP` of the smaller population's. Beside the bytes,
  each row's values (:mod:`~lightning_dp.record_checks.row_lineage`): as float32 (a cast is the same records), sorted
  (a column order is; only for items whose rows are 99 % distinct by their sorted values: rows of few distinct
  values, binary or small integers, share them), on a grid per column (near-copies: ``X.half().float()``,
  ``X.round(3)``; two kinds, two grids; only for items whose rows are distinct by them), and read through the
  library's own transforms
  (``PrivateStandardizer``, ``PrivateImputer``: their output rows are the records of their input rows, so
  ``fit_transform(X[idx])`` per fold composes);
* otherwise tensors or NumPy arrays in overlapping memory (views of one buffer, ``torch.from_numpy``): conservative,
  as if every record of both were shared.

Datasets, tensors and arrays are held weakly: a record whose data were all freed (and held no digests) is dropped.

Across processes: at the end of each fit its digests and ledger are written to the ledger store
(:func:`persist`, :mod:`~lightning_dp.accounting.data_store`: bounded, ``LIGHTNING_DP_LEDGER_STORE=off`` turns it
off), and a fit in a later process continues the stored records its records share, as it would in one process.

Releases are counted once (a union, not a sum): each ledger entry names the fit that made it
(:attr:`~lightning_dp.accounting.ledger.LedgerEntry.run`); a fit's entries already in the ledger (a second fit of the
same module, which continues its own record, on the same data) are not added again (:func:`union`).

One ledger counts one unit. A fit per user continues earlier fits on its records charged by group privacy over the
earlier units one of its users covers (:func:`per_user`: each release (σ, q) counts as (σ/k, 1 − (1 − q)^k); k = m,
the most records one user holds, after fits per example; after fits per user, k from the partitions of the records
into users, kept with the data's record, an earlier user held in part counted twice:
:mod:`~lightning_dp.accounting.unit_partitions`); a fit per example after
fits per user on its records is refused (:func:`continue_on_data`). Fits inside :func:`apart` (the privacy
auditor's trials) neither continue nor join the record; a later fit on their records while a model trained inside
is alive warns.

:func:`forget_data_releases` clears the record (a notebook that starts over on other data): clearing it while the
same records are trained on again understates their privacy loss, so it warns.
"""

from __future__ import annotations

import gc
import uuid
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

import lightning_dp.accounting.data_store as data_store
import lightning_dp.accounting.store_key as store_key
from lightning_dp.accounting.ledger import LedgerEntry, PrivacyLedger
from lightning_dp.accounting.module_ledgers import Combined, combine, held_runs
from lightning_dp.accounting.unit_partitions import Partition, UserGroups, bases_of, covering, same_units
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_checks.row_lineage import dataset_rows, forget_notes
from lightning_dp.records.memory_spans import memory_owner, memory_span

OVERLAP = 0.05
"""The share of the smaller population's records another fit's rows must hold (by content) for the two to share
records (a few equal rows in two sources are natural: two people's identical short messages). The same as
:data:`~lightning_dp.record_checks.stored_sources.OVERLAP`."""

Digests = dict[tuple, np.ndarray]
"""Per kind of identifying item, the sorted row digests of the records a fit reads."""


@dataclass
class DataUse:
    """The data one fit's training loader reads.

    Attributes:
        bases: (a weak reference to a dataset under its ``Subset``/``ConcatDataset`` wrappers, the indices of it read;
            ``None``: all).
        digests: the row digests of the records read (:data:`Digests`; empty when none identifies them).
        memory: (a weak reference to the tensor or array that owns the memory, device, first byte, end byte) of each
            tensor and in-memory NumPy array the datasets hold.
        key: the name of its data record in the ledger store (:mod:`~lightning_dp.accounting.data_store`).
        sample: the threshold of the sample of records its digests keep (``None``: all; a stored record's).
        partition: how a fit per user's records fall into its users (:mod:`~.unit_partitions`; ``None``: a fit per
            example's records are its units; for a fit per user, unknown: a later fit is charged the worst case).
        keyed: whether ``digests`` are the ledger store's keyed ones (a stored record's, :mod:`~.store_key`): the
            other side of a comparison is keyed alike (:func:`shares_records`).
    """

    bases: list[tuple[weakref.ref, Optional[frozenset[int]]]] = field(default_factory=list)
    digests: Digests = field(default_factory=dict)
    memory: list[tuple[weakref.ref, str, int, int]] = field(default_factory=list)
    key: str = field(default_factory=lambda: f"data-{uuid.uuid4().hex}")
    sample: Optional[int] = None
    partition: Optional[Partition] = None
    keyed: bool = False
    _stored: dict[tuple, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def alive(self) -> bool:
        """Whether it can still be matched: digests, or a dataset or buffer not freed."""
        return bool(self.digests) or any(ref() is not None for ref, _ in self.bases) or any(
            ref() is not None for ref, *_ in self.memory)


_RELEASES: list[tuple[DataUse, PrivacyLedger]] = []
"""Every private fit's data and its ledger (the strategy's own: it grows as the fit releases), oldest first."""
_APART = [0]
"""How many :func:`apart` scopes are open: fits inside neither continue nor join the data's record."""
_APART_FITS: list[tuple[DataUse, PrivacyLedger]] = []
"""The latest fits made inside :func:`apart` (at most :data:`_APART_KEPT`): a later fit on their records whose model
is still alive is warned (:func:`_warn_apart`)."""
_APART_KEPT = 16


@contextmanager
def apart() -> Iterator[None]:
    """Fits made inside stand apart from the data's record: none continues the releases earlier fits made on its
    records, and none is registered (nor written to the ledger store) for later fits to continue. For the privacy
    auditor (:mod:`~lightning_dp.audit.runner`), whose trials are runs of the mechanism each audited alone (its claim
    is one trial's ε); their releases on the data are then not counted by later fits on it (audit on data whose
    privacy is not at stake, or count them yourself). A module's own record (a trained model's ledger) is kept, and a
    later fit outside on the same records, while a model trained inside is still alive in this process (kept, so
    perhaps released), warns that its ε leaves those releases out."""
    _APART[0] += 1
    try:
        yield
    finally:
        _APART[0] -= 1


def data_use(dataset: Any, indices: Optional[set[int]] = None, digests: Optional[Digests] = None) -> DataUse:
    """The :class:`DataUse` of a loader over ``dataset`` reading positions ``indices`` of it (``None``: all), whose
    records' row digests are ``digests``."""
    use = DataUse(digests=dict(digests or {}))
    for base, rows in bases_of(dataset, None if indices is None else sorted(indices)):
        try:
            use.bases.append((weakref.ref(base), None if rows is None else frozenset(rows)))
        except TypeError:  # an object without weak references: found by content and memory only
            pass
        for kind, per_row in dataset_rows(base).items():  # values through casts, column orders, the transforms
            picked = per_row if rows is None else per_row[np.asarray([i for i in rows if i < len(per_row)], dtype=int)]
            picked = picked[picked != 0]
            if len(picked):
                use.digests[kind] = np.union1d(use.digests.get(kind, picked[:0]), picked)
    use.memory = _memory(dataset)
    return use


def _memory(dataset: Any) -> list[tuple[weakref.ref, str, int, int]]:
    """Where the tensors and in-memory NumPy arrays ``dataset``'s datasets hold live (:attr:`DataUse.memory`)."""
    from lightning_dp.fingerprints.dataset_tokens import dataset_parts

    datasets, tensors = dataset_parts(dataset)
    held: list[Any] = [t for _, t in tensors]
    for part in datasets:
        for value in (vars(part).values() if hasattr(part, "__dict__") else ()):
            items = value if isinstance(value, (list, tuple)) and len(value) <= 64 else [value]
            held += [a for a in items if isinstance(a, np.ndarray) and not isinstance(a, np.memmap)]
    out = []
    for value in held:
        span = _span(value)
        if span is not None:
            try:
                out.append((weakref.ref(span[0]), *span[1:]))
            except TypeError:
                pass
    return out


def _span(value: Any) -> Optional[tuple[Any, str, int, int]]:
    """(the object owning ``value``'s memory, its device, first byte, end byte), ``None`` for an empty one."""
    if isinstance(value, np.ndarray):
        empty = not value.size
    else:
        empty = not value.numel() or value.is_sparse or hasattr(value, "to_local")
    if empty:
        return None
    span = memory_span(value)
    return None if span is None else (memory_owner(value), *span)


def shares_records(a: DataUse, b: DataUse) -> bool:
    """Whether two fits' data hold a record in common (module docstring: the same dataset at overlapping indices;
    else by content; else by memory)."""
    compared = False
    for ref_a, rows_a in a.bases:
        for ref_b, rows_b in b.bases:
            base = ref_a()
            if base is not None and base is ref_b():
                if rows_a is None or rows_b is None or not rows_a.isdisjoint(rows_b):
                    return True
                compared = True  # disjoint indices of one dataset: parallel composition
    common = [kind for kind in a.digests if kind in b.digests]
    if common:  # a stored record keeps a sample of its records' digests: both compared on that sample
        limit = min((s for s in (a.sample, b.sample) if s is not None), default=None)
        mine, theirs = _sample(a, limit), _sample(b, limit)
        n = min(max(len(d) for d in mine.values()), max(len(d) for d in theirs.values()))
        if a.keyed != b.keyed:  # a stored record's keyed digests: the other's keyed alike
            secret = store_key.secret()
            if secret is None:
                return False
            mine = {k: _keyed(a, k, limit, mine[k], secret) for k in common}
            theirs = {k: _keyed(b, k, limit, theirs[k], secret) for k in common}
        hits = max(int(np.isin(mine[k], theirs[k]).sum()) for k in common)
        return bool(hits) and hits >= OVERLAP * n
    if compared:
        return False
    for ref_a, device_a, low_a, high_a in a.memory:
        for ref_b, device_b, low_b, high_b in b.memory:
            if device_a == device_b and low_a < high_b and low_b < high_a and ref_a() is not None \
                    and ref_b() is not None:
                return True
    return False


def _sample(use: DataUse, limit: Optional[int]) -> Digests:
    """``use``'s digests on the sample of threshold ``limit`` (:func:`~.data_store.sampled`); a stored record's
    (keyed) are its own sample already."""
    if use.keyed:
        return use.digests
    return {k: data_store.sampled(d, limit) for k, d in use.digests.items()}


def _keyed(use: DataUse, kind: tuple, limit: Optional[int], digests: np.ndarray, secret: bytes) -> np.ndarray:
    """``digests`` (``use``'s of ``kind`` on the sample ``limit``) as the ledger store holds them
    (:func:`~.store_key.keyed`). Every digest of ``kind`` is keyed once and cached on ``use`` (one fit is compared with
    every stored record, each on its own sample: the sample is chosen on the digests as computed)."""
    if use.keyed:
        return digests
    every = use._stored.get((kind, secret))
    if every is None:
        if len(use._stored) > 64:
            use._stored.clear()
        every = use._stored[(kind, secret)] = store_key.keyed(use.digests[kind], secret)
    return every if limit is None else every[data_store.in_sample(use.digests[kind], limit)]


def releases_on(use: DataUse) -> list[PrivacyLedger]:
    """The ledgers of the earlier fits whose data share a record with ``use`` (each once, oldest first): this
    process's, then the ledger store's data records of fits not in this process (:func:`stored_uses`)."""
    return [ledger for ledger, _ in _held_on(use)]


def _held_on(use: DataUse) -> list[tuple[PrivacyLedger, list[DataUse]]]:
    """:func:`releases_on`, each ledger with its registrations that share a record with ``use``."""
    found: list[tuple[PrivacyLedger, list[DataUse]]] = []
    for held, ledger in _RELEASES + stored_uses():
        if shares_records(held, use):
            for other, uses in found:
                if other is ledger:
                    uses.append(held)
                    break
            else:
                found.append((ledger, [held]))
    return found


def stored_uses() -> list[tuple[DataUse, PrivacyLedger]]:
    """The ledger store's data records (:mod:`~lightning_dp.accounting.data_store`) other than this process's own
    fits' (whose ledgers here are as new or newer), as :class:`DataUse` of digests alone."""
    own = {held.key for held, _ in _RELEASES}
    return [(DataUse(digests=digests, key=key, sample=limit, partition=partition, keyed=True), ledger)
            for key, digests, limit, ledger, partition in data_store.read() if key not in own]


def persist(ledger: PrivacyLedger) -> None:
    """Write the data record of each registration of ``ledger`` (a fit's, at its end) to the ledger store, so that a
    fit in a new process on the same records continues its releases (:mod:`~lightning_dp.accounting.data_store`)."""
    for held, kept in _RELEASES:
        if kept is ledger and held.digests:
            data_store.write(held.key, held.digests, ledger, held.partition)


def register(use: DataUse, ledger: PrivacyLedger) -> None:
    """From now on ``ledger``'s releases (as it grows) are releases on the records of ``use`` (a second registration
    on the same records when their units differ: a later fit is charged by both partitions)."""
    _RELEASES[:] = [(held, kept) for held, kept in _RELEASES if held.alive()]
    if not any(kept is ledger and shares_records(held, use) and same_units(held.partition, use.partition)
               for held, kept in _RELEASES):
        _RELEASES.append((use, ledger))


def union(first: PrivacyLedger, second: PrivacyLedger) -> Combined:
    """``first`` followed by the releases of ``second`` it does not hold: per fit (:attr:`LedgerEntry.run`), the
    entries of that fit ``second`` holds beyond ``first``'s (one fit's entries in two ledgers are a prefix of one
    another: :func:`~lightning_dp.accounting.module_ledgers.combine`; entries of unknown run are taken as one
    history). ``first`` is a prefix of the result."""
    runs: list[Optional[str]] = []
    for e in second.entries:
        if e.run not in runs:
            runs.append(e.run)
    rest: list[LedgerEntry] = []
    for run in runs:
        mine, theirs = _of_run(first, run), _of_run(second, run)
        rest += _after(combine(mine, theirs).ledger.entries, mine.steps)
    if rest and first.steps and first.unit != second.unit:  # one ledger counts one unit (:func:`per_user`)
        raise ValueError(f"union: a ledger per {first.unit} cannot hold releases accounted per {second.unit}")
    out = PrivacyLedger()
    out.load_entries((*first.entries, *rest))
    # an empty ``first`` (a fresh module's ledger, before its unit is set) takes the unit of the releases it continues
    out.unit = first.unit if first.steps else second.unit
    added = out.steps - first.steps
    return Combined(out, added, diverged=added > 0 and first.steps > 0)


def _of_run(ledger: PrivacyLedger, run: Optional[str]) -> PrivacyLedger:
    out = PrivacyLedger()
    out.load_entries(e for e in ledger.entries if e.run == run)
    return out


def _after(entries: tuple[LedgerEntry, ...], steps: int) -> list[LedgerEntry]:
    """``entries`` less their first ``steps`` releases."""
    out = []
    for e in entries:
        if steps >= e.steps:
            steps -= e.steps
            continue
        out.append(LedgerEntry(e.noise_multiplier, e.sample_rate, e.steps - steps, e.private, e.run))
        steps = 0
    return out


def per_user(ledger: PrivacyLedger, group: int) -> PrivacyLedger:
    """``ledger``'s releases per example charged per user, for users holding at most ``group`` records each.

    A user's records are a group: one release of the sampled Gaussian mechanism per example (σ, q) moves by at most
    ``group`` clipped terms when all of a user's records go, and takes part (any of them sampled) with probability
    1 − (1 − q)^group. So each entry becomes (σ / group, 1 − (1 − q)^group): the group-privacy bound of the sampled
    Gaussian (its sensitivity ``group`` C, sampled at the chance that the user takes part), never below the entry
    itself, and the entry unchanged when every user has one record. Runs are kept: the same fit's releases charged
    twice alike are one history (:func:`union`)."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    out = PrivacyLedger()
    out.load_entries(e if group == 1 else LedgerEntry(e.noise_multiplier / group, 1.0 - (1.0 - e.sample_rate) ** group,
                                                      e.steps, e.private, e.run) for e in ledger.entries)
    out.unit = "user"
    return out


def largest_group(users: Any, dataset: Any) -> int:
    """The most records one user holds in ``dataset`` (``users``: the fit's
    :class:`~lightning_dp.units.Users`): the group size a release per example on these records is charged with
    (:func:`per_user`)."""
    return UserGroups(users, dataset)()


def continue_on_data(ledger: PrivacyLedger, use: DataUse, unit: str = "example",
                     group: Optional[Callable[[], int]] = None) -> Optional[str]:
    """Continue, in ``ledger`` (a fit's, before its first release), every release earlier fits in this process made on
    records ``use`` reads, and register ``ledger`` against them. Earlier processes' fits (the ledger store's data
    records) are continued too when :func:`~lightning_dp.accounting.data_store.composes`, else named in a warning.
    Returns a log line when it grew (``None``: it already held them all, or there were none).

    ``unit`` is the fit's privacy unit (``"example"`` or ``"user"``). A fit per user continues an earlier fit's
    releases charged by group privacy over the earlier units one of its users covers (:func:`per_user`): k = m, the
    most records one of its users holds (``group()``), after a fit per example; after a fit per user, k from that
    fit's users one of its users' records meet, one met in part counted twice (:func:`~.unit_partitions.covering`,
    by ``group.partition()``, a :class:`~.unit_partitions.UserGroups`: 1 for the same partition), 2m where that is
    not known (with a warning). A fit per example after fits per user on its records is refused (a per-user ledger
    never takes releases per example as they are, nor an example ledger releases per user). A ledger that already
    holds releases in another unit (a module's own record) is left to the private step's unit check."""
    if _APART[0]:
        _APART_FITS.append((use, ledger))
        del _APART_FITS[:-_APART_KEPT]
        return None
    found = [(other, held) for other, held in _held_on(use) if other is not ledger]
    if not data_store.composes():
        process = [kept for _, kept in _RELEASES]
        stored = [other for other, _ in found if all(other is not kept for kept in process)]
        found = [(other, held) for other, held in found if any(other is kept for kept in process)]
        _warn_stored(stored)
    _warn_apart(ledger, use)
    if ledger.steps and getattr(ledger, "unit", "example") != unit:
        return None  # refused before any release (StepChecks._check_ledger_unit): the module's own record
    if unit == "example" and any(other.unit != "example" for other, _ in found):
        raise _per_user_refusal(sum(other.unit != "example" for other, _ in found))
    if unit == "user" and hasattr(group, "partition"):
        use.partition = group.partition()  # type: ignore[union-attr]
    before, fits, unknown = ledger.steps, 0, 0
    for other, held in found:
        if unit == "user":  # charged by group privacy over the earlier units one user covers
            if group is None:
                raise ValueError("continue_on_data: a fit per user continuing earlier fits needs group=")
            size = _covered(other, held, use.partition, group)
            unknown += size is None
            other = per_user(other, 2 * group() if size is None else size)  # unknown: every record a unit in part
        combined = union(ledger, other)
        if combined.added:
            fits += 1
            ledger.load_entries(combined.ledger.entries)  # appended: running totals read from it stay valid
            ledger.unit = combined.ledger.unit
    register(use, ledger)
    if unknown:
        _warn_unknown_units(unknown)
    if not fits:
        return None
    return (f"{fits} earlier private fit(s) (in this process, or in the ledger store) trained on records this fit "
            f"reads (k-fold cross-validation, a fresh model on the same rows): the ledger continues the releases "
            f"already made on this data ({ledger.steps - before} more, {ledger.steps} in all), so ε, target_epsilon "
            "and PrivacyBudget count them too")


def _covered(other: PrivacyLedger, held: list[DataUse], partition: Optional[Partition],
             group: Callable[[], int]) -> Optional[int]:
    """k for ``other``'s releases in a fit per user of ``partition`` (:func:`continue_on_data`): m after a fit per
    example; after a fit per user :func:`~.unit_partitions.covering` (at most 2m); ``None``: not known."""
    if other.unit == "example":
        return group()
    if partition is None:
        return None
    sizes = [covering(use.partition, partition) for use in held]
    if any(size is None for size in sizes):
        return None
    k = max(sizes, default=1)  # type: ignore[type-var]
    return 1 if k <= 1 else min(k, 2 * group())


def _per_user_refusal(fits: int) -> PrivacyConfigurationError:
    return PrivacyConfigurationError(
        f"this fit is per example, but {fits} earlier private fit(s) (in this process, or in the ledger store) trained "
        "per user (privacy_unit=Users(...)) on records it reads: their releases are accounted per user, and one ε "
        "per example cannot count them. Train this fit per user as well (DPStrategy(privacy_unit=Users(<the users of "
        "these records>, ...))): its ε per user then counts both; or train it on records those fits did not read; or, "
        "if their models (and anything computed from them) were thrown away, call "
        "lightning_dp.accounting.forget_data_releases(dataset) first.")


def _warn_stored(stored: list[PrivacyLedger]) -> None:
    """Name earlier processes' fits on this fit's records, left out of its ledger (``LIGHTNING_DP_DATA_RECORDS``)."""
    if not stored:
        return
    steps = sum(other.steps for other in stored)
    warnings.warn(f"{len(stored)} private fit(s) in earlier processes on this machine trained on records this fit "
                  f"reads ({steps} release(s) in all; the ledger store's data records). They are NOT counted in this "
                  "fit's ε: right when their models were thrown away (a run done again), an understatement when they "
                  f"are kept (k-fold folds run one per process, an ensemble). Set {data_store.ENV}=compose to count "
                  "them; lightning_dp.accounting.forget_data_releases() clears the record.", UserWarning,
                  stacklevel=3)


def _warn_unknown_units(fits: int) -> None:
    """Name earlier fits per user whose users this fit cannot relate to its own (charged the worst case)."""
    warnings.warn(f"{fits} earlier private fit(s) per user on records this fit reads left no record of how their "
                  "records fall into their users (a ledger store record written by an earlier version of "
                  "lightning_dp, a population too large to keep, rows that identify no record), so whether this fit's "
                  "users are theirs cannot be told: their releases are charged as if each record of this fit's users "
                  "were part of another of their users (group privacy over 2m, m the most records one user holds; "
                  "docs/user_level.md). ε per user is then conservative, never understated. Fitting the earlier "
                  "fits again with this version keeps the partition.",
                  UserWarning, stacklevel=3)


def _warn_apart(ledger: PrivacyLedger, use: DataUse) -> None:
    """Warn when a fit made inside :func:`apart` on records ``use`` reads left a model still alive in this process
    (its releases are not in ``ledger``, which counts only the data's record)."""
    runs = {kept.run for held, kept in _APART_FITS if kept.run is not None and shares_records(held, use)}
    runs -= {e.run for e in ledger.entries}  # the model trained inside, trained again: its own record continued
    if not runs:
        return
    gc.collect()  # a finished trainer and its module hold one another: only a model kept is alive after a collection
    alive = runs & held_runs()
    if alive:
        warnings.warn(f"{len(alive)} model(s) trained inside lightning_dp.accounting.data_ledgers.apart() (the privacy "
                      "auditor's trials) on records this fit reads are still alive in this process: their releases "
                      "stand apart from the data's record and are NOT counted in this fit's ε. If such a model (or "
                      "anything computed from it) is kept or released, ε understates the records' privacy loss: "
                      "train it outside apart(), or delete it before this fit.", UserWarning, stacklevel=3)


def forget_data_releases(dataset: Any = None) -> int:
    """Forget the releases made on ``dataset``'s records (``None``: on every dataset) in this process and in the ledger
    store's data records (:mod:`~lightning_dp.accounting.data_store`), e.g. in a notebook that starts over. A fit on
    those records afterwards reports ε without them: **understated** if the released models (or anything computed
    from them) are kept, so a warning says so. Returns how many fits' records were dropped. (A module's own record,
    :mod:`~lightning_dp.accounting.module_ledgers`, stays.)"""
    if dataset is None:
        keys = {held.key for held, _ in _RELEASES} | {key for key, *_ in data_store.read()}
        _RELEASES.clear()
        data_store.remove(None)
    else:
        use = data_use(dataset)
        keys = {held.key for held, _ in _RELEASES + stored_uses() if shares_records(held, use)}
        _RELEASES[:] = [(held, ledger) for held, ledger in _RELEASES if held.key not in keys]
        data_store.remove(keys)
    dropped = len(keys)
    if dropped:
        warnings.warn(f"forget_data_releases: the releases of {dropped} private fit(s) on these records are "
                      "forgotten; a later fit on the same records reports ε without them, which understates their "
                      "privacy loss while the models already released (or anything computed from them) are kept.",
                      UserWarning, stacklevel=2)
    return dropped


def _clear() -> None:
    """Forget every record without a warning, the ledger store's data records and the transforms' notes
    (:mod:`~lightning_dp.record_checks.row_lineage`) too: for the test suite (each test stands for a process of its
    own, on a store of its own)."""
    _RELEASES.clear()
    _APART_FITS.clear()
    forget_notes()
    data_store.remove(None)
