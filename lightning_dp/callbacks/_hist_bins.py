"""Histogram bin edges for values spanning many orders of magnitude (pure torch).

Under DP, v̂ spans several decades and v̂ − Φ has both signs (bias-correction seed,
Fig. 2): linear bins would put almost everything in one bucket. :func:`histogram_edges`
returns log-spaced edges for one-signed data spanning more than two decades,
"symmetric-log" edges (a central bucket (−a, a), a = 10^-decades · max|x|, and
log-spaced buckets outward on each side that holds data) for data of both signs,
and linear edges otherwise. The report draws them on a symlog axis.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _geometric(start: float, stop: float, n: int) -> Tensor:
    """``n + 1`` log-spaced edges from ``start`` to ``stop`` (both > 0, either order)."""
    return torch.logspace(math.log10(start), math.log10(stop), n + 1, dtype=torch.float64)


def histogram_edges(lo: float, hi: float, bins: int = 64, decades: float = 3.0) -> Tensor:
    """Increasing float64 edges covering ``[lo, hi]`` (the data's min and max) with at most ``bins`` buckets."""
    if bins < 3:
        raise ValueError(f"bins must be >= 3, got {bins}.")
    if not hi > lo:
        width = max(abs(lo), 1.0) * 1e-6
        return torch.tensor([lo - width, hi + width], dtype=torch.float64)
    if lo > 0 or hi < 0:
        small, large = min(abs(lo), abs(hi)), max(abs(lo), abs(hi))
        if large / small <= 100:
            edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
        elif lo > 0:
            edges = _geometric(lo, hi, bins)
        else:
            edges = -_geometric(-lo, -hi, bins)
    else:
        a = max(abs(lo), abs(hi)) * 10.0**-decades
        sides = int(lo < -a) + int(hi > a)
        n = max((bins - 1) // max(sides, 1), 1)
        neg = -_geometric(-lo, a, n) if lo < -a else torch.tensor([-a], dtype=torch.float64)
        pos = _geometric(a, hi, n) if hi > a else torch.tensor([a], dtype=torch.float64)
        edges = torch.cat([neg, pos])
    edges[0], edges[-1] = min(float(edges[0]), lo), max(float(edges[-1]), hi)
    return edges
