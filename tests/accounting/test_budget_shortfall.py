"""The refusal of a fit whose budget left is short of its plan (accounting/budget_shortfall.py): its ways on."""

from __future__ import annotations

from lightning_dp.accounting.budget_shortfall import Shortfall


def _shortfall(affordable: int, needed_sigma):
    return Shortfall(spent=3.0, target=3.0, delta=1e-5, accountant="rdp", releases=400, first_step=0,
                     remaining_steps=400, run_sigma=1.7, affordable=affordable, needed_sigma=needed_sigma,
                     reference_sigma=1.7)


def test_the_refusal_numbers_every_way_on_and_names_forgetting_thrown_away_fits():
    """A notebook cell run again trains a fresh model on records an earlier fit released: the refusal names
    forget_data_releases (with its caveat) as the last way on, after stopping, raising the target, recalibrating
    and taking the affordable steps."""
    message = str(_shortfall(affordable=5, needed_sigma=2005.0).error())
    options = message.split("Options:\n")[1].splitlines()
    assert [line[:3] for line in options] == ["(1)", "(2)", "(3)", "(4)", "(5)"]
    assert "forget_data_releases()" in options[-1] and "understates" in options[-1]
    assert "on_budget_short='recalibrate'" in options[2] and "max_steps=5" in options[3]


def test_no_recalibration_offered_when_no_sigma_fits():
    message = str(_shortfall(affordable=0, needed_sigma=None).error())
    assert "recalibrate" not in message and "(3) if the releases are other models' fits" in message
