"""When the batch check runs (validators/schedule.py): the first step always; later steps at random, within the
budget's share of the time."""

from __future__ import annotations

import random

import pytest

from lightning_dp.validators.schedule import VerificationSchedule


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(mode, budget, steps=20000, step_seconds=0.01, check_seconds=0.02, seed=0):
    clock = Clock()
    schedule = VerificationSchedule(mode, budget, rng=random.Random(seed), clock=clock)
    checked_steps, check_time = [], 0.0
    for t in range(steps):
        if schedule.due():
            clock.now += check_seconds
            schedule.checked(check_seconds)
            checked_steps.append(t)
            if t:
                check_time += check_seconds
        clock.now += step_seconds
    return checked_steps, check_time / (steps * step_seconds)


def test_sampled_checks_take_the_budgets_share_of_the_time_at_irregular_steps():
    checked, share = simulate("sampled", 0.05)
    assert checked[0] == 0
    assert 0.04 < share < 0.06
    gaps = {b - a for a, b in zip(checked, checked[1:])}
    assert len(gaps) > 10, "checks at a fixed period could be dodged by a behaviour keyed on the step"


@pytest.mark.parametrize("mode,expected", [("first_step", [0]), ("every_step", list(range(50)))])
def test_first_step_and_every_step(mode, expected):
    checked, _ = simulate(mode, 0.05, steps=50)
    assert checked == expected


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="verify must be"):
        VerificationSchedule("sometimes")
    with pytest.raises(ValueError, match="verify_budget"):
        VerificationSchedule("sampled", 0.0)


def test_a_behaviour_switching_on_later_is_met_within_four_times_its_step_whatever_the_budget():
    """One random step in every doubling window is checked even when the budget buys nothing (a tiny budget, a
    short run): a behaviour that starts at step k and stays is met by step 4k, in every one of 200 seeds."""
    for seed in range(200):
        checked, _ = simulate("sampled", 1e-6, steps=300, seed=seed)
        for k in (2, 5, 17, 70):
            assert any(k <= t < 4 * k for t in checked), (seed, k, checked)
    checked, share = simulate("sampled", 1e-6, steps=4096)
    assert len(checked) <= 14, "log2(T) window checks, not a fixed share of the steps"
    picks = {tuple(simulate("sampled", 1e-6, steps=64, seed=seed)[0]) for seed in range(20)}
    assert len(picks) > 10, "the window's step is drawn at random, not fixed"
