"""ε of a fixed setting, and of a heterogeneous ledger (σ or q changing mid-run).

The sampled Gaussian mechanism of docs/algorithms.md ("The mechanism"), composed T times, is
what every private variant releases; its ε is computed by one of the maintained
accountants of :mod:`lightning_dp.accounting.accountants`.
"""

from __future__ import annotations

from typing import Iterable

from lightning_dp.accounting.accountants import get_accountant
from lightning_dp.accounting.checks import check_delta, check_noise_multiplier, check_sample_rate, check_steps
from lightning_dp.accounting.ledger import LedgerEntry, PrivacyLedger


def epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """ε(δ) of ``steps`` releases of the Poisson-subsampled Gaussian mechanism (σ, q).

    Args:
        noise_multiplier: σ > 0 (noise std / clipping norm).
        sample_rate: q ∈ (0, 1] (expected batch / N).
        steps: T ≥ 0 (0 gives ε = 0).
        delta: δ ∈ (0, 1).
        accountant: ``"rdp"`` (default), ``"pld"``, ``"prv"`` or ``"integer_rdp"``.

    Example:
        >>> round(epsilon(1.1, 0.004, 14000, 1e-5), 2)  # doctest: +SKIP
        2.41
    """
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    steps = check_steps(steps)
    delta = check_delta(delta)
    fn = get_accountant(accountant)
    if steps == 0:
        return 0.0
    return fn((LedgerEntry(sigma, q, steps),), delta)


def ledger_epsilon(ledger: PrivacyLedger | Iterable[LedgerEntry], delta: float, accountant: str = "rdp") -> float:
    """ε(δ) of every release in a ledger, composed by ``accountant``.

    Entries may differ in σ and q. Any entry with ``private=False`` (or σ = 0 with q > 0)
    makes ε infinite. Entries with q = 0 release nothing and are skipped; an empty ledger
    has ε = 0.
    """
    delta = check_delta(delta)
    fn = get_accountant(accountant)
    entries = tuple(ledger.entries if isinstance(ledger, PrivacyLedger) else ledger)
    if not all(e.private for e in entries):
        return float("inf")
    active = tuple(e for e in entries if e.steps > 0 and e.sample_rate > 0)
    if any(e.noise_multiplier <= 0 for e in active):
        return float("inf")
    if not active:
        return 0.0
    return fn(active, delta)
