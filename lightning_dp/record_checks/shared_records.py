"""Records that share data: each record must be made of data no other record reads.

The privacy unit is one record of the dataset the loader reads (rule 8 of docs/release_boundary.md): sampling
charges a record's chances, and clipping bounds what one record adds to a step. A dataset whose records are built
from rows of the data it holds that other records read too — overlapping windows of a series or a token stream
(``x[i:i + w]`` with a stride under w), a record mixed with its neighbour (``0.5 * (x[i] + x[i + 1])``), features
normalised in ``__getitem__`` by statistics of the whole tensor — puts one row's data into several records. Its
influence is then that of several records (k overlapping windows: k·C per step, k chances to be sampled), which the
ledger does not count.

:func:`check_shared_records` looks, once before training, at the arrays the training dataset holds with at least as
many rows (along dimension 0) as there are records: the tensors, NumPy arrays and lists of numbers or strings of its
datasets (:func:`~lightning_dp.fingerprints.dataset_tokens.dataset_parts`) and of the module-level globals of their
classes' modules (the user's code). For a few records r — spread over the population — it finds the rows R(r) of each
array that r depends on: it exchanges ranges of rows in place, exactly reversibly
(:func:`~lightning_dp.record_checks.outside_records.exchange`), reads r again (seeded as the loader's fetcher reads it)
and halves each range that changed it. Then it requires

* that the records at the neighbouring positions and a few others at random do not change when R(r) is exchanged
  (two records sharing rows); a record of :data:`LONG_RECORD` elements or more may touch one element of another's
  rows (the shared rows are searched element by element; two records reading halves of one row share it) — a
  next-token window's last target, which is the next window's first input, is ordinary chunking, in a flat token
  stream or in ``[windows, T]`` inputs and targets over one;
* that the records' data do not outnumber the array's: the mean number of elements a record reads (its rows'
  elements counted one by one when it reads several rows) times the number of records is at most the array's
  elements (plus one per record for records of :data:`LONG_RECORD` elements or more), else records must share data
  (pigeonhole: a record mixed with a random partner).

Arrays with fewer rows m than records n are checked too when few records read each row (n times the rows a record
reads is at most :data:`MAX_COPIES` · m): offline augmentation that doubles the data, ``__len__`` 2N and index i a
view of row ``i % N`` (flipped, cropped, noised), reads one person's row through two indices, each sampled with its
own chance. A probed record that reads rows of such an array must share none with its neighbours (``i // k``), the
records at the positions of its rows, at its position ± m and ± 2m (``i % m``), or the random others. A table is no
one's and is passed: one the probed record reads through its own rows of an array of the population's size (labels
into class prototypes, token ids into an embedding matrix), rows every probed record reads (a padding row), and
arrays with more readers per row (a class table, a vocabulary).

The exchange is faithful to what a record reads:

* copies of an array's rows that the dataset holds elsewhere — a shuffled clone for "offline mixup", a float64 or
  float16 copy, a bank of negatives, pairs or triplets stacked from the rows — are exchanged with the rows they copy
  (:mod:`.copied_rows`), so a record reading another record's row through a copy is seen to read it; and the records
  at the positions of the rows a probed record reads (row j at position j) are checked besides the others;
* what the reads write besides the records — a statistic of the whole tensor computed on the first read and cached
  on the dataset, a ``cached_property``, an ``lru_cache``, a global, a transform fitted on first use — is put back
  before every exchanged read (:mod:`.read_writes`; noted before the dataset's first read, in
  :func:`~lightning_dp.record_checks.records.check_records`), so each read computes it from the data as exchanged.

Errors name positions and arrays, never data. A record reading more than :data:`MAX_ROWS` rows of an array, or one
whose search takes more than :data:`MAX_READS` reads, is not checked against that array. Not seen: data kept in
files, in tables smaller than the population beyond the above (a shared lookup table is no person's; a copy of
training rows is not a table: it moves with them; a row read by two records through an index array of the
population's size, ``x[self.idx[i]]``, is taken for a lookup), or in containers other than those above; rows shared
with a record neither at a neighbouring position, nor at the row's own position, nor among the sampled ones, when
the pigeonhole count does not show it; copies transformed after they were taken (:mod:`.copied_rows`); and a
statistic cached before the dataset reached the strategy (your code read a record before ``fit``).
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional, Sequence

import numpy as np
from torch import Tensor
from torch.utils.data import Subset

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.records.fetch import fetch, seeded
from lightning_dp.records.record_fingerprint import fingerprint
from lightning_dp.record_checks.copied_rows import RowCopies, copied_rows
from lightning_dp.fingerprints.dataset_tokens import dataset_parts
from lightning_dp.fingerprints.state_walker import user_modules
from lightning_dp.record_checks.outside_records import exchange, exchangeable
from lightning_dp.record_checks.read_writes import ReadWrites

PROBED_RECORDS = 3
"""Records whose rows are searched, spread over the population (first, middle, last)."""

OTHER_RECORDS = 6
"""Records at random positions checked, besides the neighbours, for rows shared with a probed record."""

MAX_ROWS = 512
"""The most rows of one array a probed record may read and still be checked against it."""

MAX_READS = 4096
"""The most reads spent searching one record's rows of one array (four times that for a row's elements)."""

MAX_ELEMENTS = 8192
"""The most elements of one row a probed record may read and still have them counted one by one."""

MAX_COPIES = 8
"""An array with fewer rows than records is checked when its rows are read by at most this many records each on
average (n · rows a record reads / its rows): a record's own data read through several indices (a __len__ of 2N
over N rows); rows read by more (a padding row, a class prototype, a lookup table) are a table, no one's."""

LONG_RECORD = 8
"""A record reading this many elements of an array or more may share one of them (module docstring)."""

_SEED = 20260613


def check_shared_records(dataset: Any, at: Callable[[int], int], n: int, writes: Optional[ReadWrites] = None) -> None:
    """Refuse records sharing rows of the arrays ``dataset`` holds (module docstring): the population is the ``n``
    records ``dataset[at(p)]``, positions p in ``range(n)``. ``writes``: the dataset's state noted before its first
    read (:class:`~lightning_dp.record_checks.read_writes.ReadWrites`; noted here when not given).

    Raises:
        PrivacyConfigurationError: naming the records, the array and the fix.
    """
    if n < 2:
        return
    held = dataset_arrays(dataset)
    arrays = [(name, a) for name, a in held if len(a) >= n or n <= len(a) * MAX_COPIES]
    if not arrays:
        return
    steps = max(1, PROBED_RECORDS - 1)
    probes = sorted({round(j * (n - 1) / steps) for j in range(PROBED_RECORDS)})
    rng = random.Random(_SEED)  # public positions: never the data's
    others = {p: _others(p, n, rng) for p in probes}
    read = sorted({*probes, *(o for group in others.values() for o in group)})
    writes = writes if writes is not None else ReadWrites(dataset)
    for position in read:
        _digest(dataset, at(position))  # read once before any exchange: a lazy cache fills now, not while exchanged
    versions = [a._version if isinstance(a, Tensor) else None for _, a in arrays]
    for position in read:
        _digest(dataset, at(position))
    arrays = [(name, a) for (name, a), v in zip(arrays, versions) if v is None or a._version == v]  # written by reads
    writes.settle([a for _, a in held if isinstance(a, list)])  # a statistic cached on first use: reset before each
    positions = {id(d.indices) for d in dataset_parts(dataset)[0] if isinstance(d, Subset)}  # not a record's data
    own = [a for _, a in arrays if len(a) >= n and id(a) not in positions]
    try:
        for name, array in arrays:
            copies = copied_rows(array, [(k, a) for k, a in held if isinstance(a, (Tensor, np.ndarray))], name)
            reader = _Reader(dataset, writes, copies)
            if len(array) >= n:
                _check_array(reader, at, n, probes, others, name, array)
            else:
                _check_table(reader, at, n, probes, others, name, array, own)
    finally:
        writes.restore()


def _check_array(reader: "_Reader", at: Callable[[int], int], n: int, probes: list[int],
                 others: dict[int, list[int]], name: str, array: Any) -> None:
    """The checks of the module docstring for one array."""
    sizes: list[int] = []
    try:
        for position in probes:
            rows = _rows_of(reader, at(position), array)
            if rows is None:
                sizes = []
                break
            sizes.append(_elements_read(reader, at(position), array, rows))
            if rows:
                _refuse_shared(reader, at, position, _with_row_owners(others[position], rows, position, at, n),
                               rows, array, name)
    except _WrittenWhileExchanged:
        return  # the dataset writes this array as it reads: not checked (the write is its own)
    held = len(array) * _width(array)
    mean = sum(sizes) / len(sizes) if sizes else 0.0
    allowance = n if mean >= LONG_RECORD else 0  # one element each may be shared (module docstring)
    if sizes and mean * n > held + allowance:
        raise shared_records_error(
            f"the records read {mean:g} elements of {name} each on average (records at positions {probes}), and "
            f"{n} records of that many are more than its {held} elements: records must share them"
            + reader.note())


def _check_table(reader: "_Reader", at: Callable[[int], int], n: int, probes: list[int],
                 others: dict[int, list[int]], name: str, array: Any, own: list[Any]) -> None:
    """An array of m < n rows (module docstring): a probed record that reads no row of the arrays of the
    population's size (``own``) reading rows of it that few records read (n times its rows is at most
    :data:`MAX_COPIES` · m) must share none with the records at its index ± 1 (index // k), ± m, ± 2m (index % m),
    at its rows' indices, its neighbours and the random others; rows that every probed record reads (a
    padding row, a constant) are no one's."""
    m = len(array)
    try:
        found = {p: _rows_of(reader, at(p), array) for p in probes if not _reads_any(reader, at(p), own)}
        if len(found) > 1 and len({tuple(rows or ()) for rows in found.values()}) == 1:
            return  # the same rows in every record: a constant
        where: dict[int, int] = {}  # index of the dataset under the Subsets (random_split) -> position
        for position, rows in found.items():
            if not rows or n * len(rows) > MAX_COPIES * m:
                continue
            where = where or {_base_index(reader.dataset, at(p)): p for p in range(n)}
            index = _base_index(reader.dataset, at(position))
            near = [index + d for d in (-2 * m, -m, -1, 1, m, 2 * m)] + list(rows[:OTHER_RECORDS])
            candidates = sorted({*others[position], *(where[i] for i in near if i in where)} - {position})
            _refuse_shared(reader, at, position, candidates, rows, array, name,
                           f" — {n} records read its {m} rows: a __len__ larger than the data, each index a view of "
                           "a stored row (index % n, index // k; flipped, cropped, noised or normalised), makes one "
                           "row several records. Augment on the fly inside __getitem__, one index per record "
                           "(DPStrategy(augmentation_multiplicity=K) or lightning_dp.data.AugmentedViews for several "
                           "views)")
    except _WrittenWhileExchanged:
        return


def _base_index(dataset: Any, index: int) -> int:
    """``dataset[index]``'s index in the dataset under its Subsets (where index arithmetic is done)."""
    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, int(dataset.indices[index])
    return index


def _reads_any(reader: "_Reader", index: int, arrays: list[Any]) -> bool:
    """Whether record ``index`` reads any row of ``arrays`` (its own rows of an array of the population's size: a
    smaller one it reads is a table looked up by them: labels into class prototypes, token ids into embeddings)."""
    plain = _Reader(reader.dataset, reader.writes, [])  # the copies found are the table's
    before = plain.digest(index)
    return any(_changes(plain, index, before, a, range(len(a))) for a in arrays)


def _with_row_owners(others: list[int], rows: Sequence[int], position: int, at: Callable[[int], int],
                     n: int) -> list[int]:
    """``others``, and the positions that read a found row as their own index reads it (row j at position j, where
    position j is index j: a record reading another's row through a copy or an index array), up to
    :data:`OTHER_RECORDS` of them."""
    owners = [r for r in rows if r != position and 0 <= r < n and at(r) == r][:OTHER_RECORDS]
    return sorted({*others, *owners} - {position})


class _Reader:
    """The dataset read as the loader reads it, each read finding the state earlier reads wrote as before them
    (:class:`~lightning_dp.record_checks.read_writes.ReadWrites`), and the copies of an array's rows held elsewhere
    (:class:`~lightning_dp.record_checks.copied_rows.RowCopies`) exchanged with them."""

    def __init__(self, dataset: Any, writes: ReadWrites, copies: list[RowCopies]) -> None:
        self.dataset, self.writes, self.copies = dataset, writes, copies

    def digest(self, index: int) -> Any:
        self.writes.reset()
        return _digest(self.dataset, index)

    def exchange_rows(self, array: Any, rows: Sequence[int]) -> list[Callable[[], None]]:
        """Exchange ``rows`` of ``array`` and their copies; the restores."""
        runs = _runs(rows)
        return [exchange(array, part, fixed=True) for part in runs] + [c.exchange(runs) for c in self.copies]

    def exchange_elements(self, flat: Any, row: int, elements: Sequence[int]) -> list[Callable[[], None]]:
        """Exchange ``elements`` of ``row`` (its memory: ``flat``) and of their copies; the restores."""
        runs = _runs(elements)
        return [exchange(flat, p, fixed=True) for p in runs] \
            + [c.exchange([slice(row, row + 1)], runs) for c in self.copies]

    def note(self) -> str:
        """What the refusal adds: the copies of the array's rows, the state the reads write (names only)."""
        note = ""
        if self.copies:
            names = ", ".join(c.name for c in self.copies[:3]) + (" …" if len(self.copies) > 3 else "")
            note += (f"; its rows are also held as copies in {names} ({sum(len(c.rows) for c in self.copies)} "
                     "copied rows, in another order: a record reading a copy reads another record's row)")
        written = self.writes.written if self.writes.active else []
        if written:
            note += (f"; the reads also write {', '.join(written[:3])} (a statistic of every record computed on "
                     "the first read and kept: each read was made with it computed again)")
        return note


def row_sources(dataset: Any, n: int) -> list[tuple[str, Any]]:
    """(name, array) the records may be built from: the arrays of :func:`dataset_arrays` with at least ``n`` rows."""
    return [(name, a) for name, a in dataset_arrays(dataset) if len(a) >= n]


def dataset_arrays(dataset: Any) -> list[tuple[str, Any]]:
    """(name, array): the training datasets' tensors, arrays and lists, and the globals of their classes' modules,
    that :func:`exchangeable` allows, each once."""
    datasets, tensors = dataset_parts(dataset)
    found: list[tuple[str, Any]] = [(f"the dataset's tensor{path}", t) for path, t in tensors]
    for d in datasets:
        for key, value in (vars(d).items() if hasattr(d, "__dict__") else ()):
            if isinstance(value, (np.ndarray, list)):
                found.append((f"{type(d).__name__}.{key}", value))
    for module in user_modules(type(d) for d in datasets):
        for key, value in list(vars(module).items()):
            if not key.startswith("__") and isinstance(value, (Tensor, np.ndarray, list)):
                found.append((f"the global {module.__name__}.{key}", value))
    seen: set[int] = set()
    kept = []
    for name, value in found:
        if id(value) in seen or not exchangeable(value) or getattr(value, "ndim", 1) == 0:
            continue
        seen.add(id(value))
        kept.append((name, value))
    return kept


class _Budget:
    def __init__(self, reads: int) -> None:
        self.left = reads

    def spend(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _digest(dataset: Any, index: int) -> Any:
    """Record ``index`` as the loader reads it (generators seeded), or the type of the error reading it raised."""
    try:
        with seeded(_SEED):
            found = fingerprint(fetch(dataset, [index]))
    except Exception as err:  # noqa: BLE001  (the user's __getitem__ on exchanged data)
        return ("error", type(err).__name__)
    return None if found is None else found.digest


def _changes(reader: _Reader, index: int, before: Any, array: Any, rows: Sequence[int]) -> bool:
    """Whether record ``index`` reads differently with ``rows`` of ``array`` (and their copies) exchanged (restored
    after)."""
    return _changes_with(reader, index, before, lambda: reader.exchange_rows(array, rows), array)


def _changes_with(reader: _Reader, index: int, before: Any, exchanged: Callable[[], list[Callable[[], None]]],
                  array: Any = None) -> bool:
    """Whether record ``index`` reads differently while ``exchanged()`` holds (its restores run after). A tensor
    ``array`` the read writes (its version counter moves) stops the check of that array (the datasets that write as
    they read are left out beforehand: :func:`check_shared_records`)."""
    undo: list[Callable[[], None]] = []
    version = array._version if isinstance(array, Tensor) else None
    try:
        undo = exchanged()
        changed = reader.digest(index) != before
    finally:
        for restore in reversed(undo):
            restore()
    if version is not None and array._version != version:
        raise _WrittenWhileExchanged
    return changed


class _WrittenWhileExchanged(Exception):
    """The dataset wrote an array while it was exchanged (internal: that array is not checked further)."""


def _runs(rows: Sequence[int]) -> list[slice]:
    """``rows`` (sorted) as slices of consecutive rows."""
    if isinstance(rows, range):
        return [slice(rows.start, rows.stop)] if len(rows) else []
    runs: list[slice] = []
    start = prev = None
    for r in rows:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            runs.append(slice(start, prev + 1))
        start = prev = r
    if start is not None:
        runs.append(slice(start, prev + 1))
    return runs


def _search(changes: Callable[[Sequence[int]], bool], candidates: Sequence[int],
            limit: int = MAX_ROWS) -> Optional[list[int]]:
    """The candidates whose exchange ``changes`` the record (halving the ranges that do), or ``None`` when they are
    more than ``limit`` or the search needs more than :data:`MAX_READS` reads (four times that for elements)."""
    budget, found = _Budget(MAX_READS if limit == MAX_ROWS else 4 * MAX_READS), []
    stack = [candidates]
    while stack:
        part = stack.pop()
        if not budget.spend():
            return None
        if not changes(part):
            continue
        if len(part) == 1:
            found.append(part[0])
            if len(found) > limit:
                return None
            continue
        mid = len(part) // 2
        stack.extend([part[mid:], part[:mid]])
    return sorted(found)


def _rows_of(reader: _Reader, index: int, array: Any) -> Optional[list[int]]:
    """R(index): the rows of ``array`` record ``index`` depends on (``None``: not found within the limits)."""
    before = reader.digest(index)
    if before is None:
        return None  # an opaque record: not comparable
    return _search(lambda rows: _changes(reader, index, before, array, rows), range(len(array)))


def _flat_row(array: Any, row: int) -> Any:
    """Row ``row`` of ``array`` as a flat view of its memory (``None``: not one: a list's row is one element)."""
    if isinstance(array, Tensor):
        try:
            return array.data[row].view(-1)
        except RuntimeError:  # not contiguous: no flat view
            return None
    if isinstance(array, np.ndarray):
        flat = array[row].reshape(-1)
        return flat if flat.size and np.shares_memory(flat, array) else None
    return None


def _elements_of(reader: _Reader, index: int, array: Any, row: int) -> Optional[set[int]]:
    """The elements of ``row`` record ``index`` depends on, in it and its copies (``None``: the row has no flat view,
    or too many)."""
    flat = _flat_row(array, row)
    before = reader.digest(index)
    if flat is None or before is None:
        return None
    found = _search(lambda part: _changes_with(reader, index, before,
                                               lambda: reader.exchange_elements(flat, row, part), array),
                    range(len(flat)), MAX_ELEMENTS)
    return None if found is None else set(found)


def _elements_read(reader: _Reader, index: int, array: Any, rows: Sequence[int]) -> int:
    """How many elements of ``array`` record ``index`` reads, in its ``rows``: a row's width for a record of one row
    (at most), else counted element by element (the rows' full width when that exceeds the limits)."""
    width = _width(array)
    if len(rows) <= 1 or width == 1:
        return len(rows) * width
    total = 0
    for row in rows:
        elements = _elements_of(reader, index, array, row)
        total += width if elements is None else len(elements)
    return total


def _edge_elements(reader: _Reader, first: int, second: int, array: Any, rows: Sequence[int]) -> Optional[int]:
    """In the ``rows`` both records read, the elements read by the record that reads fewer of them: 1 when one
    record only touches the other's edge (a next-token window's last target, the next window's first input), more
    when they share more (halves of one row, a row mixed into both). ``None``: not counted within the limits."""
    if not isinstance(array, (Tensor, np.ndarray)) or getattr(array, "ndim", 1) == 1:
        return len(rows)
    counts = [0, 0]
    for row in rows:
        a, b = _elements_of(reader, first, array, row), _elements_of(reader, second, array, row)
        if a is None or b is None:
            return None
        counts[0], counts[1] = counts[0] + len(a), counts[1] + len(b)
    return min(counts)


def _others(position: int, n: int, rng: random.Random) -> list[int]:
    """The positions checked against ``position``'s rows: its neighbours and :data:`OTHER_RECORDS` at random."""
    others = {p for p in (position - 1, position + 1) if 0 <= p < n}
    others |= set(rng.sample(range(n), min(n, OTHER_RECORDS)))
    others.discard(position)
    return sorted(others)


def _refuse_shared(reader: _Reader, at: Callable[[int], int], position: int, others: list[int], rows: list[int],
                   array: Any, name: str, why: str = "") -> None:
    """Refuse when a record at one of the ``others`` positions reads data of ``rows`` that record ``position``
    reads too (beyond the one element a long record may share)."""
    index = at(position)
    width = _width(array)
    for other in others:
        j = at(other)
        if j == index:
            continue
        before = reader.digest(j)
        if before is None or not _changes(reader, j, before, array, rows):
            continue
        shared_rows = _search(lambda part: _changes(reader, j, before, array, part), rows)
        shared = None if shared_rows is None else _edge_elements(reader, index, j, array, shared_rows)
        if shared is not None and shared <= 1 and len(rows) * width >= LONG_RECORD:
            continue  # one element at the edge of long records: a next-token window's last target
        count = "data" if shared_rows is None else f"{len(shared_rows)} of the same rows"
        raise shared_records_error(
            f"the records at positions {position} and {other} both read {count} of {name} (record {position} reads "
            f"{len(rows)} of its rows){why}{reader.note()}")


def _width(array: Any) -> int:
    """Elements per row."""
    if isinstance(array, (Tensor, np.ndarray)) and getattr(array, "ndim", 1) > 1:
        return int(np.prod(array.shape[1:]))
    return 1


def shared_records_error(what: str) -> PrivacyConfigurationError:
    """The refusal of records made of data other records read too (positions and names: no data values)."""
    return PrivacyConfigurationError(
        f"Training records share data: {what}. DP's privacy unit is one record of the dataset the loader reads; a row "
        "in several records (overlapping windows of a series or a text, a record mixed with its neighbour or with a "
        "partner from a shuffled copy of the data, pairs or triplets built from the training rows, features "
        "normalised in __getitem__ by statistics of the whole tensor, also when computed once and cached) has the "
        "influence of several records, which neither the clipping nor the ledger counts. Make each record its own "
        "rows: windows with a stride of at least their length (a next-token window may end on the next one's first "
        "token), no mixing across records in __getitem__ (mix inside the step from the same record only: "
        "augmentation within a record; lightning_dp.data.AugmentedViews), normalisation by public constants. If one "
        "person's data really spans several records, train with user-level DP, which bounds a person appearing in "
        "several records: DPStrategy(privacy_unit=Users(user_ids, ...)) (docs/user_level.md).")
