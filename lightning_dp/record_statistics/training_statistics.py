"""The statistics of the training data a held value is compared with, computed once and kept for the fit.

:class:`TrainingStatistics` summarises the training tensors (and the datasets' NumPy record arrays) as code commonly
keeps them — per-feature and per-channel means, standard deviations and variances, a float target's mean, deviation
and order statistics, the labels' class counts and the weights derived from them (:func:`statistics_of`) — and, per
feature width when a candidate of that width is first compared, their order statistics, second moments,
class-conditional statistics and principal directions. :meth:`TrainingStatistics.held_by` says what statistic a held
value equals (to float precision; within a rounding or subsample error through :mod:`.near_statistics`),
:meth:`TrainingStatistics.slices_held` what rows or columns of a 2-D value equal, and
:meth:`TrainingStatistics.scaled` which feature tensors are scaled by their own statistics (:mod:`.scaled_records`).

Used twice (docs/release_boundary.md, rule 11): by the check before the first release (:mod:`.data_statistics`) and,
kept for the fit, by the comparison of what the hooks write during it (:mod:`.written_statistics`). Constant tensors
are never taken for a statistic, nor is a scalar within the tolerance of 0 or 1 (:func:`equal`). A single number is
matched to a single-number statistic at float precision only (:func:`_lone_tolerance`), vectors to 1e-4: a held-out
loss or a best score kept on the module comes within 1e-4 of a class fraction by chance. Not seen: one column's
statistic kept as a single number (``x[:, 3].mean()``; a column's vector of statistics is).
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Collection, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.fingerprints.public_names import is_public
from lightning_dp.record_statistics.clipped_columns import clipped
from lightning_dp.record_statistics.coarse_labels import coarse_statistics
from lightning_dp.record_statistics.conditional_statistics import class_conditional, conditional_rows
from lightning_dp.record_statistics.near_statistics import NearStatistics
from lightning_dp.record_statistics.order_statistics import OrderStatistics
from lightning_dp.record_statistics.read_records import as_tensor, dataset_length
from lightning_dp.record_statistics.released_statistics import is_released, released_end, released_vectors
from lightning_dp.record_statistics.scaled_records import MAX_ELEMENTS, fitted, scaled_by_itself
from lightning_dp.record_statistics.scaled_targets import scaled_target
from lightning_dp.record_statistics.second_moments import SecondMoments
from lightning_dp.records.held_records import holds_records, row_digests

__all__ = ["MAX_ELEMENTS", "TrainingStatistics", "as_candidate", "equal", "real_numbers", "statistics_of",
           "training_name"]


_RTOL, _ATOL = 1e-4, 1e-6
_EXACT = ("median", "minimum", "maximum")  # values of the data: matched to 4 float32 ulps, not to a sampling error
_ULP = 2.0 ** -23  # a float32 ulp at 1
_LONE_ULPS = 16  # a lone number's tolerance, in float32 ulps of its scale (_lone_tolerance)
_MEANS = ("mean", "per-feature mean", "per-channel mean")  # averages of the data: scale the mean of |x|
_ONE_NUMBER = (*_EXACT, "ratio of the class counts", "fraction of class")  # single numbers: never a round one
_NEAR = "approximately the"


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
                      for name, value in statistics_of(t)]
        self.sizes = {stat.numel() for _, stat, _ in self.stats}
        by_id = {id(t): t for _, t in [*tensors, *arrays]}
        self.lone = {i: _lone_tolerance(name, stat, by_id[source]) for i, (name, stat, source) in enumerate(self.stats)
                     if stat.numel() == 1}
        """The absolute tolerance of each single-number statistic (by its index in :attr:`stats`): float precision."""
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
        t = as_candidate(value)
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
                    rtol = 4 * _ULP if stat_name.startswith(_EXACT) else _RTOL
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
                for how in [scaled_by_itself(t, shaped.order) or scaled_target(t)
                            or fitted(t, shaped.order, [(names[p], u) for p, u in tensors if u is not t])
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
        candidate = as_candidate(value)
        if candidate is None or (not full and candidate.numel() not in self.sizes):
            return []  # (no statistic of its size: nothing else to compare in part)
        if candidate.numel() == 0 or (candidate.numel() > 1 and _constant(candidate)) \
                or is_released(candidate, self.charged):  # a DP release its ledger counts (:mod:`.released_statistics`)
            return []
        beside = name.startswith(("dataset ", "loader."))  # held for the items: against the records' statistics
        for i, (stat_name, stat, source) in enumerate(self.stats):
            if source == id(value) or (beside and source not in self.records):
                continue
            if stat_name.startswith(_ONE_NUMBER) and candidate.numel() == 1 and _round(float(candidate)):
                continue  # a public range's end (-1, 0.5, 255: pixels scaled to [-1, 1]) is no record's value
            try:
                if i in self.lone:  # a lone number: to float precision only (_lone_tolerance)
                    same = equal(candidate, stat, 0.0, self.lone[i])
                else:
                    same = equal(candidate, stat, 4 * _ULP if stat_name.startswith(_EXACT) else _RTOL)
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


def statistics_of(t: Tensor) -> Iterator[tuple[str, Tensor]]:
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
            yield from coarse_statistics(counts)  # of y >= k, y == k, y // d, y % m (coarse_labels.py, zoo39 L05)


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


def real_numbers(value: Any) -> bool:
    """Whether every item of ``value`` is a real number: Python's or NumPy's (``tuple(array)``), not a boolean."""
    return all(isinstance(v, numbers.Real) and not isinstance(v, bool) and type(v).__name__ != "bool_" for v in value)


def as_candidate(value: Any) -> Any:
    if isinstance(value, Tensor):  # dense and real (a sparse adjacency is not a summary)
        return value.detach() if value.layout == torch.strided and not value.dtype.is_complex else None
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None and value.dtype.kind in "fiu":
        return torch.as_tensor(value)
    if isinstance(value, (list, tuple)) and value and real_numbers(value):
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
    """Within the matching tolerance of 0 or 1 (:func:`equal`)."""
    return abs(value) <= _ATOL or abs(value - 1.0) <= _RTOL + _ATOL


def _constant(t: Tensor) -> bool:
    flat = t.reshape(-1)
    return bool((flat == flat[0]).all())


def _lone_tolerance(name: str, stat: Tensor, t: Tensor) -> float:
    """How far a single number may be from the single-number statistic ``stat`` (``name``, of the training tensor
    ``t``) and be taken for it: float precision, not a sampling error. A lone number is weak evidence: at 1e-4 a
    held-out loss kept on the module (uniform in [0.05, 3]) came that close to one of breast cancer's five
    single-number label statistics once in 3,900 values (a test's fit, keeping a few, once in 50 fits). So it must be
    the statistic as code computes it in float32: within :data:`_LONE_ULPS` float32 ulps of its scale — for a mean
    (of the features, a target, a lone feature or channel) the mean of the values' magnitudes, which bounds the
    summation error (measured: torch's float32 ``mean`` within 1.6 ulps of it, NumPy's 1-D float32 ``mean`` 1.3,
    up to 10⁶ values; ``std`` and ``var`` accumulate in float64 on the CPU, 0.3 ulps of the deviation); for the
    log-odds (``log(pos / neg)``, near 0 for balanced classes) at least 1; else the statistic itself (a fraction or a
    ratio of counts: one rounding). A data value (median, minimum, maximum) within 4 ulps of itself. Not seen: a
    mean summed naively in float32 over thousands of values (NumPy's ``mean(0)`` of a [N, 1] array: about
    0.25·√N ulps), or in half precision."""
    s = float(stat)
    if name.startswith(_EXACT):
        return 4 * _ULP * abs(s)
    scale = abs(s)
    if name.startswith(_MEANS) and t.dtype.is_floating_point:
        magnitude = float(t.detach().to(torch.float64).abs().mean())
        scale = max(scale, magnitude) if math.isfinite(magnitude) else scale
    elif name.startswith("log-odds"):
        scale = max(scale, 1.0)
    return _LONE_ULPS * _ULP * scale


def equal(candidate: Tensor, stat: Tensor, rtol: float = _RTOL, atol: float = _ATOL) -> bool:
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
    return bool(torch.allclose(c, stat.reshape(-1).cpu(), rtol=rtol, atol=atol))


