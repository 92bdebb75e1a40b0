"""The one-run ε lower bound of Steinke, Nasr & Jagielski (NeurIPS 2023, arXiv:2305.08846).

docs/algorithms.md §8. m canaries are each included independently with probability ½
(S_i ∈ {-1, +1}); the auditor, seeing only the output, guesses T_i ∈ {-1, 0, +1}
(0 = abstain). With r = #{i : T_i ≠ 0} guesses and W = #{i : T_i = S_i} correct ones,
the paper's main theorem (Thm. 3; Thm. 1 is its informal statement) says that if the
algorithm is (ε, δ)-DP then for every v

    P[W ≥ v] ≤ f(v) + 2 m δ · max_{i ∈ {1..m}} (f(v − i) − f(v)) / i,          (Thm. 3)
    f(v) := P[Binomial(r, e^ε / (1 + e^ε)) ≥ v].

For δ = 0 this is the tail of r independent ε-randomized responses (Prop. 5 of the
paper is the pure-DP case). Observing v correct guesses therefore rejects "(ε, δ)-DP" at
level β whenever the right-hand side is < β; the largest such ε is the reported lower
bound, which holds with probability ≥ 1 − β over the canary coins and the algorithm.

This is also what the paper's reference code (its App. D, ``p_value_DP_audit``) computes:
P[Binomial(r, q) ≥ v] + 2mδ · max_{1≤i≤v} P[v − i ≤ Binomial(r, q) < v] / i with
q = 1/(1 + e^−ε); ``tests/audit/test_bound.py`` holds :func:`p_value` to the theorem as written.

Note: for i > v, f(v − i) = 1, so (f(v − i) − f(v))/i ≤ (1 − f(v))/v — the maximum is
attained for some i ≤ v and the search stops there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

#: ε above which the search stops (e^-60 is far below any reachable p-value resolution).
_EPS_CAP = 60.0


def rr_accuracy(epsilon: float) -> float:
    """e^ε / (1 + e^ε): accuracy of ε-randomized response, the binomial's success rate in Thm. 3."""
    return 1.0 / (1.0 + math.exp(-epsilon))


def p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
    """Upper bound on P[W ≥ v] for an (ε, δ)-DP algorithm (right-hand side of Thm. 3), capped at 1.

    Args:
        m: number of canaries (each included with probability ½).
        r: number of guesses (canaries not abstained on), 0 ≤ r ≤ m.
        v: number of correct guesses, 0 ≤ v ≤ r.
        epsilon: ε ≥ 0 of the null hypothesis.
        delta: δ ∈ [0, 1] of the null hypothesis.
    """
    _check_counts(m, r, v)
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be a finite number ≥ 0, got {epsilon!r}")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1], got {delta!r}")
    if v == 0:
        return 1.0
    p = rr_accuracy(epsilon)
    tail = float(stats.binom.sf(v - 1, r, p))  # f(v) = P[Binomial(r, p) ≥ v]
    if delta == 0:
        return min(tail, 1.0)
    return min(tail + 2 * m * delta * _delta_slope(r, v, p), 1.0)


def _delta_slope(r: int, v: int, p: float) -> float:
    """max_{1 ≤ i ≤ v} (f(v − i) − f(v)) / i = max_i P[v − i ≤ Binomial(r, p) < v] / i."""
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, p)  # P[B = v-1], P[B = v-2], ..., P[B = 0]
    gaps = np.cumsum(below)  # gaps[i-1] = P[v - i ≤ B < v]
    return float(np.max(gaps / np.arange(1, v + 1)))


def epsilon_lower_bound(m: int, r: int, v: int, confidence: float = 0.95, delta: float = 0.0) -> float:
    """Largest ε that v correct out of r guesses on m canaries rejects at level β = 1 − confidence.

    The algorithm is then not (ε, δ)-DP for any ε below the returned value, with
    probability ≥ ``confidence`` (Thm. 3 of Steinke et al. 2023; see the module doc).
    Returns 0.0 when even ε = 0 cannot be rejected. Bisection to 1e-6 on ε, keeping the
    returned point rejected (conservative).

    Example:
        >>> round(epsilon_lower_bound(m=1000, r=100, v=100), 2)
        3.49
    """
    _check_confidence(confidence)
    beta = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < beta:
        lo, hi = hi, 2 * hi
        if hi > _EPS_CAP:
            return lo
    while hi - lo > 1e-6:
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) < beta:
            lo = mid
        else:
            hi = mid
    return lo


def guesses_from_scores(scores: Sequence[float], k_pos: int, k_neg: int) -> np.ndarray:
    """T ∈ {-1, 0, +1}^m: +1 ("in") for the k_pos highest scores, -1 for the k_neg lowest, 0 otherwise.

    Ties are broken by canary index (stable sort), which does not depend on the coins.
    """
    s = np.asarray(scores, dtype=float)
    m = s.shape[0]
    if s.ndim != 1 or not np.all(np.isfinite(s)):
        raise ValueError("scores must be a 1-D array of finite numbers (one per canary)")
    if k_pos < 0 or k_neg < 0 or k_pos + k_neg > m:
        raise ValueError(f"need k_pos, k_neg ≥ 0 and k_pos + k_neg ≤ m = {m}, got {k_pos}, {k_neg}")
    order = np.argsort(s, kind="stable")
    guesses = np.zeros(m, dtype=int)
    guesses[order[:k_neg]] = -1
    if k_pos:
        guesses[order[m - k_pos:]] = 1
    return guesses


def count_correct(guesses: Sequence[int], included: Sequence[bool]) -> tuple[int, int]:
    """(r, v): number of non-abstaining guesses and of correct ones (T_i = S_i)."""
    t = np.asarray(guesses)
    s = np.where(np.asarray(included, dtype=bool), 1, -1)
    if t.shape != s.shape:
        raise ValueError(f"guesses and included must have the same length, got {t.shape} and {s.shape}")
    return int(np.count_nonzero(t)), int(np.count_nonzero(t == s))


@dataclass(frozen=True)
class BoundResult:
    """One audit's outcome: the lower bound and the counts it came from."""

    epsilon: float
    m: int
    guesses: int
    correct: int
    k: int
    confidence: float
    delta: float


def audit_from_scores(
    scores: Sequence[float],
    included: Sequence[bool],
    confidence: float = 0.95,
    delta: float = 0.0,
    ks: Sequence[int] | None = None,
) -> BoundResult:
    """ε lower bound from per-canary scores (higher = "more likely included").

    For each k in ``ks`` the auditor guesses "in" for the k highest and "out" for the k
    lowest scores (Steinke et al., Alg. 1). Trying several k is paid for with a union
    bound: each k is tested at level β/len(ks), so the best of them still holds at
    ``confidence``. Default ``ks``: m/20, m/10, m/4, m/2 (rounded, at least 1, distinct).
    """
    s = np.asarray(scores, dtype=float)
    m = s.shape[0]
    if m == 0:
        raise ValueError("no canaries: give at least one score")
    ks = default_ks(m) if ks is None else sorted({int(k) for k in ks})
    if not ks or min(ks) < 1 or 2 * max(ks) > m:
        raise ValueError(f"each k must satisfy 1 ≤ k ≤ m/2 = {m / 2:g}, got {list(ks)}")
    _check_confidence(confidence)
    level = 1.0 - (1.0 - confidence) / len(ks)
    best = BoundResult(0.0, m, 0, 0, 0, confidence, delta)
    for k in ks:
        r, v = count_correct(guesses_from_scores(s, k, k), included)
        eps = epsilon_lower_bound(m, r, v, level, delta)
        if eps > best.epsilon or best.k == 0:
            best = BoundResult(eps, m, r, v, k, confidence, delta)
    return best


def default_ks(m: int) -> list[int]:
    """Guesses per side tried by :func:`audit_from_scores`: m/20, m/10, m/4, m/2 (distinct, ≥ 1)."""
    return sorted({max(1, min(m // 2, round(m * f))) for f in (0.05, 0.1, 0.25, 0.5)} - {0}) or [1]


def _check_counts(m: int, r: int, v: int) -> None:
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ canaries, got v={v}, r={r}, m={m}")


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1) (e.g. 0.95), got {confidence!r}")
