"""Choose σ for a target (ε, δ): the smallest noise multiplier whose ε stays ≤ target.

ε(σ) of the sampled Gaussian mechanism decreases in σ (at every RDP order, and for the
PLD/PRV accountants up to their discretisation), so the answer is a root of
ε(σ) − ε_target. We bracket it, solve in log σ with Brent's method (scipy) to a
relative tolerance ``rtol`` in σ (default 1e-4 — far tighter than the 0.01 tolerance in ε of
Opacus' ``get_noise_multiplier``), then step up until ε(σ) ≤ target is *verified* by the
accountant: the returned σ is never below the target's requirement and at most about
``rtol`` relatively above the smallest such σ.
"""

from __future__ import annotations

import math
from typing import Callable

from scipy.optimize import brentq

from lightning_dp.accounting.checks import check_delta, check_sample_rate, check_steps, check_target_epsilon
from lightning_dp.accounting.epsilon import epsilon

_SIGMA_MIN, _SIGMA_MAX = 1e-3, 1e4


def smallest_sigma(
    epsilon_of: Callable[[float], float],
    target_epsilon: float,
    rtol: float = 1e-4,
    start: float = 1.0,
    max_sigma: float = _SIGMA_MAX,
) -> float:
    """Smallest σ (within relative ``rtol``) with ``epsilon_of(σ) ≤ target_epsilon``, for any
    ε(σ) that decreases in σ (module docstring): bracket from ``start`` by doubling / halving,
    Brent's method on log ε(σ) − log ε* in log σ, then step up until the target is verified.
    σ below 1e-3 is not searched (that σ is returned if it already meets the target);
    ``ValueError`` if no σ ≤ ``max_sigma`` does. Each ε(σ) is evaluated once (cached).
    """
    cache: dict[float, float] = {}

    def f(sigma: float) -> float:
        if sigma not in cache:
            cache[sigma] = epsilon_of(sigma)
        return cache[sigma]

    lo, hi = _bracket(f, target_epsilon, start, max_sigma)
    if lo == hi:
        return hi

    def gap(log_sigma: float) -> float:  # clipped so that ε = 0 or ∞ stays finite
        return math.log(min(max(f(math.exp(log_sigma)), 1e-300), 1e300)) - math.log(target_epsilon)

    sigma = min(math.exp(brentq(gap, math.log(lo), math.log(hi), xtol=rtol / 4)), hi)
    while f(sigma) > target_epsilon:  # verify; the root may sit a hair below the boundary
        sigma = min(sigma * (1.0 + rtol / 4), hi)
    return sigma


def _bracket(f: Callable[[float], float], target: float, start: float, max_sigma: float) -> tuple[float, float]:
    """[lo, hi] with f(lo) > target ≥ f(hi)."""
    hi = start
    while f(hi) > target:
        if hi >= max_sigma:
            raise ValueError(
                f"target_epsilon={target} is not reachable with σ ≤ {max_sigma:g}; "
                "raise the target, lower the sample rate or the number of steps"
            )
        hi *= 2.0
    lo = hi / 2.0 if hi > start else start / 1.5
    while f(lo) <= target:
        if lo <= _SIGMA_MIN:
            return _SIGMA_MIN, _SIGMA_MIN
        hi, lo = lo, lo / 2.0
    return lo, hi


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    rtol: float = 1e-4,
) -> float:
    """Smallest σ (within relative ``rtol``) such that ``epsilon(σ, q, steps, δ, accountant) ≤ target``.

    Args:
        target_epsilon: ε > 0 to stay within.
        delta: δ ∈ (0, 1).
        sample_rate: q ∈ (0, 1].
        steps: planned number of steps T ≥ 1.
        accountant: ``"rdp"`` (default), ``"pld"``, ``"prv"`` or ``"integer_rdp"``.
        rtol: relative tolerance on σ (> 0).

    Example:
        >>> sigma = calibrate_noise(3.0, 1e-5, 0.004, 14000)  # doctest: +SKIP
    """
    target = check_target_epsilon(target_epsilon)
    delta = check_delta(delta)
    q = check_sample_rate(sample_rate)
    steps = check_steps(steps)
    if steps < 1:
        raise ValueError("steps must be >= 1 to calibrate σ (with 0 steps any σ gives ε = 0)")
    if not 0 < rtol < 0.1:
        raise ValueError(f"rtol must be in (0, 0.1), got {rtol!r}")

    # Tighter accountants need less noise than RDP: start their search just below σ_RDP.
    start = 1.0 if accountant == "rdp" else calibrate_noise(target, delta, q, steps, "rdp", rtol=1e-2)
    return smallest_sigma(lambda sigma: epsilon(sigma, q, steps, delta, accountant), target, rtol, start)
