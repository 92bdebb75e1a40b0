"""Training feature tensors scaled by their own statistics, or holding statistics written into their cells.

Data standardised with its own mean and standard deviation (scikit-learn's ``StandardScaler().fit(x_train)``), scaled
by its own median and interquartile range or to [0, 1] by its own minimum and maximum, or whose missing cells were
filled with a statistic of the other records, makes every example's gradient depend on all the others: per-example
clipping then bounds nothing (docs/release_boundary.md, rule 11). :func:`scaled_by_itself` finds the scalings,
:func:`fitted` the statistics written into the cells (:mod:`.imputed_cells`, :mod:`.grouped_fills`,
:mod:`.neighbour_copies`, :mod:`.decorrelated_columns`, :mod:`.rank_columns`); :class:`~.training_statistics.
TrainingStatistics.scaled` calls them on each training tensor, and :mod:`.data_statistics` names their fixes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_dp.record_statistics.decorrelated_columns import decorrelated
from lightning_dp.record_statistics.grouped_fills import grouped_imputed_columns
from lightning_dp.record_statistics.imputed_cells import MAX_CELLS as FITTED_CELLS, MAX_COLUMNS as IMPUTED_COLUMNS, \
    imputed_columns
from lightning_dp.record_statistics.neighbour_copies import neighbour_copies
from lightning_dp.record_statistics.order_statistics import OrderStatistics
from lightning_dp.record_statistics.rank_columns import MAX_COLUMNS as RANK_COLUMNS, rank_transformed

__all__ = ["COPIED", "IMPUTED", "PROJECTED", "RANKED", "SAME_COUNT", "fitted", "scaled_by_itself"]

MAX_ELEMENTS = 1 << 27
"""Training tensors with more elements are neither judged here nor summarised (:mod:`.training_statistics`: the checks
run once, in the main process)."""

IMPUTED = "filled where values were missing with a statistic of its own column's other values"
COPIED = "filled where values were missing from the neighbouring records' cells"
PROJECTED = "projected on its own principal directions (columns centred and uncorrelated: PCA or whitening)"
RANKED = "transformed by the ranks of its values among the training records"


def scaled_by_itself(t: Tensor, order: Any = OrderStatistics) -> str:
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


def fitted(t: Tensor, order: Any, others: Sequence[tuple[str, Tensor]] = ()) -> str:
    """How ``t``'s columns hold a statistic of the training set written into the records (an imputed mean or median:
    :mod:`.imputed_cells`, or one per group of ``others`` — the labels — or of a column: :mod:`.grouped_fills`;
    cells copied or interpolated from the neighbouring records: :mod:`.neighbour_copies`; a PCA projection:
    :mod:`.decorrelated_columns`; ranks: :mod:`.rank_columns`), or ""."""
    if not t.dtype.is_floating_point or t.dim() != 2 or t.shape[0] < 20 or not bool(torch.isfinite(t).all()):
        return ""
    sort = (lambda: order(t).sorted) if t.numel() <= FITTED_CELLS else (lambda: None)  # one sort, shared
    imputed = imputed_columns(t, sort()) if t.shape[1] <= IMPUTED_COLUMNS and t.numel() <= FITTED_CELLS else []
    if imputed:
        return f"{IMPUTED} (the {' or '.join(sorted({how for _, how in imputed}))})"
    grouped = grouped_imputed_columns(t, others, sort()) if t.shape[1] <= IMPUTED_COLUMNS \
        and t.numel() <= FITTED_CELLS else []
    if grouped:
        return f"{IMPUTED} within groups of records (the " + "; the ".join(
            f"{how} per group of {by} in column {j}" for j, how, by in grouped[:3]) + ")"
    copied = neighbour_copies(t, sort()) if t.shape[1] <= IMPUTED_COLUMNS and t.numel() <= FITTED_CELLS else []
    if copied:
        return f"{COPIED} (" + "; ".join(
            ("copies of the previous or next record's cell" if how == "copy" else
             "linear interpolations between the records around them") + f" in column {j}"
            for j, how in copied[:3]) + ")"
    if decorrelated(t):
        return PROJECTED
    ranked = rank_transformed(t, sort()) if t.shape[1] <= RANK_COLUMNS and t.numel() <= FITTED_CELLS else ""
    return f"{RANKED}: {ranked}" if ranked else ""


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


