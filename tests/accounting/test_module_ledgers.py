"""The per-module record (accounting/module_ledgers.py): combining two histories never loses a release."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
from torch import nn

from lightning_dp.accounting import module_ledgers
from lightning_dp.accounting.ledger import LedgerEntry, PrivacyLedger


def _ledger(*entries: tuple[float, int]) -> PrivacyLedger:
    ledger = PrivacyLedger()
    for sigma, steps in entries:
        ledger.record(sigma, 0.1, steps)
    return ledger


@pytest.mark.parametrize("first, second, steps, added, diverged", [
    ([(1.0, 5)], [(1.0, 10)], 10, 5, False),                 # a prefix continued: the longer
    ([(1.0, 10)], [(1.0, 5)], 10, 0, False),                 # a shorter restore: the longer is kept
    ([(1.0, 10), (2.0, 3)], [(1.0, 10)], 13, 0, False),
    ([(1.0, 10)], [(1.0, 10), (2.0, 3)], 13, 3, False),
    ([(1.0, 10)], [(1.0, 5), (2.0, 3)], 13, 3, True),        # split inside an entry: 5 shared, then both rests
    ([(1.0, 10), (2.0, 3)], [(1.0, 10), (3.0, 4)], 17, 4, True),
    ([], [(1.0, 4)], 4, 4, False),
])
def test_combine_keeps_every_release_once(first, second, steps, added, diverged):
    a, b = _ledger(*first), _ledger(*second)
    combined = module_ledgers.combine(a, b)
    assert combined.ledger.steps == steps and combined.added == added and combined.diverged == diverged
    assert combined.ledger.entries[:len(a.entries) - 1] == a.entries[:-1]  # the first stays a prefix


def test_combine_of_diverged_histories_is_their_composition():
    combined = module_ledgers.combine(_ledger((1.0, 10)), _ledger((1.0, 5), (2.0, 3)))
    assert combined.ledger.entries == (LedgerEntry(1.0, 0.1, 10), LedgerEntry(2.0, 0.1, 3))


def test_the_record_covers_submodules_and_goes_with_the_module():
    inner, ledger = nn.Linear(2, 2), _ledger((1.0, 7))
    module_ledgers.bind(inner, ledger)
    outer = nn.Sequential(inner, nn.ReLU())
    assert module_ledgers.record_of(outer).steps == 7  # a trained part inside a new model
    module_ledgers.unbind(inner, ledger)
    ledger.record(1.0, 0.1)  # the step's ledger, now used elsewhere, no longer grows the record
    assert module_ledgers.record_of(inner).steps == 7
    gone = weakref.ref(inner)
    del inner, outer
    gc.collect()
    assert gone() is None  # the registry holds no module alive


def _run(run: str, *entries: tuple[float, int]) -> PrivacyLedger:
    ledger = PrivacyLedger()
    ledger.run = run
    for sigma, steps in entries:
        ledger.record(sigma, 0.1, steps)
    return ledger


def test_two_runs_with_equal_settings_compose_and_one_run_seen_twice_counts_once():
    """A soup of two fits (zoo14 t4): equal σ, q and steps, two histories; the same run twice is one."""
    first, second = _run("a", (1.0, 3)), _run("b", (1.0, 3))
    combined = module_ledgers.combine(first, second)
    assert combined.ledger.steps == 6 and combined.diverged
    assert [e.run for e in combined.ledger.entries] == ["a", "b"]
    assert module_ledgers.combine(first, _run("a", (1.0, 5))).ledger.steps == 5  # a prefix of the same run
    assert module_ledgers.combine(first, first).ledger.steps == 3


def test_an_entry_of_unknown_run_is_taken_for_any_run_as_before():
    """A checkpoint written before runs were kept: its entries match a run's alike settings (a prefix)."""
    old = PrivacyLedger()
    old.load_state_dict({"entries": [[1.0, 0.1, 3, True]]})
    assert old.entries[0].run is None and "runs" not in old.state_dict()
    assert module_ledgers.combine(old, _run("a", (1.0, 5))).ledger.steps == 5
    assert module_ledgers.combine(_run("a", (1.0, 5)), old).ledger.steps == 5


def test_two_runs_ending_on_the_same_weights_are_one_history_of_them():
    """A rerun with the same seeds ends on the same weights: a module holding them (a reload, a copy scaled by
    1.0001) is explained by either run alone, and counts one run's releases, not both (test_step_index p12)."""
    import torch

    def fit(run: str) -> nn.Module:
        torch.manual_seed(7)
        module, ledger = nn.Linear(7, 5), _run(run)
        module_ledgers.bind(module, ledger)
        with torch.no_grad():
            module.weight.add_(0.5)
        ledger.record(1.0, 0.1, 3)
        module_ledgers.unbind(module, ledger)
        return module

    trained = [fit("rerun-a"), fit("rerun-b")]
    assert torch.equal(trained[0].weight, trained[1].weight)
    reloaded = nn.Linear(7, 5)
    reloaded.load_state_dict(trained[1].state_dict())
    assert module_ledgers.record_of(reloaded).steps == 3
    with torch.no_grad():
        reloaded.weight.mul_(1.0001)
        reloaded.bias.mul_(1.0001)
    assert module_ledgers.record_of(reloaded).steps == 3


def test_held_modules_walk_private_names_but_not_torchs_or_lightnings_own():
    """A teacher kept as ``self._t = [teacher]`` is held; what the trainer holds (``_trainer``: every callback's and
    the datamodule's modules) and torch's registries are not walked."""
    teacher, elsewhere = nn.Linear(2, 2), nn.Linear(2, 2)
    student = nn.Sequential(nn.Linear(2, 2))
    student._t = [teacher]
    student._trainer = types.SimpleNamespace(datamodule=elsewhere)
    held = module_ledgers.held_modules(student)
    assert any(m is teacher for m in held)
    assert not any(m is elsewhere for m in held)


def test_a_parameter_put_in_place_of_a_freed_one_is_not_judged_by_its_start():
    """The weights as bound are remembered per parameter, not per id: a fresh parameter put in place of one freed
    since (at its address: CPython hands freed memory to the next object of its size) holds no release, and weights
    equal to it are not charged the fit's."""
    import torch

    torch.manual_seed(3)
    module, ledger = nn.Linear(3, 2), _run("replaced")  # too small to be sketched: nothing else holds its weight
    module_ledgers.bind(module, ledger)
    freed = id(module.weight)
    del module.weight
    made = [nn.Linear(3, 2).weight for _ in range(200)]
    module.weight = next((p for p in made if id(p) == freed), made[0])  # a fresh layer's weight, never trained
    ledger.record(1.0, 0.1, 3)
    module_ledgers.unbind(module, ledger)
    fresh = nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        fresh.weight.copy_(module.weight)
    assert module_ledgers.record_of(fresh) is None
