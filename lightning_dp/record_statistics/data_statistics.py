"""Statistics of the training data computed before training: exact, un-noised, and kept or trained on.

A normalisation layer holding the training features' mean and standard deviation (``register_buffer("mean",
x_train.mean(0))``), class weights from the training labels' frequencies (``CrossEntropyLoss(weight=1 / counts)``),
or features standardised with their own statistics (scikit-learn's ``StandardScaler().fit(x_train)``) are functions
of every training record that no noise covers: a buffer is released with the model (and saved in its checkpoints),
and data scaled by its own statistics makes every example's gradient depend on all the others. Whatever σ the
ledger counts, the trained model is then not differentially private.

:func:`data_statistics_held` looks, once before the first release, for

* tensors (and NumPy arrays, lists and tuples of numbers) held by the model's modules (buffers and attributes), the
  LightningDataModule and the training datasets' own attributes — the tensors beside the records too, those whose
  first dimension is no dataset's length (``self.mean = x.mean(0)`` applied in ``__getitem__``), compared with the
  statistics of the others, and what :mod:`.loader_statistics` walks to: a helper, a closure, the class — that
  equal, to float precision, a statistic of the training tensors (and of the datasets' NumPy record arrays, and of
  the arrays outside the dataset its items read, :mod:`.read_records`: a global ``X[i]``):
  per-feature and per-channel mean, standard deviation and variance, the features' global mean and
  standard deviation, the labels' class counts, frequencies, log frequencies (an output bias set to the log prior) and
  inverse frequencies (normalised to sum 1 or to mean 1), and for two classes the ratio of their counts (a
  ``pos_weight``) and each one's fraction (a focal loss's alpha) as single numbers unless round; a float target's
  (a regression's y) mean, standard deviation, and unless its values are all integers its median, minimum and
  maximum (to 4 float32 ulps), and the continuous features' global minimum and maximum; the parameters too
  (initialised from the data);
* per-feature order statistics at any level (a min-max scaler's buffers, a median and interquartile range, quantile
  bin edges; a range as a difference of two), and vectors of exact per-feature training values
  (:mod:`.order_statistics`); class-conditional means, standard deviations and variances (a prototype head,
  :mod:`.conditional_statistics`); a [D, D] whitening matrix of any kind, a covariance, correlation or uncentred second
  moment, its inverse or Cholesky factor (:mod:`.second_moments`). These are computed once per feature tensor,
  when a candidate of its width is held: on 100,000 × 64 float32 features about 1 s of one CPU core (the sort, the
  moments, the class statistics), the whole check about 5 s;
* rows of a parameter, buffer or attribute along a principal direction of the training features (a first layer
  initialised by PCA: an SVD of the training set, scikit-learn's ``PCA``; a randomised approximation,
  ``torch.pca_lowrank`` with fewer components than features, is not exact and not seen);
* per-record columns of the training tensors and the datasets' NumPy arrays derived from the labels' statistics: a
  sample-weight column equal to a class-weight formula at each record's label, a target-encoded feature
  (:mod:`.derived_columns`);
* feature tensors every column of which has mean 0 and standard deviation 1 (either convention), median 0 and
  interquartile range 1, or minimum 0 and maximum 1 with more than two values (most columns), to float precision:
  scaled by their own statistics; or holding statistics written into the records: missing cells filled with their
  column's mean or median (:mod:`.imputed_cells`), their class's or group's (:mod:`.grouped_fills`: the dataset's
  other tensors, the labels, are the groupings with the low-cardinality columns), or from the neighbouring records
  (:mod:`.neighbour_copies`: a forward fill, an interpolation), a projection on the training set's principal directions
  (:mod:`.decorrelated_columns`), values replaced by a function of their ranks (:mod:`.rank_columns`), columns
  clipped at their own percentiles (:mod:`.clipped_columns`); a regression target standardised, centred or min-max
  scaled by its own statistics (:mod:`.scaled_targets`).

* vectors held beside the records, in the model or the loader, that are *close* to a per-feature (or per-channel)
  statistic far beyond chance: rounded (``x.mean(0).round(decimals=3)``), of a random part of the training rows, or
  of them with others (:mod:`.near_statistics`); tables of numbers — dicts keyed by column or name, lists of
  per-column tuples or dicts — are read as the vectors they hold (:mod:`.number_tables`).

Values released by a DP mechanism that charged a ledger (:class:`~lightning_dp.data.PrivateStandardizer`'s mean and
standard deviation) are not refused (:mod:`.released_statistics`); features scaled by them pass by their noise.

The statistics are kept for the fit (:class:`TrainingStatistics`): :mod:`.written_statistics` compares with them
what the hooks write during it, where the replays cannot see a path (a file saved before the fit read back).

Constant tensors are never taken for a statistic (a zero bias is not the mean of standardised data), nor is a scalar
within the tolerance of 0 or 1, statistic or candidate (a convolution's ``padding`` ``(0,)`` against the mean of
data normalised per record). Names declared
public are skipped (:func:`~lightning_dp.fingerprints.public_names.is_public`). What it cannot see: a statistic
transformed after it was computed other than by rounding (scaled — a robust standard deviation IQR / 1.349 —,
combined with public constants), a single number rounded or of a subset, vectors of a subset too few in columns or
records for :mod:`.near_statistics`' chance bound, quantiles of integer-valued columns alone other than their extremes,
a whitening matrix whose eps over the smallest eigenvalue exceeds its tolerance, and data scaled by its own
statistics in another way (to another range; a rank transform :mod:`.rank_columns` does not see).
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Collection, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_statistics.clipped_columns import CLIPPED, clip_fix, clipped
from lightning_dp.record_statistics.decorrelated_columns import decorrelated, decorrelated_fix
from lightning_dp.record_statistics.derived_columns import derived_columns, derived_columns_fix
from lightning_dp.record_statistics.grouped_fills import grouped_imputed_columns
from lightning_dp.record_statistics.imputed_cells import MAX_CELLS as FITTED_CELLS, MAX_COLUMNS as IMPUTED_COLUMNS, \
    imputation_fix, imputed_columns
from lightning_dp.record_statistics.rank_columns import MAX_COLUMNS as RANK_COLUMNS, rank_fix, rank_transformed
from lightning_dp.fingerprints.dataset_tokens import dataset_parts
from lightning_dp.records.library_objects import framework_keys
from lightning_dp.record_statistics.conditional_statistics import class_conditional, conditional_rows
from lightning_dp.fingerprints.public_names import is_public
from lightning_dp.record_statistics.loader_statistics import transform_holders
from lightning_dp.record_statistics.near_statistics import NearStatistics
from lightning_dp.record_statistics.neighbour_copies import neighbour_copies, neighbour_fix
from lightning_dp.record_statistics.number_tables import number_columns
from lightning_dp.record_statistics.order_statistics import OrderStatistics
from lightning_dp.records.held_records import holds_records, row_digests
from lightning_dp.record_statistics.read_records import as_tensor, dataset_length, records_read
from lightning_dp.record_statistics.record_lengths import lengths_held
from lightning_dp.record_statistics.released_statistics import is_released, released_end, released_vectors
from lightning_dp.record_statistics.scaled_targets import scaled_target
from lightning_dp.record_statistics.second_moments import SecondMoments

MAX_ELEMENTS = 1 << 27
"""Training tensors with more elements are not summarised (the check runs once, in the main process)."""

_RTOL, _ATOL = 1e-4, 1e-6
_EXACT = ("median", "minimum", "maximum")  # values of the data: matched to 4 float32 ulps, not to a sampling error
_ONE_NUMBER = (*_EXACT, "ratio of the class counts", "fraction of class")  # single numbers: never a round one
_IMPUTED = "filled where values were missing with a statistic of its own column's other values"
_COPIED = "filled where values were missing from the neighbouring records' cells"
_PROJECTED = "projected on its own principal directions (columns centred and uncorrelated: PCA or whitening)"
_RANKED = "transformed by the ranks of its values among the training records"
_NEAR = "approximately the"
_DERIVED = ("a sample weight computed from the training labels' counts", "a target encoding of a category")


def data_statistics_held(holders: Iterable[tuple[str, Any]], dataset: Any, public: Sequence[str] = (),
                         loader: Any = None, charged: Optional[Collection[str]] = None,
                         kept: Optional[list["TrainingStatistics"]] = None) -> list[str]:
    """What ``holders`` ((path, object): modules, a datamodule), the training ``loader``'s collator and the datasets'
    transforms (:mod:`.loader_statistics`) keep that is a statistic of ``dataset``'s tensors or of its records'
    lengths (:mod:`.record_lengths`), which of its feature tensors are standardised with their own statistics, and
    which of the modules' parameters and buffers hold training records (:func:`records_in_weights`), as findings.
    ``charged``: the runs of the fit's ledger, whose DP releases pass (:mod:`.released_statistics`; ``None``: any).
    ``kept``: receives the :class:`TrainingStatistics` compared with, for the fit (:mod:`.written_statistics`)."""
    holders = list(holders)
    datasets, tensors = dataset_parts(dataset)
    in_weights = records_in_weights([m for _, m in holders if isinstance(m, nn.Module)], tensors, public)
    derived = derived_columns(datasets, tensors, public)  # per-record weights and target encodings
    holders += transform_holders(loader, datasets)
    lengths = lengths_held(_candidates([*holders, *((f"dataset {type(d).__name__}", d) for d in datasets)]),
                           tensors, public)
    read = records_read(dataset, tensors, MAX_ELEMENTS)  # records the items read from outside it (a global X[i])
    held = _statistics_held(holders, datasets, [*tensors, *read], public, charged, kept)
    return list(dict.fromkeys(in_weights + held + derived + lengths))


def records_in_weights(modules: Sequence[nn.Module], tensors: Sequence[tuple[str, Tensor]],
                       public: Sequence[str] = ()) -> list[str]:
    """The parameters and buffers of ``modules`` that hold training records before training: rows of a training
    tensor (prototypes, RBF centres or a memory initialised from examples; a buffer of sample inputs) or its labels
    (:func:`~lightning_dp.records.held_records.holds_records`). They are released with the model as they are
    — DP-SGD's noise covers the updates, not an initial value copied from the data."""
    digests = [(path, t, row_digests(t)) for path, t in tensors if t.numel()]
    found = []
    for module in modules:
        named = [*(("parameter", n, p) for n, p in module.named_parameters()),
                 *(("buffer", n, b) for n, b in module.named_buffers())]
        for kind, name, value in named:
            if is_public(name, public):
                continue
            for path, t, rows in digests:
                if holds_records(value.detach(), t, rows):
                    found.append(f"{kind} {name} holds records of the training {training_name(path, t)}")
                    break
    return found


def _statistics_held(holders: Sequence[tuple[str, Any]], datasets: Sequence[Any],
                     tensors: Sequence[tuple[str, Tensor]], public: Sequence[str],
                     charged: Optional[Collection[str]] = None,
                     kept: Optional[list["TrainingStatistics"]] = None) -> list[str]:
    statistics = TrainingStatistics(datasets, tensors, public, charged)
    if kept is not None:
        kept.append(statistics)
    found = statistics.scaled()
    if not statistics.stats:
        return found
    owners = [*holders, *((f"dataset {type(d).__name__}", d) for d in datasets)]
    for path, value in _candidates(owners):
        found.extend(statistics.held_by(path, value) or statistics.slices_held(path, value))
    return found


class TrainingStatistics:
    """The statistics of the training tensors a held value is compared with (module docstring), computed once: the
    summaries of each tensor as it is built, the order statistics, second moments, class-conditional statistics
    (:class:`_ByWidth`) and principal directions per feature width when a candidate of that width is first compared;
    kept for the fit, :mod:`.written_statistics` compares with them what the user's hooks write during it."""

    def __init__(self, datasets: Sequence[Any], tensors: Sequence[tuple[str, Tensor]], public: Sequence[str] = (),
                 charged: Optional[Collection[str]] = None) -> None:
        self.tensors, self.public, self.charged = list(tensors), tuple(public), charged
        records, arrays = _records(datasets, tensors)
        self.records = records | {id(t) for _, t in arrays}
        """The ids of the tensors and arrays that hold records (never a candidate; a value beside them is one)."""
        self.names = {path: training_name(path, t) for path, t in [*tensors, *arrays]}
        self.stats = [(f"{name} of the training {self.names[path]}", value, id(t))
                      for path, t in [*tensors, *arrays] if 0 < t.numel() <= MAX_ELEMENTS
                      for name, value in _statistics(t)]
        self.sizes = {stat.numel() for _, stat, _ in self.stats}
        self.shaped = _ByWidth([*tensors, *arrays])
        self.near = NearStatistics([*tensors, *arrays], self.shaped.order)  # rounded, subsampled: within their error
        self.record_paths = {p for p, t in [*tensors, *arrays] if id(t) in self.records}
        self.directions: dict[int, list[tuple[str, Tensor]]] = {}  # by feature count, when a candidate has that width
        self._slices: dict[int, list[tuple[str, Tensor, int, Tensor, Tensor]]] = {}  # by width (slices_held)
        self._slice_sums: dict[int, Tensor] = {}
        self._slice_reach: dict[int, Tensor] = {}

    def slices_held(self, path: str, value: Any, rows: Optional[Tensor] = None,
                    columns: Optional[Tensor] = None) -> list[str]:
        """Rows and columns of a 2-D held ``value`` (``path``) equal to an exact statistic of a training tensor of
        their length (a mean, a deviation, a class's frequencies: :meth:`held_by`'s first comparisons, row by row):
        a statistic written into one row of an embedding or a memory bank (``self.emb.weight.data[0] = mean``) or one
        column of a buffer hides in a tensor of another size. ``rows``/``columns``: the indices compared (those
        written since the last check), every one when ``None``. One pass over them: only a row whose sum is within
        the tolerance's reach of a statistic's sum is compared in full. Public names, the records themselves and DP
        releases a charged ledger counts are never one; a slice of under two numbers, or a constant one, is not
        compared (a single number matches too easily; zeros match the mean of centred data)."""
        name = path.partition(" ")[2] if path.startswith(("buffer ", "attribute ", "parameter ")) else path
        if not self.stats or id(value) in self.records or is_public(name, self.public):
            return []
        t = _as_tensor(value)
        if t is None or t.dim() != 2 or t.numel() == 0 or is_released(t, self.charged):
            return []
        found: list[str] = []
        for what, matrix, index in (("row", t, rows), ("column", t.t(), columns)):
            width = matrix.shape[1]
            if width < 2 or width not in self.sizes or (index is not None and not len(index)):
                continue
            table = self._slice_table(width)
            kept = [(row, flat, tol) for row, (stat_name, stat, source, flat, tol) in enumerate(table)
                    if source != id(value)]
            if not kept:
                continue
            picked = matrix if index is None else matrix[index.to(matrix.device)]
            sums = picked.sum(1, dtype=torch.float64).cpu()
            near = ((sums[:, None] - self._slice_sums[width][None, [row for row, _, _ in kept]]).abs()
                    <= self._slice_reach[width][None, [row for row, _, _ in kept]])
            for at, j in near.nonzero().tolist():
                row, flat, tol = kept[j]
                candidate = picked[at].to("cpu", torch.float64)
                if bool(candidate.amax() != candidate.amin()) and bool(((candidate - flat).abs() <= tol).all()):
                    where = at if index is None else int(index[at])
                    found.append(f"{what} {where} of {path} equals the {table[row][0]}")
                    break
        return found

    def _slice_table(self, width: int) -> list[tuple[str, Tensor, int, Tensor, Tensor]]:
        """The exact statistics of ``width`` numbers that are not constant, each with its values in float64 and the
        elementwise tolerance; their sums and how far a slice's sum may be from them (:meth:`slices_held`), once."""
        if width not in self._slices:
            table = []
            for stat_name, stat, source in self.stats:
                if stat.numel() == width and not _constant(stat):
                    flat = stat.reshape(-1).to("cpu", torch.float64)
                    rtol = 4 * 2.0 ** -23 if stat_name.startswith(_EXACT) else _RTOL
                    table.append((stat_name, stat, source, flat, _ATOL + rtol * flat.abs()))
            self._slices[width] = table
            self._slice_sums[width] = torch.tensor([float(f.sum()) for *_, f, _ in table], dtype=torch.float64)
            self._slice_reach[width] = torch.tensor([1.01 * float(tol.sum()) + 1e-9 * float(f.abs().sum())
                                                     for *_, f, tol in table], dtype=torch.float64)
        return self._slices[width]

    def scaled(self) -> list[str]:
        """The training feature tensors scaled by their own statistics or holding statistics written into them."""
        tensors, shaped, names = self.tensors, self.shaped, self.names
        return [f"the training {names[path]} is {how}"
                for path, t in tensors
                for how in [_scaled_by_itself(t, shaped.order) or scaled_target(t)
                            or _fitted(t, shaped.order, [(names[p], u) for p, u in tensors if u is not t])
                            or clipped(t, lambda: shaped.order(t).sorted,
                                       lambda end: released_end(end, self.charged))]
                if how]

    def held_by(self, path: str, value: Any, full: bool = True, approximate: bool = True) -> list[str]:
        """What the held ``value`` (named ``path``: ``buffer mean``, ``attribute stats``, ``datamodule.mean``) is of
        the training tensors' statistics, as findings (none: nothing). Public names, the records themselves, constant
        tensors and DP releases a charged ledger counts are never one. Not ``full``: only the statistics of each
        tensor computed with it (means, deviations, variances, class frequencies, a target's order statistics: one
        comparison each, microseconds), not the per-width ones (order statistics, second moments, class-conditional
        statistics, principal directions: up to seconds for a [1000, 1000] candidate). Not ``approximate``: no
        closeness within a rounding or subsample error (:mod:`.near_statistics`) — a value written during the fit may
        come that close by training (a decoder's output bias learns the features' mean privately), never equal; nor
        is a parameter (a second fit of a privately trained model holds such a bias)."""
        if not self.stats:
            return []
        name = path.partition(" ")[2] if path.startswith(("buffer ", "attribute ", "parameter ")) else path
        if id(value) in self.records or is_public(name, self.public):
            return []
        candidate = _as_tensor(value)
        if candidate is None or (not full and candidate.numel() not in self.sizes):
            return []  # (no statistic of its size: nothing else to compare in part)
        if candidate.numel() == 0 or (candidate.numel() > 1 and _constant(candidate)) \
                or is_released(candidate, self.charged):  # a DP release its ledger counts (:mod:`.released_statistics`)
            return []
        beside = name.startswith(("dataset ", "loader."))  # held for the items: against the records' statistics
        for stat_name, stat, source in self.stats:
            if source == id(value) or (beside and source not in self.records):
                continue
            if stat_name.startswith(_ONE_NUMBER) and candidate.numel() == 1 and _round(float(candidate)):
                continue  # a public range's end (-1, 0.5, 255: pixels scaled to [-1, 1]) is no record's value
            try:
                same = _equal(candidate, stat, 4 * 2.0 ** -23 if stat_name.startswith(_EXACT) else _RTOL)
            except (RuntimeError, TypeError):  # a tensor subclass that does not compare with a plain one (DTensor)
                return []
            if same:
                return [f"{path} equals the {stat_name}"]
        if not full:
            return []
        try:
            held = self.shaped.held(candidate)
            found = [f"{path} holds {what} of the training {self.names.get(p, p.lstrip('.') or 'tensor')}"
                     for p, what in held]
            found += [f"{path} is {_NEAR} {stat} of the training {self.names.get(p, p)}, within a rounding or "
                      f"subsample error (a vector not computed from it comes as close with chance {chance:.0e})"
                      for p, stat, chance in ([] if held or not approximate or path.startswith("parameter ") else
                                              self.near.held(candidate, self.record_paths if beside else None,
                                                             released_vectors(self.charged)))]
        except (RuntimeError, TypeError):  # a tensor subclass that does not compare with a plain one
            return []
        for width in {*candidate.shape[-2:]} if candidate.dim() == 2 else ():
            if width not in self.directions:
                self.directions[width] = [(f"principal directions of the training {self.names[p]}", d)
                                          for p, t in self.tensors if t.dim() >= 2 and t[0].numel() == width
                                          for d in [_principal_directions(t)] if d is not None]
            found.extend(f"rows of {path} are the {name}" for name, d in self.directions[width]
                         if _rows_along(candidate, d))
        return found


def _records(datasets: Sequence[Any], tensors: Sequence[tuple[str, Tensor]]) -> tuple[set[int], list[tuple[str, Any]]]:
    """The ids of the datasets' tensors that hold records — one row each: their first dimension is a dataset's length
    (or, where none is, the longest) — and of their NumPy record arrays, and those arrays as tensors.
    The others (a tensor, a NumPy array or a number kept beside the records: ``self.mean = x.mean(0)``) are held
    values, candidates like a module's buffers; a statistic is not compared with the tensor it is of."""
    arrays = [(path, t, a) for d in datasets for path, t, a in _arrays(d)]
    lengths = {n for d in datasets if (n := dataset_length(d))}
    leading = [t.shape[0] for _, t in tensors if t.dim() >= 1] + [t.shape[0] for _, t, _ in arrays]
    if leading and not lengths & set(leading):
        lengths = {max(leading)}
    held = [(path, t, array) for path, t, array in arrays if t.shape[0] in lengths]
    return {*(id(t) for _, t in tensors if t.dim() >= 1 and t.shape[0] in lengths), *(id(a) for _, _, a in held)}, \
        [(path, t) for path, t, _ in held]


def _arrays(dataset: Any) -> Iterator[tuple[str, Tensor, Any]]:
    """The numeric in-memory NumPy arrays (one or two dimensions) ``dataset`` holds as attributes, as tensors."""
    numpy = sys.modules.get("numpy")
    for key, value in (vars(dataset).items() if numpy is not None and hasattr(dataset, "__dict__") else ()):
        if isinstance(value, numpy.ndarray) and not isinstance(value, numpy.memmap) and value.dtype.kind in "fiu" \
                and value.ndim in (1, 2) and 0 < value.size <= MAX_ELEMENTS:
            yield f".{key}", as_tensor(value), value


class _ByWidth:
    """The order statistics, second moments and class-conditional statistics of the training feature tensors
    (:mod:`.order_statistics`, :mod:`.second_moments`, :mod:`.conditional_statistics`), computed for a width when a
    candidate of that width is first held."""

    def __init__(self, tensors: Sequence[tuple[str, Tensor]]) -> None:
        self.features = [(p, t) for p, t in tensors if t.dtype.is_floating_point and t.dim() >= 2 and t.shape[0] > 1
                         and t.numel() <= MAX_ELEMENTS]
        self.labels = [t for _, t in tensors if not t.dtype.is_floating_point and t.dim() == 1 and t.numel() > 1]
        self.summaries: dict[int, list[tuple[str, Any, Any, list[tuple[str, Tensor]]]]] = {}
        self.orders: dict[int, OrderStatistics] = {}

    def order(self, t: Tensor) -> OrderStatistics:
        """The feature tensor ``t``'s order statistics, sorted once."""
        if id(t) not in self.orders:
            self.orders[id(t)] = OrderStatistics(t)
        return self.orders[id(t)]

    def held(self, candidate: Tensor) -> list[tuple[str, str]]:
        """(tensor path, what) for each feature tensor ``candidate`` holds a statistic of."""
        found: list[tuple[str, str]] = []
        if candidate.numel() > 1 << 22:  # an embedding table: not a summary
            return found
        for width in {candidate.numel(), *(candidate.shape if candidate.dim() == 2 else ())} - {0, 1}:
            if width not in self.summaries:
                self.summaries[width] = [
                    (p, self.order(t), SecondMoments(t) if width <= 1024 and len(t) * width ** 2 <= 4e9 else None,
                     [s for y in self.labels for s in class_conditional(t, y)])
                    for p, t in self.features if t[0].numel() == width]
            for path, order, moments, conditional in self.summaries[width]:
                t = next(t for p, t in self.features if p == path)
                if holds_records(candidate.reshape(-1, width) if candidate.numel() == width else candidate, t,
                                 row_digests(t)):  # a copy of records (rule 9's and records_in_weights' concern)
                    continue
                what = order.held(candidate) or (moments.held(candidate) if moments is not None else "")
                what = what or (f"a row of the {name}" if (name := conditional_rows(candidate, conditional)) else "")
                if what:
                    found.append((path, what))
        return found


def _principal_directions(t: Tensor, k: int = 8) -> Any:
    """The top ``k`` principal directions of a training feature tensor ([D, k], unit columns; of the centred and of
    the uncentred rows: ``torch.pca_lowrank``'s and a plain SVD's), for 3 ≤ D ≤ 1024 features; ``None`` otherwise."""
    if not t.dtype.is_floating_point or t.dim() < 2 or t.shape[0] < 2:
        return None
    x = t.detach().reshape(t.shape[0], -1).to(torch.float64)
    x = x[torch.isfinite(x).all(1)]  # rows with a missing value (NaN, ±inf): a PCA is fitted on the others
    d = x.shape[1]
    if x.shape[0] < 2 or not 3 <= d <= 1024 or x.shape[0] * d * d > 4e9:
        return None
    with torch.no_grad():
        out = []
        for rows in (x - x.mean(0), x):
            try:
                values, vectors = torch.linalg.eigh(rows.T @ rows)
            except RuntimeError:  # torch.linalg.LinAlgError: no directions to compare
                return None
            out.append(vectors[:, values.argsort(descending=True)[:k]])
        return torch.cat(out, 1)


def _rows_along(candidate: Tensor, directions: Tensor) -> bool:
    """Whether a row of ``candidate`` ([r, D] or [D, r]: a layer's weight either way) lies along a principal direction,
    to a cosine of 1 − 1e-6 (a random or trained row does not); rows along an axis or of one magnitude throughout are
    not compared (an identity or constant initialisation)."""
    c = candidate.detach().to("cpu", torch.float64)
    if c.dim() != 2 or c.numel() > 1 << 22:
        return False
    for rows in (c, c.T):
        if rows.shape[1] != directions.shape[0]:
            continue
        size = rows.abs()
        top = size.max(1, keepdim=True).values
        # a row along an axis (an identity initialisation: one-hot data's directions are the axes) or with every entry
        # of one size (all ones) says nothing of the data: only rows of two or more different sizes are compared
        telling = ((size > 1e-9 * top).sum(1) >= 2) & ((size - top).abs().amax(1) > 1e-9 * top.squeeze(1))
        if not bool(telling.any()):
            continue
        rows = rows[telling]
        cos = (rows / rows.norm(dim=1, keepdim=True)) @ directions
        if bool((cos.abs() >= 1 - 1e-6).any()):
            return True
    return False


def training_name(path: str, t: Tensor) -> str:
    """How a finding names a training tensor: ``labels (tensors[1])`` for class labels (integers, one a record, not
    the first of the dataset's tensors), else its path in the dataset (``tensors[0]``)."""
    where = path.lstrip(".") or "tensor"
    labels = not (t.is_floating_point() or t.is_complex()) and t.dim() >= 1 and t[0].numel() == 1 \
        and not where.endswith("tensors[0]")
    return f"labels ({where})" if labels else where


def data_statistics_error(found: Sequence[str]) -> PrivacyConfigurationError:
    """The refusal of :func:`data_statistics_held`'s findings."""
    lines = "\n".join(f"- {f}" for f in found[:6])
    records = ("Training records kept in the model's weights or buffers are released with it as they are (initialise "
               "prototypes, centres or memories from public data or at random). ") \
        if any(" holds records " in f for f in found) else ""
    derived = derived_columns_fix() + " " if any(f.endswith(_DERIVED) for f in found) else ""
    derived += "".join(fix() + " " for kind, fix in ((_IMPUTED, imputation_fix), (_COPIED, neighbour_fix),
                                                     (_PROJECTED, decorrelated_fix), (_RANKED, rank_fix),
                                                     (CLIPPED, clip_fix))
                       if any(kind in f for f in found))
    derived += "Set lengths to a public value (a round cap, the model's context size). " \
        if any("records' length" in f or "record's length" in f for f in found) else ""
    return PrivacyConfigurationError(
        "Statistics of the training data were computed without noise before training:\n" + lines + "\n" + records
        + derived + "They depend on "
        "every training record and no noise covers them: a buffer is released with the model and its checkpoints, "
        "and data scaled by its own statistics makes each example's gradient depend on all the others, so the model "
        "would not be differentially private whatever σ the ledger counts. Nothing was released. Fix: normalise "
        "with public constants (a known range: pixels / 255, digits / 16) or statistics of public data, standardise "
        "features with lightning_dp.data.PrivateStandardizer (a DP mean and standard deviation, charged to this "
        "fit's DPStrategy), weight classes by a public prior, initialise layers at random or from public data, or "
        "estimate them with a DP mechanism of your own and account for its ε (a value not derived from this "
        "training data: declare it, DPStrategy(public_state=[name])).")


def _statistics(t: Tensor) -> Iterator[tuple[str, Tensor]]:
    """The summaries of one training tensor that code commonly keeps (module docstring)."""
    with torch.no_grad():
        if t.dtype.is_floating_point and t.dim() >= 2 and t.shape[0] > 1:
            x = t.detach().to(torch.float64)
            flat = x.reshape(x.shape[0], -1)
            yield "per-feature mean", flat.mean(0)
            for correction in (0, 1):
                yield "per-feature standard deviation", flat.std(0, correction=correction)
                yield "per-feature variance", flat.var(0, correction=correction)
            if x.dim() >= 3:  # [N, C, ...]: per channel
                dims = [0, *range(2, x.dim())]
                yield "per-channel mean", x.mean(dims)
                for correction in (0, 1):
                    yield "per-channel standard deviation", x.std(dims, correction=correction)
            yield "mean", x.mean()
            yield "standard deviation", x.std()
            if flat.shape[1] == 1:  # one float target: its order statistics (rows of several: order_statistics.py)
                yield from _target_order_statistics(flat[:, 0])
            if not bool((x == x.round()).all()):  # integer-valued data: its range is as good as public (pixels)
                yield "minimum", x.min()
                yield "maximum", x.max()
        elif t.dtype.is_floating_point and t.dim() == 1 and t.shape[0] > 1:  # a float target (a regression's y)
            y = t.detach().to(torch.float64)
            yield "mean", y.mean()
            for correction in (0, 1):
                yield "standard deviation", y.std(correction=correction)
            yield from _target_order_statistics(y)
        elif not t.dtype.is_floating_point and t.dim() == 1 and t.numel() > 1 and int(t.min()) >= 0:
            counts = torch.bincount(t.detach().to(torch.int64).cpu()).to(torch.float64)
            if len(counts) < 2 or len(counts) > 10_000:
                return
            present = counts[counts > 0]
            yield "class counts", counts
            yield "class frequencies", counts / counts.sum()
            if len(present) == len(counts):
                prior = (counts / counts.sum()).log()  # an output bias set to the log prior (a common initialisation)
                yield "log class frequencies", prior
                if len(counts) == 2:  # a binary task's one-number weights: BCEWithLogitsLoss(pos_weight=neg / pos),
                    yield "log-odds of class 1", prior[1:] - prior[:1]  # a focal loss's alpha = neg / N
                    for k in (0, 1):
                        yield f"ratio of the class counts ({k} to {1 - k})", counts[k] / counts[1 - k]
                        yield f"fraction of class {k}", counts[k] / counts.sum()
                inverse = 1 / counts
                yield "inverse class counts", inverse
                yield "inverse class frequencies (summing to 1)", inverse / inverse.sum()
                yield "inverse class frequencies (averaging 1)", inverse / inverse.mean()
                yield "balanced class weights", counts.sum() / (len(counts) * counts)


def _target_order_statistics(y: Tensor) -> Iterator[tuple[str, Tensor]]:
    """The median (lower, higher, linear), minimum and maximum of one float target, unless its values are all
    integers (ratings, counts: a known scale's ends and middle are as likely public constants)."""
    y = y[torch.isfinite(y)]
    if len(y) < 2 or bool((y == y.round()).all()):
        return
    s = y.sort().values
    half = (len(s) - 1) / 2
    low, high = s[int(half)], s[math.ceil(half)]
    for name, value in (("median", low), ("median", high), ("median", (low + high) / 2), ("minimum", s[0]),
                        ("maximum", s[-1])):
        yield name, value


def _scaled_by_itself(t: Tensor, order: Any = OrderStatistics) -> str:
    """How ``t``'s features were scaled by their own statistics, or "": every column with mean 0 and standard
    deviation 1 (``StandardScaler``), with median 0 and interquartile range 1 (``RobustScaler``), or reaching both 0
    (or -1) and 1 exactly with more than two values in most columns (``MinMaxScaler``, or quantile clip-scaling; a
    known range divided out rarely has every column at both ends, and one-hot columns have two values). A column
    constant in the data is left at the scaler's bottom (0: scikit-learn scales a zero range by 1) and judged by that
    alone: digits' blank border pixels do not hide the scaling of the others; at least two columns must vary."""
    if not t.dtype.is_floating_point or t.dim() < 2 or t.shape[0] < 20 or t.numel() > MAX_ELEMENTS:
        return ""
    flat = t.detach().to(torch.float64).reshape(t.shape[0], -1)
    tol = 1e-5 if t.dtype == torch.float64 else 1e-4
    low, high = flat.min(0).values, flat.max(0).values
    varying = high - low > tol
    if int(varying.sum()) < 2:
        return ""
    constant = flat[0, ~varying]
    if bool((constant.abs() <= tol).all()):
        found = _scaled_columns(flat[:, varying], tol, lambda: [order(t).quantile(p)[varying] for p in (.25, .5, .75)])
        if found:
            return found
    for bottom in (0.0, -1.0):  # MinMaxScaler's default range, and feature_range=(-1, 1)
        if bool(((constant - bottom).abs() <= tol).all()) and _spans(flat[:, varying], bottom, tol):
            return f"scaled to [{bottom:g}, 1] by its own minimum and maximum (or quantiles)"
    return ""


def _fitted(t: Tensor, order: Any, others: Sequence[tuple[str, Tensor]] = ()) -> str:
    """How ``t``'s columns hold a statistic of the training set written into the records (an imputed mean or median:
    :mod:`.imputed_cells`, or one per group of ``others`` — the labels — or of a column: :mod:`.grouped_fills`;
    cells copied or interpolated from the neighbouring records: :mod:`.neighbour_copies`; a PCA projection:
    :mod:`.decorrelated_columns`; ranks: :mod:`.rank_columns`), or ""."""
    if not t.dtype.is_floating_point or t.dim() != 2 or t.shape[0] < 20 or not bool(torch.isfinite(t).all()):
        return ""
    sort = (lambda: order(t).sorted) if t.numel() <= FITTED_CELLS else (lambda: None)  # one sort, shared
    imputed = imputed_columns(t, sort()) if t.shape[1] <= IMPUTED_COLUMNS and t.numel() <= FITTED_CELLS else []
    if imputed:
        return f"{_IMPUTED} (the {' or '.join(sorted({how for _, how in imputed}))})"
    grouped = grouped_imputed_columns(t, others, sort()) if t.shape[1] <= IMPUTED_COLUMNS \
        and t.numel() <= FITTED_CELLS else []
    if grouped:
        return f"{_IMPUTED} within groups of records (the " + "; the ".join(
            f"{how} per group of {by} in column {j}" for j, how, by in grouped[:3]) + ")"
    copied = neighbour_copies(t, sort()) if t.shape[1] <= IMPUTED_COLUMNS and t.numel() <= FITTED_CELLS else []
    if copied:
        return f"{_COPIED} (" + "; ".join(
            ("copies of the previous or next record's cell" if how == "copy" else
             "linear interpolations between the records around them") + f" in column {j}"
            for j, how in copied[:3]) + ")"
    if decorrelated(t):
        return _PROJECTED
    ranked = rank_transformed(t, sort()) if t.shape[1] <= RANK_COLUMNS and t.numel() <= FITTED_CELLS else ""
    return f"{_RANKED}: {ranked}" if ranked else ""


def _scaled_columns(flat: Tensor, tol: float, quartiles: Any) -> str:
    """Whether the varying columns ``flat`` were standardised or robust-scaled by their own statistics
    (``quartiles()``: theirs, from the tensor's one sort, :class:`~.order_statistics.OrderStatistics`)."""
    if bool((flat.mean(0).abs() <= tol).all()) and \
            any(bool(((flat.std(0, correction=c) - 1).abs() <= tol).all()) for c in (0, 1)):
        return "standardised with its own mean and standard deviation"
    if bool(torch.isfinite(flat).all()):
        q25, q50, q75 = quartiles()
        if bool((q50.abs() <= tol).all()) and bool(((q75 - q25 - 1).abs() <= tol).all()):
            return "scaled by its own median and interquartile range"
    return ""


def _spans(flat: Tensor, bottom: float, tol: float) -> bool:
    """Whether every varying column of ``flat`` reaches exactly ``bottom`` and 1, most with more than two values,
    as a scaler by the column's own statistics leaves it: a record or two at each end (its minimum and maximum), or
    the same number in every column (clipped at one quantile level of each: within :data:`SAME_COUNT`). A clip at
    public bounds (``(0.3 * x + 0.5).clamp(0, 1)``) leaves as many records at the ends as each column's tails hold:
    counts that differ between columns (zoo32 t08)."""
    low, high = flat.min(0).values, flat.max(0).values
    ends = bool(((low - bottom).abs() <= tol).all()) and bool(((high - 1).abs() <= tol).all())
    if not ends or sum(len(torch.unique(c)) > 2 for c in flat[:, :64].T) * 2 <= min(64, flat.shape[1]):
        return False
    counts = [((flat - end).abs() <= tol).sum(0) for end in (bottom, 1.0)]
    return all(int(c.max()) <= 2 or int(c.max() - c.min()) <= SAME_COUNT for c in counts)


SAME_COUNT = 2
"""The most by which the records at a scaled column's end may differ in count between columns clipped at one quantile
level (an interpolated quantile and ties in the data move it by a record or two)."""


def _candidates(owners: Iterable[tuple[str, Any]], parameters: bool = True) -> Iterator[tuple[str, Any]]:
    """(path, value) of the tensors, arrays and number sequences the owners hold: a module's parameters (unless not
    ``parameters``), buffers and its submodules' attributes, another object's attributes (one level into lists,
    tuples and dicts of them)."""
    for label, owner in owners:
        if isinstance(owner, nn.Module):
            at = f"{label}." if label.startswith(("loader.", "dataset ")) else ""  # a transform the loader holds
            for name, p in owner.named_parameters() if parameters else ():  # initialised from the data: a log prior
                yield f"parameter {at}{name}", p
            for name, b in owner.named_buffers():
                yield f"buffer {at}{name}", b
            for prefix, m in owner.named_modules():
                yield from _attributes(f"attribute {at}{prefix + '.' if prefix else ''}", m, framework_keys())
        else:
            yield from _attributes(f"{label}.", owner)


def _attributes(prefix: str, owner: Any, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    for key, value in (vars(owner).items() if hasattr(owner, "__dict__") else ()):
        if isinstance(value, (nn.Module, nn.Parameter)) or key.startswith("__") or key in skip:
            continue
        yield f"{prefix}{key}", value
        yield from ((f"{prefix}{key}{suffix}", column) for suffix, column in number_columns(value))
        if isinstance(value, (list, tuple)) and 0 < len(value) <= 16 and not _numbers(value):
            for i, item in enumerate(value):
                yield f"{prefix}{key}[{i}]", item
                yield from ((f"{prefix}{key}[{i}]{suffix}", column) for suffix, column in number_columns(item))
        elif isinstance(value, dict) and len(value) <= 64:
            for k, item in value.items():
                yield f"{prefix}{key}[{k!r}]", item
                yield from ((f"{prefix}{key}[{k!r}]{suffix}", column) for suffix, column in number_columns(item))
        elif hasattr(value, "__dict__") and not isinstance(value, (Tensor, type)) \
                and type(value).__module__.split(".")[0] not in ("torch", "pytorch_lightning", "lightning"):
            for k, item in vars(value).items():  # a transform object: Normalize(mean, std)
                if not k.startswith("__"):
                    yield f"{prefix}{key}.{k}", item


def _numbers(value: Any) -> bool:
    """Whether every item of ``value`` is a real number: Python's or NumPy's (``tuple(array)``), not a boolean."""
    return all(isinstance(v, numbers.Real) and not isinstance(v, bool) and type(v).__name__ != "bool_" for v in value)


def _as_tensor(value: Any) -> Any:
    if isinstance(value, Tensor):  # dense and real (a sparse adjacency is not a summary)
        return value.detach() if value.layout == torch.strided and not value.dtype.is_complex else None
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None and value.dtype.kind in "fiu":
        return torch.as_tensor(value)
    if isinstance(value, (list, tuple)) and value and _numbers(value):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    return None


def _round(value: float) -> bool:
    """A number a person writes — a multiple of 1/16 below 2¹⁶ in size (-1, 0.5, 255), or one of three significant
    digits (0.1, 3e-4, 0.07) —: the end of a public range or a hyper-parameter (a learning rate of 0.1 equals iris's
    smallest petal width) rather than a record's value, for a single number matched to a record's. So the extreme
    of data recorded to three significant digits or fewer is not found as a single number (a per-feature vector of
    them still is: :mod:`.order_statistics`)."""
    return abs(value) < 65536 and (float(value * 16).is_integer() or float(f"{value:.3g}") == value)


def _near_trivial(value: float) -> bool:
    """Within the matching tolerance of 0 or 1 (:func:`_equal`)."""
    return abs(value) <= _ATOL or abs(value - 1.0) <= _RTOL + _ATOL


def _constant(t: Tensor) -> bool:
    flat = t.reshape(-1)
    return bool((flat == flat[0]).all())


def _equal(candidate: Tensor, stat: Tensor, rtol: float = _RTOL) -> bool:
    """Equal to float precision; a constant statistic (all zero, all one) never matches: it says nothing of the data.
    Nor does a scalar statistic or candidate within the tolerance of 0 or 1: what matches it is within twice the
    tolerance of that constant, which a layer's configuration holds whatever the data (a convolution's ``padding``
    ``(0,)`` or ``dilation`` ``(1,)``, an ``eps`` of 1e-6), and data normalised per record (each utterance or image to
    mean 0 and variance 1, as Hugging Face's Wav2Vec2FeatureExtractor does) has a global mean within it of 0 and a
    standard deviation within it of 1."""
    if candidate.numel() != stat.numel() or (stat.numel() > 1 and _constant(stat)) \
            or (stat.numel() == 1 and (_near_trivial(float(stat)) or _near_trivial(float(candidate)))):
        return False
    c = candidate.detach().to("cpu", torch.float64).reshape(-1)
    return bool(torch.allclose(c, stat.reshape(-1).cpu(), rtol=rtol, atol=_ATOL))


held_candidates = _candidates
"""What the owners hold that is compared with the statistics (public: :mod:`.written_statistics` walks it too)."""
