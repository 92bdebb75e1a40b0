"""Coefficients of a banded lower-triangular Toeplitz strategy matrix C (DP-MF, docs/algorithms.md §7).

A b-banded Toeplitz strategy is given by b numbers c_0..c_{b-1}: C[t, s] = c_{t-s} for
0 ≤ t - s < b, else 0. The noise added to the gradient of step t is row t of C⁻¹ z
(scaled by σ·sens·C_clip, see :mod:`lightning_dp.privacy.banded_noise`), so the noise
in the *prefix sums* Σ_{s≤t} ĝ_s — the model of SGD with a constant learning rate — is
A C⁻¹ z with A the lower-triangular all-ones matrix (design-principles §4.5).

Two documented ways to choose c:

1. :func:`fichtenberger_coefficients` (the default): the Toeplitz square root of the
   prefix-sum matrix, A = C·C with c_j = binom(2j, j) / 4^j (Fichtenberger, Henzinger &
   Upadhyay 2023, "Constant matters"), truncated to the first b coefficients. Closed form,
   no optimisation, independent of the run length.
2. :func:`optimize_banded_coefficients`: minimise the mean prefix-sum error
   :func:`prefix_sum_error` over all b-banded Toeplitz strategies for a run of n steps
   (the "RMSE" objective of the DP-MF literature, design-principles §4.5), starting from (1).
   L-BFGS with an exact gradient (derived below); c_0 is fixed to 1 since the objective is
   scale-invariant.

Both are normalised so that c_0 = 1; the mechanism divides by the column norm itself.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from scipy.optimize import minimize
from scipy.signal import fftconvolve, lfilter


def check_coefficients(coefficients: Sequence[float]) -> np.ndarray:
    """Return ``coefficients`` as a float64 vector; ``ValueError`` unless finite, non-empty, c_0 > 0
    and the inverse C⁻¹ is stable (see :func:`is_stable`)."""
    c = np.asarray(coefficients, dtype=np.float64).reshape(-1)
    if c.size == 0 or not np.all(np.isfinite(c)):
        raise ValueError(f"coefficients must be a non-empty vector of finite numbers, got {coefficients!r}")
    if c[0] <= 0:
        raise ValueError(f"the leading coefficient c_0 must be > 0 (C must be invertible), got {c[0]!r}")
    if not is_stable(c):
        raise ValueError(
            "these coefficients give an unstable C⁻¹ (the polynomial Σ c_j x^j has a root with |x| ≤ 1), so the "
            "streamed noise would grow without bound; use fichtenberger_coefficients(bands) or "
            "optimize_banded_coefficients(bands, steps)"
        )
    return c


def is_stable(coefficients: Sequence[float]) -> bool:
    """Whether the recursion w_t = (z_t − Σ_{j≥1} c_j w_{t−j}) / c_0 stays bounded.

    The recursion is the IIR filter 1 / c(x), c(x) = Σ_j c_j x^j; it is stable iff every
    root of c(x) lies strictly outside the unit disk. Positive, strictly decreasing
    coefficients (e.g. Fichtenberger's) always qualify (Eneström–Kakeya theorem).
    """
    c = np.trim_zeros(np.asarray(coefficients, dtype=np.float64), "b")
    if c.size <= 1:
        return bool(c.size == 1 and c[0] != 0)
    roots = np.roots(c[::-1])  # np.roots wants the highest degree first
    return bool(np.all(np.abs(roots) > 1.0 + 1e-9))


def fichtenberger_coefficients(bands: int) -> np.ndarray:
    """c_j = binom(2j, j) / 4^j for j < ``bands`` (1, 1/2, 3/8, 5/16, …).

    The Toeplitz square root of the prefix-sum matrix (C·C = A), truncated to b bands
    (docs/algorithms.md §7; Fichtenberger et al. 2023). Computed as the running product
    c_j = c_{j−1} · (2j − 1) / (2j), exact to rounding.
    """
    bands = check_bands(bands)
    j = np.arange(1, bands, dtype=np.float64)
    return np.concatenate(([1.0], np.cumprod((2.0 * j - 1.0) / (2.0 * j))))


def check_bands(bands: int) -> int:
    """Return ``bands`` as an int; ``ValueError`` unless it is a whole number ≥ 1."""
    if isinstance(bands, bool) or not isinstance(bands, (int, np.integer)) or bands < 1:
        raise ValueError(f"bands must be a whole number >= 1 (1 = independent noise), got {bands!r}")
    return int(bands)


def inverse_coefficients(coefficients: Sequence[float], n: int) -> np.ndarray:
    """First column r_0..r_{n−1} of C⁻¹ (C⁻¹ is lower-triangular Toeplitz too).

    r is the impulse response of the recursion of :func:`is_stable`:
    r_0 = 1/c_0, r_k = −(Σ_{j=1}^{min(k, b−1)} c_j r_{k−j}) / c_0.
    """
    c = np.asarray(coefficients, dtype=np.float64)
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return lfilter([1.0], c, impulse)


def column_norm(coefficients: Sequence[float]) -> float:
    """‖c‖₂, the largest column norm of the b-banded Toeplitz C (for n ≥ b steps).

    Column s of C holds c_0..c_{b−1} in rows s..s+b−1 (fewer in the last b−1 columns),
    so every column norm is at most ‖c‖₂: the single-participation sensitivity.
    """
    c = np.asarray(coefficients, dtype=np.float64)
    return float(math.sqrt(float(c @ c)))


def prefix_sum_error(coefficients: Sequence[float], n: int) -> float:
    """Mean variance of the prefix-sum noise, (1/n)·sens²·‖A C⁻¹‖_F², for unit σ·C_clip.

    The noise of the prefix sum at step t is Σ_{s≤t} (sens·C⁻¹z)_s with sens = ‖c‖₂
    (design-principles §4.5; docs/algorithms.md §7). A C⁻¹ is lower-triangular Toeplitz with
    coefficients s_k = Σ_{i≤k} r_i (r from :func:`inverse_coefficients`), hence
    ‖A C⁻¹‖_F² = Σ_k (n − k) s_k². Independent noise (c = [1]) gives (n + 1)/2.
    """
    c = np.asarray(coefficients, dtype=np.float64)
    s = np.cumsum(inverse_coefficients(c, n))
    weights = n - np.arange(n, dtype=np.float64)
    return float((c @ c) * np.sum(weights * s * s) / n)


_DIVERGED = 1e100


def _error_and_gradient(tail: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """prefix_sum_error of c = [1, tail] and its gradient in ``tail``.

    With E = ‖c‖² · Q(r) / n, Q = Σ_k w_k s_k², s = cumsum(r), r = impulse response of 1/c(x):
    ∂Q/∂r_i = Σ_{k≥i} 2 w_k s_k, and since ∂(1/c(x))/∂c_j = −x^j / c(x)²,
    ∂r_k/∂c_j = −(r∗r)_{k−j}.
    """
    c = np.concatenate(([1.0], tail))
    with np.errstate(all="ignore"):
        r = inverse_coefficients(c, n)
        s = np.cumsum(r)
    if not (np.all(np.isfinite(s)) and np.max(np.abs(s)) < _DIVERGED):
        return _DIVERGED, np.zeros_like(tail)  # an unstable trial point: make the line search step back
    weights = n - np.arange(n, dtype=np.float64)
    q = float(np.sum(weights * s * s))
    dq_dr = np.cumsum((2.0 * weights * s)[::-1])[::-1]
    rr = fftconvolve(r, r)[:n]
    dq_dc = np.array([-float(dq_dr[j:] @ rr[: n - j]) for j in range(1, c.size)])
    norm2 = float(c @ c)
    grad = (2.0 * c[1:] * q + norm2 * dq_dc) / n
    return norm2 * q / n, grad


def _log_error(tail: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """log of the error and its gradient: well scaled for L-BFGS (unit steps are sensible)."""
    value, grad = _error_and_gradient(tail, n)
    return math.log(value), grad / value


def optimize_banded_coefficients(
    bands: int, steps: int, init: Optional[Sequence[float]] = None, max_iter: int = 500
) -> np.ndarray:
    """b-banded Toeplitz coefficients minimising :func:`prefix_sum_error` over ``steps`` steps.

    Starts from ``init`` (default :func:`fichtenberger_coefficients`), runs scipy's L-BFGS-B on
    the log of the error over c_1..c_{b−1} with c_0 = 1 (the error is invariant to scaling c),
    and returns the better of the start and the (stable) optimum: never a larger error than the
    start. The optimum depends on ``steps``; it stays stable if the run is longer, only less
    tuned. For T = 2000 it lowers the error of the truncated square root by 9–27 % (b = 2…64).
    Cost O(iterations · b · steps): well under a second for b = 64, steps = 2000.
    """
    bands = check_bands(bands)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1 (the planned run length), got {steps!r}")
    start = check_coefficients(fichtenberger_coefficients(bands) if init is None else init)
    if start.size != bands:
        raise ValueError(f"init has {start.size} coefficients but bands={bands}")
    start = start / start[0]
    if bands == 1:
        return start
    options = {"maxiter": max_iter}
    result = minimize(_log_error, start[1:], args=(int(steps),), jac=True, method="L-BFGS-B", options=options)
    best = np.concatenate(([1.0], result.x))
    if not (np.all(np.isfinite(best)) and is_stable(best)):
        return start
    return best if prefix_sum_error(best, steps) < prefix_sum_error(start, steps) else start
