"""How many more steps fit in a budget: the largest k with ε(ledger + k × (σ, q)) ≤ target.

Used by :class:`~lightning_dp.callbacks.PrivacyBudget` when the stop decision is made with
an accountant that has no running form (PLD, PRV): instead of composing the whole
history every step, the number of remaining steps under the current (σ, q) is found
once by exponential search then interpolation/bisection (ε is non-decreasing in the number of steps),
and recomputed only when σ or q changes.
"""

from __future__ import annotations

import math
from typing import Iterable

from lightning_dp.accounting.checks import check_noise_multiplier, check_sample_rate, check_target_epsilon
from lightning_dp.accounting.epsilon import ledger_epsilon
from lightning_dp.accounting.ledger import LedgerEntry, PrivacyLedger

_MAX_STEPS = 10**9


def steps_within_budget(
    ledger: PrivacyLedger | Iterable[LedgerEntry],
    noise_multiplier: float,
    sample_rate: float,
    target_epsilon: float,
    delta: float,
    accountant: str = "rdp",
    hint: int = 2,
) -> int:
    """Largest k ≥ 0 such that the ledger followed by k releases of (σ, q) has ε ≤ target.

    Returns 0 when even one more step would exceed the target (or the ledger already does).
    Costs O(log k) evaluations of ``accountant`` over the ledger (fewer with a good ``hint``,
    a guess of k, e.g. from the RDP accountant, which needs more noise than PLD/PRV).
    """
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    target = check_target_epsilon(target_epsilon)
    base = tuple(ledger.entries if isinstance(ledger, PrivacyLedger) else ledger)

    cache: dict[int, float] = {}

    def eps(k: int) -> float:
        if k not in cache:
            cache[k] = ledger_epsilon(base + (LedgerEntry(sigma, q, k),), delta, accountant)
        return cache[k]

    if eps(1) > target:
        return 0
    lo, hi = 1, max(2, int(hint))
    while eps(hi) <= target:  # exponential search: lo fits, hi does not
        lo, hi = hi, hi * 2
        if hi > _MAX_STEPS:
            return _MAX_STEPS
    bisect = False
    while hi - lo > 1:  # ε is close to linear in k: interpolate, bisect every other step
        if bisect or not math.isfinite(eps(hi)):
            mid = (lo + hi) // 2
        else:
            frac = (target - eps(lo)) / max(eps(hi) - eps(lo), 1e-300)
            mid = min(max(lo + int(frac * (hi - lo)), lo + 1), hi - 1)
        bisect = not bisect
        lo, hi = (mid, hi) if eps(mid) <= target else (lo, mid)
    return lo
