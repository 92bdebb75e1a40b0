"""The public range of :class:`~lightning_dp.data.PrivateStandardizer` and :class:`~lightning_dp.data.PrivateImputer`,
compared at their ``fit`` with the very data they are fitted on.

Both mechanisms' sensitivity is one record's within a range [lo, hi] fixed before the data are seen, and the range is
published with them (their ``lower`` and ``upper``). A range read off the private data — ``X.min(0)`` and
``X.max(0)``, ``np.nanpercentile(X, [1, 99], axis=0)``, ``torch.quantile`` — is itself an exact release: a column's
minimum or maximum is one record's value, a percentile a function of a few, and no noise or ledger covers them.

:func:`check_public_bounds` finds a bound that equals a statistic of its own column (observed values; NaN aside):

* one of the column's values among its lowest or highest 5 % (its minimum and maximum, and a percentile taken by
  NumPy's ``lower``/``higher``/``nearest`` methods), exactly as a float32 or a float64;
* its percentile at 0.1, 0.25, 0.5, 1, 1.5, … 5 or 95, … 99, 99.5, 99.75, 99.9 by linear interpolation (NumPy's and
  torch's default), to a relative :data:`RTOL` (float32 rounding is 6e-8),

unless the bound is a *round* number (:func:`round_number`: 0, 1, 16, 255, 2024, 0.001, 1e6): the ends of a domain
(pixels 0–16 of scikit-learn's digits, a binary column's 0 and 1, a year), which the data's own extremes often equal
without being read off them. It refuses (``PrivacyConfigurationError``) when at least a quarter of the bound entries
given match (a number counts once, a vector once per entry; at least one), and warns when fewer do.

What it cannot see: bounds read off the data and then changed (rounded, widened by a margin: still a release, of less),
bounds of other rows (a superset of the training rows), and extremes of data recorded to three significant digits or
fewer (round numbers, so taken for a domain's).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError

RTOL = 4e-6
"""Relative tolerance of a bound's match with an interpolated percentile (float32 arithmetic: about 30 ulps)."""

TAIL = 0.05
"""The share of a column's lowest and highest values whose exact copies are matched."""

PERCENTILES = (0.1, 0.25, *(k / 2 for k in range(1, 11)), *(100 - k / 2 for k in range(1, 11)), 99.75, 99.9)
"""Percentiles (linear interpolation) a bound is compared with."""

CHUNK = 1 << 24
"""Values sorted at a time (columns in chunks): about 128 MB of float64 beside the features."""

SHARE = 0.25
"""The share of the bound entries given whose match refuses the fit."""


def round_number(value: float) -> bool:
    """A number a person writes for the end of a domain: a multiple of 1/16 below 2¹⁶ in size (0, −1, 0.5, 255, 2024)
    or one of at most three significant digits (0.1, 3e-4, 1e6), also as a float32 (``torch.tensor(0.1)``)."""
    if abs(value) < 65536 and float(value * 16).is_integer():
        return True
    short = float(f"{value:.3g}")
    return short == value or float(torch.tensor(short, dtype=torch.float32)) == float(
        torch.tensor(value, dtype=torch.float32))


def matched_columns(columns: Tensor, bounds: Tensor) -> Tensor:
    """Which of ``bounds`` [D] equal a tail value or a tail percentile of their column of ``columns`` [N, D] (float64,
    NaN where missing; module docstring), round numbers aside: a [D] bool."""
    n = (~torch.isnan(columns)).sum(0)
    ordered = torch.sort(columns, dim=0).values  # NaN last
    top = (n - 1).clamp_min(0)
    k = min(columns.shape[0], math.ceil(TAIL * columns.shape[0]) + 1)
    steps = torch.arange(k).unsqueeze(1)
    lows = ordered.gather(0, torch.minimum(steps, top))
    highs = ordered.gather(0, (top - steps).clamp_min(0))
    tails = torch.cat([lows, highs])  # [2k, D]; a short column repeats its values, harmless
    exact = (tails == bounds).any(0) | (tails.to(torch.float32) == bounds.to(torch.float32)).any(0)
    pos = torch.tensor(PERCENTILES, dtype=torch.float64).unsqueeze(1) / 100 * top.to(torch.float64)  # [P, D]
    below = pos.floor().long()
    a, b = ordered.gather(0, below), ordered.gather(0, torch.minimum(below + 1, top.expand_as(below)))
    interpolated = a + (pos - below) * (b - a)
    near = ((interpolated - bounds).abs() <= RTOL * bounds.abs().clamp_min(1e-30)).any(0)
    rounded = torch.tensor([round_number(float(v)) for v in bounds.tolist()], dtype=torch.bool)
    return (exact | near) & ~rounded & (n > 0)


def check_public_bounds(features: Tensor, lower: Tensor, upper: Tensor, given: tuple[Tensor, Tensor],
                        name: str) -> None:
    """Refuse (or warn: module docstring) when ``lower`` and ``upper`` (broadcast to ``features``' shape after the
    first dimension) were read off ``features`` [N, ...] (float64, NaN where missing). ``given``: the bounds as the
    user gave them (their entries are counted), ``name``: the class refusing."""
    columns = features.reshape(features.shape[0], -1)
    found, entries = 0, 0
    width = max(1, CHUNK // max(1, columns.shape[0]))
    for bound, mine in zip((lower, upper), given):
        flat = bound.reshape(-1)
        matched = torch.cat([matched_columns(columns[:, s:s + width], flat[s:s + width])
                             for s in range(0, flat.numel(), width)])
        entries += mine.numel()
        try:
            entry = torch.broadcast_to(torch.arange(mine.numel()).view(mine.shape), lower.shape).reshape(-1)
        except RuntimeError:  # broadcast only together with the other bound: count per column
            entry, entries = torch.arange(matched.numel()), entries - mine.numel() + matched.numel()
        found += len(torch.unique(entry[matched]))
    if not found:
        return
    what = (f"{name}: {found} of the {entries} lower/upper bound entries equal a minimum, a maximum or a tail "
            "percentile (0.1–5 % or 95–99.9 %) of the very features given to fit: bounds read off the private data "
            "publish those records' values with it, and no noise or ledger covers them")
    fix = ("Fix: take the range from domain knowledge (a unit's physical or recorded limits, a round generous range: "
           "a wider one costs accuracy, not privacy), or from public data; there is no DP quantile in lightning_dp "
           "to estimate it.")
    if found >= max(1, math.ceil(SHARE * entries)):
        raise PrivacyConfigurationError(what + ". " + fix)
    warnings.warn(what + " (too few to refuse; check them). " + fix, UserWarning, stacklevel=3)
