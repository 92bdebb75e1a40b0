"""steps_within_budget: the exact boundary k (ε(k) ≤ target < ε(k+1))."""

from __future__ import annotations

from lightning_dp.accounting import LedgerEntry, PrivacyLedger, ledger_epsilon, steps_within_budget

DELTA = 1e-5


def test_boundary_is_exact_for_rdp():
    ledger = PrivacyLedger()
    ledger.record(1.0, 0.01, steps=200)
    k = steps_within_budget(ledger, 1.2, 0.01, 2.0, DELTA)
    base = list(ledger.entries)
    assert ledger_epsilon(base + [LedgerEntry(1.2, 0.01, k)], DELTA) <= 2.0
    assert ledger_epsilon(base + [LedgerEntry(1.2, 0.01, k + 1)], DELTA) > 2.0


def test_no_room_returns_zero():
    ledger = PrivacyLedger()
    ledger.record(0.5, 0.1, steps=1000)
    assert steps_within_budget(ledger, 0.5, 0.1, 1.0, DELTA) == 0
