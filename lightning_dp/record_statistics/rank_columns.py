"""Columns replaced by a function of each value's rank among the training records: RankGauss, quantile transforms,
quantile bins.

``QuantileTransformer(output_distribution="normal")`` (Kaggle's RankGauss), its uniform output, pandas'
``rank(pct=True)``, ``erfinv`` of scaled ranks, and ``KBinsDiscretizer(strategy="quantile", encode="ordinal")`` map
each value to a function of where it ranks among all the training records': one record moved changes the ranks, so
the values, of many others, and no noise covers them.

:func:`rank_transformed` finds a training feature tensor ([N, D] floating point, at most 1024 columns and 2²⁴ cells,
no NaN) holding such columns:

* **rank scores**: a column of N ≥ 20 records with at least 20 distinct values, at least N / 2 of them, not sorted in
  row order, whose distinct values v, transformed by g ∈ {Φ (the normal CDF), erf}, lie on a straight line in their
  average rank (``g(v) = a + b · rank``) to 1e-5 of their range: Gaussian rank scores (the extreme two values are
  left out: sklearn clips them). Raw continuous data never lies exactly on such a curve. Evenly spaced values (g the
  identity: a uniform rank transform) are taken only when two columns or more share the same spacing and range:
  one evenly spaced column may be a public grid (a shuffled ``linspace``, time steps);
* **quantile bins**: two columns or more whose values are exactly the integers 0 … K − 1 (K ≥ 3), each about equally
  often (within 2 of N / K, at least 20 records a bin), and that are not the same column: ordinal quantile bins.
  Binary columns (K = 2: a median split) and one-hot encoded bins are not seen (a balanced 0/1 column is ordinary
  data); a balanced factorial design with three levels or more looks the same and would be refused.

A quantile transform with fewer landmarks than records (scikit-learn's default 1,000 on a larger set) interpolates
between them and is not exact; it is not seen, nor a rank transform of columns with many ties (iris, wine, digits:
fewer than N / 2 distinct values, or tied values not given their average rank's score).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

MAX_COLUMNS, MAX_CELLS = 1024, 1 << 24
"""Feature tensors with more columns (images as pixels) or cells are not judged column by column."""

_TOL = 1e-5


def rank_transformed(t: Tensor, sorted_columns: Optional[Tensor] = None) -> str:
    """What rank transform ``t``'s columns show ("" if none; module docstring). ``sorted_columns``: ``t``'s columns
    sorted ([D, N]: :class:`~.order_statistics.OrderStatistics`'s ``sorted``), if at hand."""
    if not t.dtype.is_floating_point or t.dim() != 2 or t.shape[0] < 20 or t.shape[1] > MAX_COLUMNS \
            or t.numel() > MAX_CELLS or not bool(torch.isfinite(t).all()):
        return ""
    s = (sorted_columns if sorted_columns is not None else t.detach().T.sort(1).values).to("cpu", torch.float64)
    n = s.shape[1]
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    distinct = new.sum(1)
    integral = (s == s.round()).all(1) & (s[:, 0] == 0) & (s[:, -1] == distinct - 1)
    grids: list[tuple[float, float]] = []
    bins: dict[int, list[int]] = {}
    for j in ((distinct >= max(20, n / 2)) | (integral & (distinct >= 3))).nonzero().flatten().tolist():
        values, counts = s[j][new[j]], torch.diff(torch.cat([new[j].nonzero().flatten(), torch.tensor([n])]))
        if bool(integral[j]):
            if _binned(values, counts, n):
                bins.setdefault(len(values), []).append(j)
            continue
        col = t[:, j].detach()
        if bool((col.diff() >= 0).all()) or bool((col.diff() <= 0).all()):
            continue  # sorted in row order: a grid laid out as such, not the ranks of records in their order
        rank = counts.cumsum(0) - (counts + 1) / 2  # the average rank (0-based) of each distinct value
        if _on_line(torch.special.ndtr(values), rank) or _on_line(torch.erf(values), rank):
            return "replaced by Gaussian scores of its values' ranks (RankGauss, a quantile transform)"
        if _on_line(values, rank):
            grids.append((round(float(values[0]), 6), round(float(values[-1]), 6)))
    if any(grids.count(g) >= 2 for g in grids):
        return "replaced by its values' ranks, evenly spaced (a uniform quantile transform)"
    x = t.detach()
    if any(len(js) >= 2 and any(not torch.equal(x[:, js[0]], x[:, j]) for j in js[1:]) for js in bins.values()):
        return "replaced by quantile bins of equal counts (KBinsDiscretizer(strategy='quantile'))"
    return ""


def _binned(values: Tensor, counts: Tensor, n: int) -> bool:
    """Whether a column's distinct ``values`` are 0 … K − 1 (K ≥ 3) with ``counts`` within 2 of n / K, ≥ 20 each."""
    k = len(values)
    return 3 <= k <= n / 20 and torch.equal(values, torch.arange(k, dtype=values.dtype)) \
        and bool(((counts - n / k).abs() <= 2).all())


def _on_line(y: Tensor, rank: Tensor) -> bool:
    """Whether ``y`` (increasing, one per distinct value) is an affine function of ``rank`` to 1e-5 of its range, the
    two extreme values left out."""
    y, r = y[1:-1], rank[1:-1]
    spread = float(y[-1] - y[0])
    if spread <= 0:
        return False
    slope = (y[-1] - y[0]) / (r[-1] - r[0])
    return bool(((y - y[0] - slope * (r - r[0])).abs() <= _TOL * spread).all())


def rank_fix() -> str:
    """The fix a refusal of rank-transformed columns names."""
    return ("Transform each value alone by a public function (log1p, a fixed clip, bins with public edges), or "
            "standardise with lightning_dp.data.PrivateStandardizer; ranks and quantiles among the training records "
            "are statistics of all of them.")
