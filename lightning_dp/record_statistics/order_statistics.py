"""Per-feature order statistics of a training tensor held by the model: a minimum and maximum (a min-max scaler inside
the model), a median and interquartile range (``RobustScaler``), quantile bin edges (``torch.quantile(x, levels,
dim=0)``), or any vector whose entries are values of their own columns.

One sort per feature tensor (:class:`OrderStatistics`) answers, for each row of a candidate (a [D] vector, or the
rows of a [m, D] or [D, m] matrix: one quantile level per row), three questions, vectorised:

* **a quantile row**: is there one level p at which every entry is its column's p-quantile, under any of
  ``torch.quantile``'s interpolations (linear, lower, higher, midpoint, nearest; NumPy's are the same)? Each entry is
  inverted into the interval of fractional ranks it can stand for (a value within 4 float32 ulps, its ties, and one
  rank either side for lower/higher/nearest; a midpoint of two neighbours, the rank between them); the row is one
  when the intervals meet. Any level is seen, not only a grid: minimum, maximum, median, quartiles, deciles,
  percentiles, ``linspace`` edges. Rows need 2 entries other than 0 and 1 and not all equal. On a continuous column
  a value stands for a rank interval about 8 ulps / range wide, so a random row meets at one level with probability
  about (1e-6) ** (D - 1). On integer-valued columns (counts, pixels, one-hot) every integer in range is some
  quantile: they must agree with the level, but only the minimum and maximum are taken on their evidence alone;
  other levels need two continuous columns' entries.
* **a difference of two quantiles** (an interquartile or inter-percentile range, the range max − min): entries all
  positive, two of them in continuous columns, equal to within 8 ulps of the quantiles' magnitude to Q(1 − p) − Q(p)
  for one p of the grid k/m (m ≤ 100, p < 1/2: 1,522 levels, each under the five interpolations), computed once per
  feature tensor.
* **exact data values** (in a [D] vector that is not a record,
  :func:`~lightning_dp.records.held_records.holds_records`): most (more than half, and at least two) of the entries
  other than 0 and 1 equal, to one float32 ulp, a value of their own column. Only continuous columns count (more
  than two distinct values, not all integers), and only a match
  whose chance is below 1e-12: a column's chance q of matching a value drawn like the data is estimated from its
  values' ulps over its range, and the matched columns' q multiply. For 100,000 standard-normal float32 records q
  is about 2e-3, so a random vector must match in at least 5 columns; a column so dense that q > 1e-2 (about
  400,000 such records) is not counted.

Differences are sought for at most 1,024 features.

Cost: one sort of the feature tensor (shared with the scaled-by-itself check's quartiles), the grid of differences
when a positive candidate row first asks, and a binary search per candidate entry.
"""

from __future__ import annotations

from fractions import Fraction

import torch
from torch import Tensor

_ULP = 2.0 ** -23  # float32's relative precision: statistics are computed in float32 as often as not
_MAX_ROWS = 1 << 14


def _grid() -> Tensor:
    """The levels k/m < 1/2 for 1 ≤ m ≤ 100, once."""
    return torch.tensor(sorted({float(Fraction(k, m)) for m in range(1, 101) for k in range(0, (m + 1) // 2)}),
                        dtype=torch.float64)


class OrderStatistics:
    """The sorted columns of one training feature tensor ([N, ...] flattened to [N, D]; rows with a missing value
    left out) and what follows from them once."""

    def __init__(self, t: Tensor) -> None:
        x = t.detach().reshape(t.shape[0], -1).cpu()
        x = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        x = x[torch.isfinite(x).all(1)]
        x = x if len(x) >= 2 else torch.zeros(2, x.shape[1], dtype=x.dtype)  # nothing to compare: constant
        self.n, self.width = x.shape
        self.sorted = x.T.contiguous().sort(1).values  # [D, n]
        s = self.sorted.to(torch.float64)
        span = s[:, -1] - s[:, 0]
        distinct = (s[:, 1:] != s[:, :-1]).sum(1) + 1
        self.integral = (s == s.round()).all(1) | (distinct <= 2)
        # chance that a value drawn like the data lands within an ulp of one of the column's values
        self.chance = torch.where(span > 0, 2 * _ULP * s.abs().sum(1) / span.clamp_min(1e-300), torch.ones_like(span))
        self.chance = torch.where(self.integral, torch.ones_like(span), self.chance.clamp(max=1.0))
        self._spreads: Tensor | None = None

    def quantile(self, p: float) -> Tensor:
        """Each column's ``p``-quantile, linearly interpolated (``torch.quantile``'s default), [D] in float64."""
        h = p * (self.n - 1)
        i = min(int(h), self.n - 2)
        below, above = self.sorted[:, i].to(torch.float64), self.sorted[:, i + 1].to(torch.float64)
        return below + (h - i) * (above - below)

    def held(self, candidate: Tensor) -> str:
        """What ``candidate``'s rows are (a per-feature minimum, maximum, median or quantile; a difference of two
        quantiles; exact training values), or ""."""
        c = candidate.detach().to("cpu", torch.float64)
        d = self.width
        if self.n < 2 or d < 2:
            return ""
        forms = [c.reshape(1, d)] if c.numel() == d else \
            [r for r, fits in ((c, c.dim() == 2 and c.shape[1] == d), (c.T, c.dim() == 2 and c.shape[0] == d)) if fits]
        for rows in forms:
            rows = rows[:_MAX_ROWS]
            trivial = (rows.abs() <= 1e-6) | ((rows - 1).abs() <= 1e-4)
            keep = ((~trivial).sum(1) >= 2) & (rows.amax(1) > rows.amin(1)) & torch.isfinite(rows).all(1)
            rows, trivial = rows[keep], trivial[keep]
            if not len(rows):
                continue
            telling = ((~self.integral)[:, None] & ~trivial.T).sum(0) >= 2  # evidence from continuous columns
            what = self._levels(rows, telling) or self._spread(rows[telling]) \
                or (self._exact(rows, trivial) if c.numel() == d else "")  # a vector: a table of records is not one
            if what:
                return what
        return ""

    def _ranks(self, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per entry of ``v`` ([D, r]): the interval of fractional ranks it can stand for, and whether it is a value
        of its column (to 1 ulp)."""
        s = self.sorted
        tol = 4 * _ULP * v.abs() + 1e-300

        def rank(u: Tensor) -> Tensor:
            i = (torch.searchsorted(s, u.to(s.dtype).contiguous(), right=True) - 1).clamp(0, self.n - 2)
            lo, hi = s.gather(1, i).to(torch.float64), s.gather(1, i + 1).to(torch.float64)
            frac = torch.where(hi > lo, (u - lo) / (hi - lo), torch.zeros_like(u))
            return (i + frac.clamp(0, 1)).to(torch.float64)

        low, high = rank(v - tol), rank(v + tol)
        inside = (v + tol >= s[:, :1].to(torch.float64)) & (v - tol <= s[:, -1:].to(torch.float64))
        exact = inside & (rank(v + _ULP * v.abs()).floor() >= rank(v - _ULP * v.abs()).ceil())
        low = torch.where(exact, low.ceil() - 1, low)  # lower / higher / nearest: a rank either side of the ties
        high = torch.where(exact, high.floor() + 1, high)
        k = low.floor().clamp(0, self.n - 2).long()
        mid = (s.gather(1, k).to(torch.float64) + s.gather(1, k + 1).to(torch.float64)) / 2
        midpoint = inside & ~exact & ((v - mid).abs() <= tol)
        low, high = torch.where(midpoint, k.double(), low), torch.where(midpoint, k.double() + 1, high)
        empty = torch.full_like(low, float("nan"))
        return torch.where(inside, low, empty), torch.where(inside, high, empty), exact

    def _levels(self, rows: Tensor, telling: Tensor) -> str:
        low, high, _ = self._ranks(rows.T)
        meets = torch.isfinite(low).all(0) & (low.amax(0) <= high.amin(0))
        # integer-valued columns: every integer in range is some quantile; only the extremes are telling there
        ends = (low.amax(0) <= 0) | (high.amin(0) >= self.n - 1)
        meets &= ends | telling
        if not bool(meets.any()):
            return ""
        middle, names = (self.n - 1) / 2, []
        for bottom, top in zip(low.amax(0)[meets].tolist(), high.amin(0)[meets].tolist()):
            name = "minimum" if bottom <= 0 else "maximum" if top >= self.n - 1 else \
                "median" if bottom <= middle <= top else "quantiles"
            names += [name] if name not in names else []
        return "the per-feature " + (" and ".join(names) if len(names) <= 2 else "quantiles (rows at quantile levels)")

    def _spread(self, rows: Tensor) -> str:
        rows = rows[(rows > 0).all(1)][:256]
        if not len(rows) or self.width > 1024:
            return ""
        if self._spreads is None:
            s, p = self.sorted.T.to(torch.float64), _grid()  # [n, D]
            diffs = []
            for h in (p * (self.n - 1), (1 - p) * (self.n - 1)):
                fl, ce, near = h.floor().long(), h.ceil().long(), h.round().long()
                a, b = s[fl], s[ce]
                diffs.append(torch.stack([a + (h - fl)[:, None] * (b - a), a, b, (a + b) / 2, s[near]]))
            self._spreads = torch.stack([(diffs[1] - diffs[0]).reshape(-1, self.width),
                                         (diffs[1].abs() + diffs[0].abs()).reshape(-1, self.width) * 8 * _ULP])
        spreads, tol = self._spreads
        for row in rows:
            if bool(((row - spreads).abs() <= tol + 1e-300).all(1).any()):
                return "the per-feature difference of two quantiles (a range or interquartile range)"
        return ""

    def _exact(self, rows: Tensor, trivial: Tensor) -> str:
        _, _, exact = self._ranks(rows.T)
        usable = (~self.integral & (self.chance <= 1e-2))[:, None] & ~trivial.T
        matched = exact & usable
        count, out_of = matched.sum(0), (~trivial.T).sum(0)
        chance = torch.where(matched, self.chance[:, None].log10(), torch.zeros_like(rows.T)).sum(0)
        if bool(((count >= 2) & (2 * count > out_of) & (chance <= -12)).any()):
            return "exact per-feature values"
        return ""
