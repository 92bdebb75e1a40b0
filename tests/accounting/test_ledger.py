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


def test_each_entry_keeps_its_run_through_the_state_dict():
    ledger = PrivacyLedger()
    ledger.record(1.0, 0.1, steps=2)
    ledger.run = "fit-1"
    ledger.record(1.0, 0.1, steps=3)  # equal settings, another run: an entry of its own
    assert [(e.steps, e.run) for e in ledger.entries] == [(2, None), (3, "fit-1")]
    state = ledger.state_dict()
    assert state["entries"] == [[1.0, 0.1, 5, True]]  # the checkpoint's entries as they always were
    assert state["runs"] == [[None, 2], ["fit-1", 3]]
    other = PrivacyLedger()
    other.load_state_dict(state)
    assert other.entries == ledger.entries and other.run is None


def test_listeners_hear_each_record_and_are_not_part_of_the_state():
    import copy
    import pickle

    heard: list[int] = []

    def hear(steps: int) -> None:
        heard.append(steps)

    ledger = PrivacyLedger()
    ledger.listen(hear)
    ledger.record(1.0, 0.1, steps=2)
    ledger.record(1.0, 0.1, steps=0)
    assert heard == [2]
    assert pickle.loads(pickle.dumps(ledger))._listeners == [] and copy.deepcopy(ledger)._listeners == []
    ledger.unlisten(hear)
    ledger.record(1.0, 0.1)
    assert heard == [2]
