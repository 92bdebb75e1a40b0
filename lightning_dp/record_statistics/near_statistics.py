"""Statistics of the training data kept after a transformation that keeps them close: rounded, of a subsample, of
a superset of the training rows.

``self.mean = x.mean(0).round(decimals=3)`` (or ``round(v, 3)`` per column, ``np.round``), the mean of a random half
of the training rows (``x[torch.randperm(n)[: n // 2]].mean(0)``) or of the training and validation rows together
(``torch.cat([x_train, x_val]).mean(0)``) equal no statistic of the training tensor to float precision, so
:mod:`.data_statistics`' equalities do not see them; yet they depend on every (or every other) training record and
no noise covers them. What they keep is *closeness*: in every column the held value sits within a rounding step or a
sampling error (about σ_j / √N) of the exact statistic, across many columns at once — closer than a vector written
by hand or taken from other data comes but with negligible probability.

:class:`NearStatistics` measures that, for a held vector c of width D ≥ 2 (a [D] vector, or a row or column of a
[m, D] or [D, m] matrix, m ≤ 4) and each statistic s of a training feature tensor of width D — per-feature (and for
images per-channel) mean, standard deviation (either convention), variance, and for continuous columns median,
minimum and maximum:

* each column's **closeness** q_j = min(1, max(2·|c_j − s_j|, h_j) / w_j), where w_j is the column's spread (its
  standard deviation, or its interquartile range / 1.349 where smaller: a heavy tail does not widen it; squared for a
  variance) and h_j the decimal step c_j is written with (the coarsest 10^e, e from 6 to −12, of which c_j is a
  multiple to its float precision: 0.485 → 0.001, 0.5 → 0.1, 255 → 1, 0 → 10⁶): a number written with few digits
  is only as close as its step, whatever the statistic. w_j is at most the candidate's own scale τ (the root mean
  square of c − a for the nearest of a = 0, 1, −1): an initialisation of scale τ around zeros or ones is as likely
  anywhere within τ of them, so it comes close to a centred or unit column's statistic by its own values (a
  vector of means of centred data — scikit-learn's diabetes — carries no evidence);
* the **chance** that a vector not computed from the data comes this close: if, in each column independently, such a
  value falls within a window of width t around s_j with probability at most t / w_j (its density near the statistic
  no higher than one over the column's spread), then at least k of the D columns reach closeness q with probability
  at most C(D, k)·q^k. With q_(k) the k-th smallest closeness, the chance is taken as
  K · min over k of C(D, k)·q_(k)^k, for k from max(2, ⌈D/2⌉) to D (K: how many k are tried, a union bound) — at
  least half of the columns must be close ("almost all" for a subsample, whose every column is);
* a vector is refused when that chance is at most :data:`ALPHA` (1e-9) for one statistic: below 1e-6 over the
  thousand comparisons a large model's parameters make.

What it finds (measured, 20 draws each, on standard normal columns away from 0 and ±1): the mean and deviation
rounded to 3 decimals in 4 columns of unit spread or more; a random half's mean (|c_j − s_j| ≈ σ_j/√N) at N = 2,048
and 16 columns or N = 10,000 and 8; a tenth's (three times farther) at N = 2,048 and 32 columns or N = 100,000 and 8;
a training-plus-validation mean (a quarter more rows) at N = 2,048 and 32 columns; on scikit-learn's digits (1,797
× 64) a half's and a tenth's mean, on breast cancer (569 × 30) a half's. Not refused (digits, breast cancer, wine,
diabetes and iris): 0 of 4,000 vectors not computed from the data (1,000 each: a linear layer's rows, N(0, 0.001²)
around zeros and around ones, draws uniform within the columns' ranges) and 0 of 1,600 other datasets' column
statistics, rounded or not; zeros,
ones and values of one significant digit; the :data:`PUBLISHED` constants (ImageNet's (0.485, 0.456, 0.406) /
(0.229, 0.224, 0.225), CIFAR's), and a release of a DP mechanism the fit's ledger was charged, also rounded.

Not seen, and not separable by any such rule: a single number (D = 1: a rounded scalar mean such as MNIST's 0.1307
is as likely a constant written by hand, whatever the data), a vector of few columns or few records (the sampling
error of N records spans 1/√N of each column's spread: a subsample of 64 records' mean is as close as chance
allows), and a vector rounded coarsely relative to the columns' spread. Conversely, a statistic of *another sample of
the same population* (a public split, a published census mean) is as close to the training statistic as a subsample
of the training rows is, and is refused the same way: declare such a value public
(``DPStrategy(public_state=[name])``) when it was not computed from this training data.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

ALPHA = 1e-9
"""The largest chance of a held vector's closeness to a statistic, for one comparison, that is refused."""

MAX_ROWS = 4
"""Rows (or columns) of a held matrix compared, each as a vector: a [2, D] stack of a mean and a deviation."""

_STEPS = [10.0 ** e for e in range(6, -13, -1)]


class NearStatistics:
    """The statistics of the training feature tensors ``tensors`` ((path, tensor), [N, D, ...]; ``order(t)``: the
    shared :class:`~.order_statistics.OrderStatistics` of one), computed for a width when a candidate of that width is
    first held."""

    def __init__(self, tensors: Sequence[tuple[str, Tensor]], order: Any) -> None:
        self.tensors = [(p, t) for p, t in tensors if t.dtype.is_floating_point and t.dim() >= 2 and t.shape[0] > 2]
        self.order = order
        self.summaries: dict[int, list[tuple[str, str, Tensor, Tensor]]] = {}

    def held(self, candidate: Tensor, paths: Any = None,
             released: Sequence[Tensor] = ()) -> list[tuple[str, str, float]]:
        """(tensor path, statistic, chance) for a statistic of a training tensor (of those whose path is in
        ``paths``; ``None``: any) that ``candidate`` holds within a rounding or sampling error (module docstring);
        at most one: the first in the order mean, standard deviation, variance, median, minimum, maximum. A vector
        that is one of ``released`` (a DP release the fit's ledger was charged, :mod:`.released_statistics`) rounded
        to its own digits, or a published constant, is not compared."""
        for row in _vectors(candidate):
            if published(row) or any(_rounded(row, r) for r in released):
                continue
            for path, name, stat, spread in self._summaries(row.numel()):
                if paths is not None and path not in paths:
                    continue
                chance = closeness_chance(row, stat, spread)
                if chance <= ALPHA:
                    return [(path, name, chance)]
        return []

    def _summaries(self, width: int) -> list[tuple[str, str, Tensor, Tensor]]:
        if width < 2:
            return []
        if width not in self.summaries:
            self.summaries[width] = [s for p, t in self.tensors for s in self._of(p, t, width)]
        return self.summaries[width]

    def _of(self, path: str, t: Tensor, width: int) -> Iterator[tuple[str, str, Tensor, Tensor]]:
        with torch.no_grad():
            if t[0].numel() == width:
                order = self.order(t)
                x = order.sorted.to(torch.float64)  # [D, n], rows with a missing value left out
                if x.shape[1] < 3:
                    return
                std0, std1 = x.std(1, correction=0), x.std(1, correction=1)
                iqr = order.quantile(0.75) - order.quantile(0.25)
                spread = torch.where(iqr > 0, torch.minimum(std1, iqr / 1.349), std1)
                yield path, "per-feature mean", x.mean(1), spread
                for correction, std in ((0, std0), (1, std1)):
                    yield path, "per-feature standard deviation", std, spread
                    yield path, "per-feature variance", std.square(), spread.square()
                continuous = ~order.integral  # an integer column's order statistics are as likely public ends
                for name, value in (("median", order.quantile(0.5)), ("minimum", x[:, 0]), ("maximum", x[:, -1])):
                    yield path, f"per-feature {name}", value, torch.where(continuous, spread, torch.zeros_like(spread))
            if t.dim() >= 3 and t.shape[1] == width:  # [N, C, ...]: per channel
                x = t.detach().to("cpu", torch.float64).transpose(0, 1).reshape(width, -1)
                x = x[:, torch.isfinite(x).all(0)]
                if x.shape[1] < 3:
                    return
                spread = x.std(1)
                yield path, "per-channel mean", x.mean(1), spread
                for correction in (0, 1):
                    yield path, "per-channel standard deviation", x.std(1, correction=correction), spread


PUBLISHED = (
    (0.485, 0.456, 0.406), (0.229, 0.224, 0.225),  # ImageNet (torchvision's models)
    (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), (0.2023, 0.1994, 0.2010),  # CIFAR-10 (the last: a common one)
    (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),  # CIFAR-100
    (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970),  # SVHN
    (0.5, 0.5, 0.5), (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711),  # CLIP's
)
"""Normalisation constants published with well-known image datasets and models, never refused: as public as the
datasets they describe. (Where the training data *is* that dataset, they are its rounded statistics — public by their
publication.)"""


def published(row: Tensor) -> bool:
    """Whether ``row`` is one of :data:`PUBLISHED`'s vectors, to 1e-4 relative (its order kept, or reversed for BGR)."""
    c = row.detach().to("cpu", torch.float64).reshape(-1)
    return c.numel() == 3 and any(torch.allclose(c, torch.tensor(v, dtype=torch.float64), rtol=1e-4, atol=0)
                                  or torch.allclose(c.flip(0), torch.tensor(v, dtype=torch.float64), rtol=1e-4, atol=0)
                                  for v in PUBLISHED)


def closeness_chance(candidate: Tensor, stat: Tensor, spread: Tensor) -> float:
    """The chance bound of the module docstring: how likely a vector not computed from the data comes as close to
    ``stat`` as ``candidate`` does, column by column, given the columns' ``spread`` (1.0: no evidence)."""
    c = candidate.detach().to("cpu", torch.float64).reshape(-1)
    s, w = stat.to(torch.float64).reshape(-1), spread.to(torch.float64).reshape(-1)
    if c.numel() != s.numel() or c.numel() < 2 or bool((s == s[0]).all()) or bool((c == c[0]).all()):
        return 1.0  # a constant vector says nothing of the data, and no constant statistic of it
    step = decimal_step(c, _precision(candidate))
    scale = min(float((c - a).square().mean().sqrt()) for a in (0.0, 1.0, -1.0))
    w = w.clamp(max=scale)  # a vector of values near 0 or ±1 (an initialisation): as likely anywhere that near
    q = torch.maximum(2 * (c - s).abs(), step) / w
    q = torch.where(~(w > 0) | ~torch.isfinite(q), torch.ones_like(q), q.clamp(max=1.0))
    d = len(q)
    ordered = q.sort().values
    levels = range(max(2, math.ceil(d / 2)), d + 1)
    logs = [math.lgamma(d + 1) - math.lgamma(k + 1) - math.lgamma(d - k + 1)
            + k * math.log(max(float(ordered[k - 1]), 1e-300)) for k in levels]
    return min(1.0, len(levels) * math.exp(min(logs)))


def decimal_step(c: Tensor, precision: float) -> Tensor:
    """Per entry of ``c`` (float64), the coarsest power of ten 10^e (e from 6 down to −12) it is a multiple of to its
    ``precision`` (relative: 2⁻²⁴ for float32 values), or its own resolution where none is coarser: the step of the
    digits it is written with."""
    resolution = c.abs() * precision * 4
    step = resolution.clone()
    found = torch.zeros_like(c, dtype=torch.bool)
    for unit in _STEPS:
        m = c / unit
        on = (m - m.round()).abs() <= m.abs() * precision * 4 + 1e-9
        new = on & ~found & (unit > resolution)
        step = torch.where(new, torch.full_like(c, unit), step)
        found |= new
    return step


def _rounded(row: Tensor, release: Tensor) -> bool:
    """Whether ``row`` is ``release`` rounded to the digits ``row`` is written with (or equal to float32 precision)."""
    c = row.detach().to("cpu", torch.float64).reshape(-1)
    if c.numel() != release.numel():
        return False
    step = decimal_step(c, _precision(row))
    return bool(((c - release).abs() <= step / 2 + 1e-6 * release.abs() + 1e-12).all())


def _precision(candidate: Tensor) -> float:
    """The relative precision a held vector's values were written to: float32's for float32 (and lower) tensors and
    for float64 ones whose every value is a float32 (``x.mean(0).tolist()``), float64's otherwise."""
    if candidate.dtype == torch.float64:
        c = candidate.detach().cpu()
        return 2.0 ** -24 if bool((c.float().double() == c).all()) else 2.0 ** -52
    if candidate.dtype in (torch.float16, torch.bfloat16):
        return float(torch.finfo(candidate.dtype).eps) / 2
    return 2.0 ** -24


def _vectors(candidate: Tensor) -> Iterator[Tensor]:
    """The vectors a held value stands for: itself ([D]), or the rows and columns of a small matrix."""
    if not candidate.dtype.is_floating_point and candidate.dtype not in (torch.int32, torch.int64):
        return
    if candidate.dim() <= 1 or candidate.numel() == max(candidate.shape):
        yield candidate.reshape(-1)
    elif candidate.dim() == 2:
        if candidate.shape[0] <= MAX_ROWS:
            yield from candidate
        if candidate.shape[1] <= MAX_ROWS:
            yield from candidate.T
