"""Class-conditional statistics of the training features held by the model: class means stacked into a prototype or
nearest-class-mean head (``torch.stack([x[y == c].mean(0) for c in classes])``), per-class standard deviations or
variances (a Gaussian naive Bayes layer), one class's mean kept alone.

The labels are an integer 1-D training tensor of the same length as the features (2 to 1,000 classes, none
negative). A candidate matches when one of its rows (of a [D] vector, or of a [r, D] or [D, r] matrix) equals one
class's row of a statistic to a relative 1e-4 in every entry; a statistic row constant throughout or with fewer than
two entries other than 0 and 1 (a class of one-hot features) never matches. A random row matches a class's D ≥ 2
entries with probability about (2e-4) ** D. The statistics are computed once per pair of tensors, when a candidate
of the features' width is held (one pass over the data).
"""

from __future__ import annotations

import torch
from torch import Tensor

_RTOL, _ATOL = 1e-4, 1e-6


def class_conditional(features: Tensor, labels: Tensor) -> list[tuple[str, Tensor]]:
    """The per-class mean, standard deviation and variance (corrections 0 and 1) of ``features``' flattened columns,
    each [K, D], for the classes ``labels`` holds; none when ``labels`` is not a class label tensor for them."""
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.dim() != 1 \
            or len(labels) != len(features) or len(labels) < 2 or int(labels.min()) < 0 or int(labels.max()) >= 1000:
        return []
    x = features.detach().reshape(len(features), -1).to("cpu", torch.float64)
    y = labels.detach().to(torch.int64).cpu()
    keep = torch.isfinite(x).all(1)
    x, y = x[keep], y[keep]
    counts = torch.bincount(y).to(torch.float64)
    if (counts > 0).sum() < 2:
        return []
    means = torch.zeros(len(counts), x.shape[1], dtype=torch.float64).index_add_(0, y, x) / counts[:, None]
    squares = torch.zeros_like(means).index_add_(0, y, (x - means[y]) ** 2)
    out = [("class means", means)]
    for correction in (0, 1):
        var = squares / (counts[:, None] - correction)
        out += [("per-class standard deviations", var.sqrt()), ("per-class variances", var)]
    return out


def conditional_rows(candidate: Tensor, stats: list[tuple[str, Tensor]]) -> str:
    """The class-conditional statistic a row of ``candidate`` equals one class's row of, or ""."""
    if not stats:
        return ""
    c = candidate.detach().to("cpu", torch.float64)
    d = stats[0][1].shape[1]
    forms = [c.reshape(1, d)] if c.numel() == d else \
        [r for r, fits in ((c, c.dim() == 2 and c.shape[1] == d), (c.T, c.dim() == 2 and c.shape[0] == d)) if fits]
    for rows in forms:
        rows = rows[:1 << 14]
        for name, stat in stats:
            trivial = (stat.abs() <= _ATOL) | ((stat - 1).abs() <= _RTOL + _ATOL)
            telling = torch.isfinite(stat).all(1) & ((~trivial).sum(1) >= 2) & (stat.amax(1) > stat.amin(1))
            stat = stat[telling]
            for chunk in rows.split(max(1, (1 << 22) // max(1, stat.numel()))):
                close = (chunk[:, None, :] - stat[None]).abs() <= _ATOL + _RTOL * stat.abs()[None]
                if len(stat) and bool(close.all(2).any()):
                    return name
    return ""
