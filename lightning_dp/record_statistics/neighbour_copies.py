"""Missing values filled from the neighbouring records: forward or backward fill, linear interpolation.

``df.ffill()``, ``df.bfill()`` or ``df.interpolate()`` before the fit writes into a record's missing cell the cell of
the record before (or after) it, or a point on the line between the records around it. That cell is another
record's value — removing the neighbour changes it —, no noise covers it, and training on it is not differentially
private (rule 11): with a time series of people, one person's reading ends up in another's record.

:func:`neighbour_copies` judges each column of a training feature tensor ([N, D], N ≥ 20, in the dataset's order)
by the differences between neighbouring records: ``x[i] - x[i-1]`` for copies, ``x[i-1] - 2·x[i] + x[i+1]`` for
interpolations (zero, to 16 ulps of the column's largest magnitude, at each interpolated cell: a gap of any length
filled evenly). Real data has such zeros too — integer, ordinal and one-hot columns, a slowly varying sensor that
repeats its reading, a regular time stamp —, so a column is judged only where exact zeros are *out of place*:

* the column's lattice ``g`` — the median gap between its consecutive distinct values (the step of data recorded
  on a grid, else about range / N) — and a window ``W = max(4·g, 32·tol)``;
* judged only where the differences are large against the window: the median non-zero ``|x[i] - x[i-1]|`` (for
  copies) or the median ``|x[i-1] - 2·x[i] + x[i+1]|`` (for interpolations) at least ``4·W``. A sensor whose readings
  move by a step or two of its grid, a regular time stamp, integer and one-hot columns are never judged;
* found where the zeros number at least max(5, N / 500) and at least half the differences within the window but
  not zero (0 < |d| ≤ W): a smooth distribution of differences on a grid puts about one zero for 8 of those (none
  at all for continuous values), so this is 4 times the zeros that chance gives; a few missing cells in a few
  hundred records are enough.

A copy counts only where the value is not 0 (a constant fill, zero-inflated data), is neither the column's minimum nor
its maximum (a clipped or saturated reading), occurs nowhere else in the column (a constant fill, -1 or -999, recurs all
over the column), and the two records differ in another column (a record repeated as a whole is rule 9's concern, not a
fill); and a column is not judged for copies where another column repeats the record before on the same records (4 in 5
of those where either does: an entity's fixed features — a patient's height — repeated over its records in long format;
columns filled column by column repeat on different records); an interpolation only where the cell's value occurs once
in the column (a new value, not one of a grid or a scale's that recurs: scikit-learn's diabetes ratios lie on a few such
steps) and the records around it differ by more than the window ``W`` (a line has a direction there: a cell within
tolerance of a line whose ends are themselves within tolerance is a flat run — a constant, or a constant under a
jitter far under the tolerance, ``digits + 1e-7·noise`` — not a point interpolated between two different readings).

What it cannot see: fills after the records were shuffled (the signature is in the order only), a fill of a column
on a coarse grid or one that changes by a step or two between records (the quantised sensor above: an ``ffill``
there looks like its own repeats), interpolations other than linear (``method="spline"``, ``"nearest"`` is a copy),
a gap filled by the mean of the k nearest records (KNNImputer, docs/release_boundary.md), and columns missing
together (a panel of lab values) forward-filled together. A lone column that holds its reading over a few records
between updates that jump far (a sample-and-hold sensor, one fixed feature per entity with no other fixed column
beside it) looks like an ``ffill`` and is refused.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from lightning_dp.record_statistics.imputed_cells import MAX_CELLS, MAX_COLUMNS

MIN_ROWS = 20
_SAMPLE = 8192  # differences whose medians gate a column, at most (every k-th one)


def neighbour_copies(t: Tensor, sorted_columns: Optional[Tensor] = None) -> list[tuple[int, str]]:
    """(column, "copy" or "interpolation") for each column of the training features ``t`` ([N, D] floating point,
    no NaN) whose cells copy the previous or next record's cell, or interpolate linearly between the records around
    them, beyond chance (module docstring). ``sorted_columns``: ``t``'s columns sorted ([D, N]), if at hand. The
    differences and their medians are taken for all columns at once; a column's values are counted only where its
    zeros pass the first two tests."""
    if not t.dtype.is_floating_point or t.dim() != 2 or t.shape[0] < MIN_ROWS or t.shape[1] > MAX_COLUMNS \
            or t.numel() > MAX_CELLS or not bool(torch.isfinite(t).all()):
        return []
    x = t.detach().to("cpu", torch.float64)
    n = x.shape[0]
    least = max(5.0, n / 500)
    s = (sorted_columns if sorted_columns is not None else x.T.sort(1).values).to("cpu", torch.float64)
    step = max(1, n // _SAMPLE)  # the medians over every step-th difference: a gate, not a measure
    gaps = (s[:, 1:] - s[:, :-1])[:, ::step]
    lattice = torch.where(gaps > 0, gaps, torch.full_like(gaps, math.nan)).nanmedian(1).values  # [D]
    tol = 16 * torch.finfo(t.dtype).eps * x.abs().amax(0)
    window = torch.maximum(4 * lattice, 32 * tol)
    repeated = torch.zeros(n, dtype=torch.bool)
    repeated[1:] = (x[1:] == x[:-1]).all(1)  # a record equal to the one before as a whole
    d = x[1:] - x[:-1]  # [N - 1, D]
    same = (d == 0) & ~repeated[1:, None]  # a cell equal to the one before, in another record
    moved = torch.where(d[::step] != 0, d[::step].abs(), torch.full_like(d[::step], math.nan)).nanmedian(0).values
    d2 = (x[:-2] - 2 * x[1:-1] + x[2:]).abs()  # [N - 2, D]
    bent = d2[::step].median(0).values
    copies, on_line = same.sum(0).tolist(), (d2 <= tol).sum(0).tolist()  # the zeros, before they are judged
    found = []
    for j in range(x.shape[1]):
        if bool(torch.isnan(lattice[j])):
            continue  # a constant column
        w, e = float(window[j]), float(tol[j])
        if float(moved[j]) >= 4 * w and copies[j] >= least \
                and _copies(x[:, j], d[:, j], repeated, w) >= least and not _aligned(same, j):
            found.append((j, "copy"))
        elif float(bent[j]) >= 4 * w and on_line[j] >= least \
                and _interpolations(x[:, j], d2[:, j], repeated, e, w, (x[2:, j] - x[:-2, j]).abs()) >= least:
            found.append((j, "interpolation"))
    return found


def _copies(c: Tensor, d: Tensor, repeated: Tensor, window: float) -> float:
    """The cells of column ``c`` (``d``: its differences to the cell before) that count as copies, or 0 where they
    are not out of place."""
    _, inverse, counts = torch.unique(c, return_inverse=True, return_counts=True)
    run = torch.cat([torch.ones(1, dtype=torch.long), (d != 0).long()]).cumsum(0)  # the run of equal cells of each
    run_length = torch.bincount(run)[run]
    only_here = counts[inverse] == run_length  # every occurrence of the value is in this one run
    cell = c[1:]
    copy = (d == 0) & (cell != 0) & (cell != c.min()) & (cell != c.max()) & only_here[1:] & ~repeated[1:]
    zeros = int(copy.sum())
    near = int(((d.abs() > 0) & (d.abs() <= window)).sum())
    return float(zeros) if 2 * zeros >= near else 0.0


def _aligned(same: Tensor, j: int) -> bool:
    """Whether column ``j`` repeats the record before on the same records as another column does (4 in 5 of the
    records where either does): an entity's fixed features repeated over its records in long format, a panel of
    columns held together — missing cells copied column by column fall on different records."""
    both = (same[:, j:j + 1] & same).sum(0)
    either = (same[:, j:j + 1] | same).sum(0)
    aligned = both >= 0.8 * either
    aligned[j] = False
    return bool(aligned.any())


def _interpolations(c: Tensor, d2: Tensor, repeated: Tensor, tol: float, window: float, span: Tensor) -> float:
    """The cells of column ``c`` on the line between their two neighbours (``d2``: the absolute second differences;
    ``span``: the neighbours' absolute difference, more than ``window`` for a line with a direction), or 0 where
    they are not out of place."""
    _, inverse, counts = torch.unique(c, return_inverse=True, return_counts=True)
    once = (counts[inverse] == 1)[1:-1]  # an interpolated value is new; a value of a grid or a scale recurs
    on_line = (d2 <= tol) & (span > window) & once & ~repeated[1:-1] & ~repeated[2:]
    zeros = int(on_line.sum())
    near = int(((d2 > tol) & (d2 <= window) & once).sum())
    return float(zeros) if 2 * zeros >= near else 0.0


def neighbour_fix() -> str:
    """The fix a refusal of copied or interpolated cells names."""
    return ("Fill missing values without reading other records: a constant or a public value, or a DP mean per "
            "column (or per class: groups=) with lightning_dp.data.PrivateImputer, charged to this fit's "
            "DPStrategy — not a forward/backward fill or an interpolation across records.")
