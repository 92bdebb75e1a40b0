"""Features projected onto the training set's own principal directions: a PCA or whitening fitted on the records.

``PCA(k).fit_transform(x_train)`` (or ``(x - x.mean(0)) @ V`` with V from an SVD of the training set) centres the
records by their exact mean and rotates them by the exact eigenvectors of their covariance: every output column
depends on every record, no noise covers it, and each example's gradient then depends on all the others.

:func:`decorrelated` finds a training feature tensor whose columns are, to the precision of the arithmetic, all of
mean 0 and mutually uncorrelated: ``|mean_j| ≤ tol · std_j`` and ``|corr(i, j)| ≤ tol`` for every pair, with
``tol = min(1e-4, 0.05 / √N)`` (a float32 PCA reaches 4e-5 on breast cancer, a float64 one 1e-8; raw data's means
and correlations scatter by 1 / √N around their population values, which are rarely 0 at all). At least three
columns must vary, each with at least min(N / 4, 32) distinct values (a balanced ±1 factorial design is also
exactly centred and orthogonal, and is no projection). Data standardised but not rotated keeps its correlations
and is not found here (a standardisation is found by :mod:`.data_statistics`); data merely centred (a column mean
of 0, scikit-learn's diabetes set) is not found either. Features exactly orthogonal by construction — sines and
cosines of whole periods on a regular grid — look the same and would be refused.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MAX_COLUMNS = 1024
"""Wider feature tensors are not judged (their [D, D] correlation would cost more than the rest of the check)."""


def decorrelated(t: Tensor) -> bool:
    """Whether the training feature tensor ``t`` ([N, D] floating point, N ≥ 20) has centred, mutually uncorrelated
    columns (module docstring)."""
    if not t.dtype.is_floating_point or t.dim() != 2 or t.shape[0] < 20 or not 3 <= t.shape[1] <= MAX_COLUMNS \
            or t.shape[0] * t.shape[1] ** 2 > 4e9:
        return False
    x = t.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(x).all()):
        return False
    n = x.shape[0]
    std = x.std(0)
    varying = std > 0
    x, std = x[:, varying], std[varying]
    if x.shape[1] < 3:
        return False
    tol = min(1e-4, 0.05 / math.sqrt(n))
    mean = x.mean(0)
    if not bool((mean.abs() <= tol * std).all()):
        return False
    distinct = (x.sort(0).values.diff(dim=0) != 0).sum(0) + 1
    if not bool((distinct >= min(n / 4, 32)).all()):
        return False
    centred = x - mean
    corr = (centred.T @ centred) / (n - 1) / (std[:, None] * std[None, :])
    corr.fill_diagonal_(0)
    return bool((corr.abs() <= tol).all())


def decorrelated_fix() -> str:
    """The fix a refusal of projected features names."""
    return ("Project features on a public basis (directions computed from public data, a fixed random projection) "
            "or train on the features themselves; lightning_dp provides no DP-PCA (a private projection must be "
            "estimated by a DP mechanism of your own, its ε accounted for).")
