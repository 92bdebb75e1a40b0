"""epsilon / ledger_epsilon: monotonicity, composition of heterogeneous ledgers, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from lightning_dp.accounting import (
    LedgerEntry,
    PrivacyLedger,
    RDP_ORDERS,
    available_accountants,
    epsilon,
    ledger_epsilon,
    rdp_to_epsilon,
)

DELTA = 1e-5


@pytest.mark.parametrize("accountant", ["rdp", "integer_rdp"])
def test_monotone_in_steps_rate_and_noise(accountant):
    base = epsilon(1.0, 0.01, 1000, DELTA, accountant)
    assert epsilon(1.0, 0.01, 2000, DELTA, accountant) > base  # more steps
    assert epsilon(1.0, 0.02, 1000, DELTA, accountant) > base  # larger q
    assert epsilon(0.9, 0.01, 1000, DELTA, accountant) > base  # smaller σ
    assert epsilon(1.0, 0.01, 1000, DELTA / 10, accountant) > base  # smaller δ


def test_monotone_pld_one_setting():
    base = epsilon(2.0, 0.01, 100, DELTA, "pld")
    assert epsilon(2.0, 0.01, 200, DELTA, "pld") > base
    assert epsilon(1.5, 0.01, 100, DELTA, "pld") > base


def test_zero_steps_is_zero_and_registry_lists_all():
    assert epsilon(1.0, 0.01, 0, DELTA) == 0.0
    assert set(available_accountants()) >= {"rdp", "pld", "prv", "integer_rdp"}


def test_conversion_equals_opacus_get_privacy_spent():
    rdp = compute_rdp(q=0.02, noise_multiplier=0.9, steps=777, orders=list(RDP_ORDERS))
    assert rdp_to_epsilon(rdp, RDP_ORDERS, 3e-6) == pytest.approx(
        get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=3e-6)[0], rel=1e-12
    )


def test_heterogeneous_ledger_equals_sum_of_rdp_vectors():
    """RDP composes additively: ε(ledger) = conversion(Σ_parts compute_rdp(part))."""
    parts = [(1.2, 0.01, 300), (0.8, 0.02, 50), (2.0, 0.005, 1000), (1.2, 0.01, 7)]
    ledger = PrivacyLedger()
    for s, q, n in parts:
        ledger.record(s, q, steps=n)
    summed = sum(np.asarray(compute_rdp(q=q, noise_multiplier=s, steps=n, orders=RDPAccountant.DEFAULT_ALPHAS))
                 for s, q, n in parts)
    expected, _ = get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=summed, delta=DELTA)
    assert ledger_epsilon(ledger, DELTA) == pytest.approx(expected, rel=1e-12)
    # and it is more than any part alone, less than the crude sum of the parts' ε
    eps_parts = [epsilon(s, q, n, DELTA) for s, q, n in parts]
    assert max(eps_parts) < ledger_epsilon(ledger, DELTA) < sum(eps_parts)
    # a constant ledger equals the closed-form call
    same = PrivacyLedger()
    same.record(1.1, 0.004, steps=500)
    same.record(1.1, 0.004, steps=500)
    assert ledger_epsilon(same, DELTA) == epsilon(1.1, 0.004, 1000, DELTA)


def test_heterogeneous_pld_between_its_parts():
    entries = [LedgerEntry(4.0, 0.1, 10), LedgerEntry(3.0, 0.1, 10)]
    both = ledger_epsilon(entries, DELTA, "pld")
    assert epsilon(3.0, 0.1, 10, DELTA, "pld") < both < epsilon(3.0, 0.1, 20, DELTA, "pld")


def test_non_private_entry_gives_infinity():
    ledger = PrivacyLedger()
    ledger.record(1.0, 0.01, steps=10)
    ledger.record(1.0, 0.01, steps=1, private=False)
    for accountant in ("rdp", "pld"):
        assert ledger_epsilon(ledger, DELTA, accountant) == math.inf
    zero_noise = [LedgerEntry(0.0, 0.01, 1)]
    assert ledger_epsilon(zero_noise, DELTA) == math.inf
    assert ledger_epsilon(PrivacyLedger(), DELTA) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(delta=0.0), "delta"),
        (dict(delta=1.0), "delta"),
        (dict(sample_rate=0.0), "sample_rate"),
        (dict(sample_rate=1.5), "sample_rate"),
        (dict(steps=-1), "steps"),
        (dict(steps=2.5), "steps"),
        (dict(noise_multiplier=0.0), "noise_multiplier"),
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(accountant="nope"), "unknown accountant"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, match):
    args = dict(noise_multiplier=1.0, sample_rate=0.01, steps=10, delta=DELTA, accountant="rdp")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        epsilon(**args)


def test_ledger_epsilon_rejects_bad_delta():
    with pytest.raises(ValueError, match="delta"):
        ledger_epsilon(PrivacyLedger(), 2.0)


def test_rdp_orders_are_opacus_defaults():
    from opacus.accountants import RDPAccountant

    assert RDP_ORDERS == tuple(float(a) for a in RDPAccountant.DEFAULT_ALPHAS)
