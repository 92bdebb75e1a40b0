"""A regression target scaled by its own statistics before training: standardised, centred, or min-max scaled.

``ys = (y - y.mean()) / y.std()`` (also of ``y.log()``), ``y - y.mean()`` and ``(y - y.min()) / (y.max() - y.min())``
make every record's target, so its gradient, a function of all the training targets, and no noise covers the mean,
the standard deviation or the extremes. :func:`scaled_target` finds such a target: a float tensor of one value a
record ([N] or [N, 1], N ≥ 20; feature tensors of two columns or more are :func:`.scaled_records.scaled_by_itself`'s)
that is not integer-valued and has at least 10 distinct values, whose finite values have

* mean 0 and standard deviation 1 (either convention) to 1e-4 (float32; 1e-6 in float64): standardised;
* standardised and then rounded to a decimal step h of 0.01 or finer (every value a multiple of h:
  ``((y - y.mean()) / y.std()).round(decimals=2)``): mean 0 and standard deviation √(1 + h²/12) (the rounding's own
  variance added) each within 5 standard errors of the rounding, 5·h/√(12 N), of them. A target in its own units
  whose population is itself standard (mean 0 and deviation 1: synthetic) and is rounded to 0.01 comes that close by
  chance in about 1 sample in 700 (measured: 7 of 6,000 at N = 100, 1,000 and 10,000; 1 of 6,000 at 0.001); coarser
  steps (0.1) are not judged;
* mean 0 to 1e-5 of its standard deviation (float32; 1e-9 in float64), the float rounding of ``y - y.mean()`` for a
  target whose mean was within about 200 standard deviations of 0 (a farther one loses too many digits in float32
  and is not seen): centred. A target whose true mean is exactly 0 (synthetic ``X @ w`` on centred features) comes
  that close by chance with probability about 0.8e-5·√N (float32): 8e-5 at N = 100, 8e-4 at N = 10⁴;
* minimum exactly 0 or -1 and maximum exactly 1 (bit for bit: ``(y - min) / (max - min)`` gives both exactly; a
  probability-like target coming within 1e-5 of its ends is not taken), each held by at most 1 % of the records
  (at least one): min-max scaled. A target clipped to [0, 1], a public range, has a mass of records at its ends
  and passes. So does a natural proportion ``k / n`` with a count ``n`` of its own per record (votes won of votes
  cast, of 1 to 100) that reaches 0 and 1 in a record or two (:func:`natural_proportions`): 95 % of its values
  or more are such fractions to float rounding (a continuous target min-max scaled lands that close to one of the
  ≈ 3,000 fractions of denominator ≤ 100 with probability ≈ 0.6 % a value in float32, ≈ 6e-9 in float64) and no
  common denominator ≤ 100 makes them all whole numbers. A target on one grid ``k / D`` is still refused: an
  integer-valued quantity min-max scaled by its own extremes (``(y - 3) / 44``) gives exactly that, and a natural
  score out of a fixed D (``k / 20``) that reaches 0 and 1 in ≤ 1 % of the records each looks the same.

Measured on unscaled targets: none of 600 float32 standard normal targets (true mean 0) of N = 100, 1,000 and 10,000
was found, nor the targets of scikit-learn's shipped digits, breast cancer, diabetes, iris and wine datasets.

Scale the target by public constants (a known unit, a round offset), or standardise it with
:class:`~lightning_dp.data.PrivateStandardizer` (a DP mean and standard deviation within public bounds): a target it
scaled passes by its noise.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor

MIN_RECORDS, MIN_DISTINCT = 20, 10
"""A target with fewer records or distinct values is not judged."""

ROUNDED_Z = 5.0
"""How many of its standard errors (step / √(12 N)) a rounded standardised target's mean and deviation may be off."""

EDGE_SHARE = 0.01
"""The largest share of the records at a min-max-scaled target's 0 (or -1) and at its 1."""

DENOMINATOR, FRACTION_SHARE, FRACTIONS_READ = 100, 0.95, 2000
"""Natural proportions: the largest count ``n`` of a fraction ``k / n``, the share of the values that must be such
fractions, and how many values are read (spread over the target)."""


def _decimal_step(y: Tensor, precision: float) -> float:
    """The coarsest decimal step from 0.01 down to 1e-6 that every value of ``y`` (float64, not all integers) is a
    multiple of to its float ``precision``, or 0.0 (not rounded to one; 0.1 and coarser are not judged)."""
    for e in range(2, 7):
        m = y * 10 ** e
        if bool(((m - m.round()).abs() <= m.abs() * precision * 4 + 1e-9).all()):
            return 10.0 ** -e
    return 0.0


def scaled_target(t: Tensor) -> str:
    """How the target ``t`` was scaled by its own statistics (module docstring), or ""."""
    if not t.dtype.is_floating_point or not (t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1)) \
            or t.shape[0] < MIN_RECORDS:
        return ""
    y = t.detach().reshape(-1).to("cpu", torch.float64)
    y = y[torch.isfinite(y)]
    if len(y) < MIN_RECORDS or bool((y == y.round()).all()) or len(torch.unique(y)) < MIN_DISTINCT:
        return ""
    single = t.dtype != torch.float64
    tol, centred = (1e-4, 1e-5) if single else (1e-6, 1e-9)
    mean, std = float(y.mean()), float(y.std())
    if abs(mean) <= tol and any(abs(float(y.std(correction=c)) - 1) <= tol for c in (0, 1)):
        return "standardised with its own mean and standard deviation"
    step = _decimal_step(y, 2.0 ** -24 if single else 2.0 ** -52)
    if step:  # rounded after it was standardised: within the rounding's own error of mean 0 and deviation 1
        error = ROUNDED_Z * step / math.sqrt(12 * len(y))
        if abs(mean) <= tol + error and any(abs(float(y.std(correction=c)) - math.sqrt(1 + step ** 2 / 12))
                                            <= tol + error for c in (0, 1)):
            return f"standardised with its own mean and standard deviation, then rounded to a step of {step:g}"
    if std > 0 and abs(mean) <= centred * std:
        return "centred on its own mean"
    low, high = float(y.min()), float(y.max())
    most = max(1, int(EDGE_SHARE * len(y)))
    for bottom in (0.0, -1.0):
        if low == bottom and high == 1.0 and int((y == low).sum()) <= most and int((y == high).sum()) <= most \
                and not (bottom == 0.0 and natural_proportions(y, 1e-6 if single else 1e-12)):
            return f"scaled to [{bottom:g}, 1] by its own minimum and maximum"
    return ""


def natural_proportions(y: Tensor, tol: float) -> bool:
    """Whether ``y`` (float64, in [0, 1]) holds fractions ``k / n`` of counts ``n`` ≤ :data:`DENOMINATOR` of their
    own: :data:`FRACTION_SHARE` of the values read within ``tol`` of one, and no common denominator ≤
    :data:`DENOMINATOR` (module docstring)."""
    step = max(1, len(y) // FRACTIONS_READ)
    values = y[::step].tolist()
    denominators = []
    for v in values:
        f = Fraction(v).limit_denominator(DENOMINATOR)
        if abs(v - f.numerator / f.denominator) <= tol:
            denominators.append(f.denominator)
    if len(denominators) < FRACTION_SHARE * len(values):
        return False
    common = 1
    for d in denominators:
        common = common * d // math.gcd(common, d)
        if common > DENOMINATOR:
            return True
    return False
