import pytest

from lightning_dp.accounting.ledger import LedgerEntry, PrivacyLedger


def test_run_length_merging_and_counts():
    ledger = PrivacyLedger()
    ledger.record(1.0, 0.1)
    ledger.record(1.0, 0.1, steps=4)
    ledger.record(2.0, 0.1)
    ledger.record(2.0, 0.1, private=False)
    assert ledger.entries == (
        LedgerEntry(1.0, 0.1, 5),
        LedgerEntry(2.0, 0.1, 1),
        LedgerEntry(2.0, 0.1, 1, private=False),
    )
    assert ledger.steps == 7 and len(ledger) == 3
    assert not ledger.is_private


def test_state_round_trip():
    ledger = PrivacyLedger()
    ledger.record(0.5, 0.01, steps=10)
    ledger.record(0.7, 0.02, steps=3)
    other = PrivacyLedger()
    other.load_state_dict(ledger.state_dict())
    assert other.entries == ledger.entries and other.steps == 13
    other.record(0.7, 0.02)
    assert other.steps == 14 and ledger.steps == 13


@pytest.mark.parametrize("args", [(-1.0, 0.1), (1.0, 1.5), (1.0, -0.1), (float("nan"), 0.1)])
def test_rejects_bad_entries(args):
    with pytest.raises(ValueError):
        PrivacyLedger().record(*args)


def test_zero_steps_is_a_no_op():
    ledger = PrivacyLedger()
    ledger.record(1.0, 0.1, steps=0)
    assert ledger.steps == 0 and len(ledger) == 0
