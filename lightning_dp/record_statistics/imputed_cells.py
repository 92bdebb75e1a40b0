"""Missing values filled with a statistic of the training column: mean or median imputation before the fit.

``np.where(np.isnan(x), np.nanmean(x, 0), x)``, ``df.fillna(df.mean())`` or scikit-learn's
``SimpleImputer(strategy="median")`` writes the mean (or median) of a column's observed values into each of its
missing cells. Those cells depend on every record's value (one record moves them all), in every record that had a
gap, and no noise covers them: training on them is not differentially private whatever σ the ledger counts.

:func:`imputed_columns` finds such a column of a training feature tensor ([N, D], N ≥ 20, at most 256 columns
and 2²⁴ cells, no NaN left): a value that fills two cells or more and equals, to the dtype's rounding (16 ulps of
the column's largest magnitude), the mean of the column's *other* cells, or their median: as many of them below it
as above, and halfway between its two neighbours (numpy's and pandas' median of an even count). The median of an
odd count of observed values is one of them (so is torch's lower median): the filled value then sits in the middle
of the others, as a constant fill near the middle does by chance (about 1 / √N), and is not seen — a column's
median imputation is found when its observed values are even in number, so one of several imputed columns almost
always is. The value 0 is never judged: it is the usual constant fill, and data symmetric by construction
(records and their negatives, zero-inflated) hold exact zeros that are both the mean and the median of the rest.
A repeated value says nothing by itself: integer and categorical columns repeat values all the time, and the mode of a
0/1 or a three-level column can be its median. So a column is judged only where the repeated value is not one of its
ordinary values: the column's most repeated value other than 0 where the other cells are continuous (ten or more other
than 0, at least 90 % of them distinct: a repeated value there is rare, and one equal to their mean to 1e-6 of their
scale never happens by chance), or the one value off the decimal grid (integers, tenths, hundredths, thousandths:
iris's 4.9 cm, a count) that all the other cells lie on (3.4172 in a column of integers) unless it is a simple fraction
of the grid's step (k / q for q ≤ 12: a vote share of ½ between 0/1 columns whose counts balance is their mean and
median by chance, about 1 / √N). A median of a grid column
that lands on the grid (the median of a 0/1 column is 0 or 1) is indistinguishable from data and not seen, nor is
an imputed column whose other values are neither continuous nor on a decimal grid (scikit-learn's rescaled
diabetes features).

The mean rounded to a decimal step (``round(mean, 5)``) is found where the column is continuous, the step is at
most 1/100 of the mean's standard error (σ / √m of the other cells) and fewer than 10 % of the other cells lie on it:
a value written by hand near the mean (a published average) has fewer digits, and lies within half such a step of
the mean by chance less than 0.4 % of the time. ``round(mean, 2)`` of a column of unit scale is a step above that
and not seen, nor is the mean plus a small jitter (each cell distinct).

A constant fill (0, -1, a public value) is not the mean or median of the column's values and passes; so does the
DP mean of :class:`~lightning_dp.data.PrivateImputer` (off the exact mean by its noise). Cells filled with the mean
of a record's k nearest neighbours (``KNNImputer``) differ from cell to cell and are not seen (docs/release_boundary.md,
"What the boundary cannot see").
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

MAX_COLUMNS, MAX_CELLS = 256, 1 << 24
"""Feature tensors with more columns (images as pixels: never imputed by column) or cells are not judged."""

_DECIMALS = 3  # grids of 1, 0.1, 0.01 and 0.001


def imputed_columns(t: Tensor, sorted_columns: Optional[Tensor] = None) -> list[tuple[int, str]]:
    """(column, "mean", "median" or "rounded mean") for each column of the training feature tensor ``t`` ([N, D]
    floating point, N ≥ 20, no missing value left) whose most repeated value is the mean or median of its other cells
    (module docstring; a mean rounded far below its error: :func:`_rounded_mean`). ``sorted_columns``: ``t``'s
    columns sorted ([D, N]: :class:`~.order_statistics.OrderStatistics`'s ``sorted``), if at hand."""
    if not t.dtype.is_floating_point or t.dim() != 2 or t.shape[0] < 20 or t.shape[1] > MAX_COLUMNS \
            or t.numel() > MAX_CELLS or not bool(torch.isfinite(t).all()):
        return []
    s = (sorted_columns if sorted_columns is not None else t.detach().T.sort(1).values).to("cpu", torch.float64)
    d, n = s.shape
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    position = torch.arange(n).expand(d, n)
    start = torch.where(new, position, torch.zeros_like(position)).cummax(1).values  # where each cell's run starts
    run = position - start + 1
    end = run.masked_fill(s == 0, 0).argmax(1)  # the last cell of each column's longest run: its most repeated value
    v = s.gather(1, end[:, None]).squeeze(1)
    zeros = (s == 0).sum(1)  # exact zeros (zero-inflated data) count once among the distinct others
    rest = n - run.gather(1, end[:, None]).squeeze(1) - zeros  # the other cells but zeros: 10 at least
    continuous = (new.sum(1) - 1 - (zeros > 0).long() >= 0.9 * rest) & (rest >= 10)
    judged = continuous.clone()
    v[~continuous], judged[~continuous] = off_grid(s[~continuous])
    k = (s == v[:, None]).sum(1)
    low = (s < v[:, None]).sum(1)  # cells below it
    m = n - k
    judged &= (k >= 2) & (m >= 10) & (v != 0)  # 0: the usual constant fill, and the middle of symmetric data
    tol = 16 * torch.finfo(t.dtype).eps * s.abs().amax(1)
    mean = (s.sum(1) - k * v) / m.clamp_min(1)
    a = s.gather(1, (low - 1).clamp_min(0)[:, None]).squeeze(1)
    b = s.gather(1, (low + k).clamp_max(n - 1)[:, None]).squeeze(1)
    halfway = (2 * low == m) & (low > 0) & ((a + b) / 2 - v).abs().le(tol)  # an even count's median
    spread = ((s.square().sum(1) - k * v * v) / m.clamp_min(1) - mean.square()).clamp_min(0).sqrt()
    found = []
    for j in judged.nonzero().flatten().tolist():
        if abs(float(mean[j] - v[j])) <= float(tol[j]):
            found.append((j, "mean"))
        elif bool(halfway[j]):
            found.append((j, "median"))
        elif bool(continuous[j]) and _rounded_mean(s[j], float(v[j]), float(mean[j]),
                                                   float(spread[j]) / max(int(m[j]), 1) ** 0.5, t.dtype):
            found.append((j, "rounded mean"))
    return found


def _rounded_mean(column: Tensor, v: float, mean: float, error: float, dtype: torch.dtype) -> bool:
    """Whether ``v`` is the ``mean`` of the other cells of ``column`` rounded to a decimal step (``round(mean, 4)``)
    that is at most 1 / 100 of the mean's standard error ``error``, while under 10 % of the other cells lie on that
    step: a constant written by hand (a public default near the mean) has fewer digits, and lies within half such
    a step of the mean by chance less than 0.4 % of the time."""
    step = rounding_step(v, mean, error, dtype)
    return step > 0 and off_step(column[column != v], step, 4 * torch.finfo(dtype).eps * abs(v))


def rounding_step(v: float, mean: float, error: float, dtype: torch.dtype) -> float:
    """The decimal step ``v`` lies on (its coarsest, 10⁻⁶ to 10¹²) if ``v`` is ``mean`` rounded to it and the step is
    at most ``error`` / 100; else 0."""
    if v == 0 or error <= 0:
        return 0.0
    eps = 4 * torch.finfo(dtype).eps * abs(v)
    for decimals in range(-6, 13):
        step = 10.0 ** -decimals
        if abs(v / step - round(v / step)) * step <= eps:  # v lies on this step: its coarsest decimal grid
            return step if step <= error / 100 and abs(v - mean) <= step / 2 + eps else 0.0
    return 0.0


def off_step(others: Tensor, step: float, eps: float) -> bool:
    """Whether fewer than 10 % of ``others`` lie on the decimal ``step`` (the data has more digits than the fill)."""
    scaled = others / step
    return len(others) > 0 and float(((scaled - scaled.round()).abs() * step <= eps).double().mean()) < 0.1


def off_grid(s: Tensor) -> tuple[Tensor, Tensor]:
    """For sorted columns ``s`` ([D, N]): the one value off the coarsest decimal grid (1, 0.1, 0.01, 0.001) that all
    their other cells lie on, and whether there is one (in two cells or more)."""
    value = torch.zeros(s.shape[0], dtype=s.dtype)
    found = torch.zeros(s.shape[0], dtype=torch.bool)
    undecided = torch.ones_like(found)
    for decimals in range(_DECIMALS + 1):
        scaled = s * 10 ** decimals
        off = (scaled - scaled.round()).abs() > 1e-6 * scaled.abs().amax(1, keepdim=True).clamp_min(1.0)
        count = off.sum(1)
        low = torch.where(off, s, torch.full_like(s, math.inf)).amin(1)
        high = torch.where(off, s, torch.full_like(s, -math.inf)).amax(1)
        one = undecided & (count >= 2) & (low == high)  # every off-grid cell holds the same value
        w = low * 10 ** decimals
        simple = torch.zeros_like(one)
        for q in range(2, 13):  # a simple fraction of the step: a vote share, a half (the middle of 0/1 columns)
            simple |= (w * q - (w * q).round()).abs() <= 1e-6 * w.abs().clamp_min(1.0) * q
        value[one], found[one] = low[one], ~simple[one]
        undecided &= count > 0  # on this grid entirely: no value off it; decided
        undecided &= ~one
    return value, found


def imputation_fix() -> str:
    """The fix a refusal of imputed cells names."""
    return ("Fill missing values with a constant or a public value (0, -1, a domain's known default), or with a DP "
            "mean per column: lightning_dp.data.PrivateImputer (charged to this fit's DPStrategy); for a mean per "
            "class or group, PrivateImputer(..., groups=G).fit_transform(x, strategy, group) at the same cost.")
