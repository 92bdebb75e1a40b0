"""Second moments of the training features held by the model as a [D, D] matrix: a whitening layer (ZCA, PCA or
Cholesky whitening, ``U diag(s + eps)^-1/2 Uᵀ``), a covariance or correlation matrix, its inverse (a Mahalanobis
distance's precision), a Cholesky factor or square root.

For M each of the training features' covariance (centred; any normalisation n or n − 1 is a scale), uncentred second
moment xᵀx / n and correlation, a candidate W is one when, up to a positive scale c, W M Wᵀ or Wᵀ M W is c·I (a
whitening matrix of any kind, used as W x or as x W), W Wᵀ or Wᵀ W is c·M (a Cholesky factor or square root), W is
c·M, or W M is c·I (the inverse). The tolerance is relative to the largest entry, min(1e-3, 0.05 / sqrt(n)) but at
least 1e-5: far below the sampling error 1 / sqrt(n) by which data standardised publicly (Σ ≈ I) lets an orthogonal
or identity matrix pass for a whitening one, and above the eps regularisation (1e-5 of eigenvalues near 1) and float32
error. 2 ≤ D ≤ 1024; the moments are computed once per feature tensor, when a candidate of its width is held
(N·D² operations: about 0.1 s for 100,000 × 64).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class SecondMoments:
    """The covariance, uncentred second moment and correlation of one training feature tensor ([N, ...] flattened
    to [N, D]; rows with a missing value left out)."""

    def __init__(self, t: Tensor) -> None:
        x = t.detach().reshape(t.shape[0], -1).to("cpu", torch.float64)
        x = x[torch.isfinite(x).all(1)]
        n = max(x.shape[0], 1)
        centred = x - x.mean(0)
        cov, second = centred.T @ centred / n, x.T @ x / n
        scale = cov.diagonal().clamp_min(1e-300).sqrt()
        self.moments = [("covariance", cov), ("uncentred second moment", second),
                        ("correlation", cov / scale[:, None] / scale[None, :])]
        self.tol = max(1e-5, min(1e-3, 0.05 / math.sqrt(n)))
        self.usable = x.shape[0] > x.shape[1]

    def held(self, candidate: Tensor) -> str:
        """What the square ``candidate`` is to these moments (a whitening matrix, a factor, the moment itself or its
        inverse), or ""."""
        w = candidate.detach().to("cpu", torch.float64)
        if not self.usable or w.dim() != 2 or w.shape[0] != w.shape[1] or not bool(torch.isfinite(w).all()):
            return ""
        eye = torch.eye(w.shape[0], dtype=torch.float64)
        for name, m in self.moments:
            checks = [("a whitening matrix", lambda k: w[:k] @ m @ w.T, eye),  # noqa: B023 (used in this loop)
                      ("a whitening matrix", lambda k: w.T[:k] @ m @ w, eye),  # noqa: B023
                      ("a Cholesky factor or square root", lambda k: w[:k] @ w.T, m),  # noqa: B023
                      ("a Cholesky factor or square root", lambda k: w.T[:k] @ w, m),  # noqa: B023
                      ("", lambda k: w[:k], m), ("the inverse", lambda k: w[:k] @ m, eye)]  # noqa: B023
            for what, rows, b in checks:  # 16 rows first: a full product only for a candidate that passes them
                if _proportional(rows(16), b[:16], self.tol) and _proportional(rows(len(w)), b, self.tol):
                    return f"{what} of the {name}" if what else f"the {name}"
        return ""

def _proportional(a: Tensor, b: Tensor, tol: float) -> bool:
    """Whether ``a`` is c·``b`` for some c > 0, to ``tol`` of its largest entry."""
    c = float((a * b).sum() / (b * b).sum().clamp_min(1e-300))
    if not c > 0 or not math.isfinite(c):
        return False
    return bool(((a - c * b).abs().amax() <= tol * (c * b).abs().amax()))
