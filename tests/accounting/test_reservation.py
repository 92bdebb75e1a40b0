"""BudgetReservation answers exactly as the per-step ε check would, while rarely touching the total."""

from __future__ import annotations

import math
import random
from typing import Callable

import pytest

from lightning_dp.accounting import BudgetReservation, PrivacyLedger, RunningRDP
from lightning_dp.accounting.reservation import MAX_MARGIN

DELTA = 1e-5
Q = 0.02


def _exact_answer(reference: RunningRDP, ledger: PrivacyLedger, sigma: float, q: float, target: float) -> bool:
    reference.sync(ledger)
    return reference.epsilon_after(DELTA, sigma, q) <= target


def _walk(schedule: Callable[[int], tuple[float, float]], steps: int, target: float, curve: str = "auto"):
    """Record ``steps`` releases of the schedule, asking the guard and the exact check before each."""
    ledger = PrivacyLedger()
    guard = BudgetReservation(RunningRDP(curve=curve), DELTA, target)
    reference = RunningRDP(curve=curve)
    answers, reservations = [], None
    for t in range(steps):
        sigma, q = schedule(t)
        answer = guard.allows_next(ledger, sigma, q)
        assert answer == _exact_answer(reference, ledger, sigma, q, target), f"step {t}: guard said {answer}"
        answers.append(answer)
        if not answer and reservations is None:
            reservations = guard.reservations  # made up to the stop (a trainer stops here)
        ledger.record(sigma, q)
    return answers, guard.reservations if reservations is None else reservations, guard


def _jumps(t: int) -> tuple[float, float]:
    return 1.2 - 0.2 * t / 400, Q * (1.0 + 0.1 * ((t * 7919) % 101) / 101)


SCHEDULES = {
    "constant": lambda t: (1.0, Q),
    "sigma decays": lambda t: (1.2 - 0.3 * t / 400, Q),
    "sigma grows": lambda t: (0.9 + 0.3 * t / 400, Q),
    "q ramps": lambda t: (1.0, Q * (0.5 + 0.5 * t / 400)),
    "random jumps": _jumps,
    "phases": lambda t: (1.0 if t < 150 else 0.7 if t < 300 else 1.5, Q if t % 200 < 100 else 2 * Q),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_answer_equals_the_exact_check_and_the_stop_step_is_the_last_affordable(name):
    schedule = SCHEDULES[name]
    ledger, run = PrivacyLedger(), RunningRDP()
    for t in range(300):
        ledger.record(*schedule(t))
    run.sync(ledger)
    target = run.epsilon(DELTA) * (1 + 1e-9)  # spent at step 300 (clear of rounding in the sums)
    answers, reservations, _ = _walk(schedule, 400, target)
    assert answers.index(False) == 300 and not any(answers[300:])
    assert reservations <= 30  # the expensive path is rare (300 steps)


def test_constant_setting_reserves_once_until_the_end():
    answers, reservations, _ = _walk(SCHEDULES["constant"], 1000, target=2.0)
    assert answers.count(True) < 1000  # the budget ran out inside the walk
    assert reservations <= 2


def test_drifting_sigma_reserves_rarely_and_margins_stay_bounded():
    _, reservations, guard = _walk(SCHEDULES["sigma decays"], 400, target=math.inf)
    assert reservations <= 15
    assert 0 < guard.margin_sigma <= MAX_MARGIN and guard.margin_q == 0.0
    _, reservations, jumpy = _walk(_jumps, 400, target=math.inf)
    assert reservations <= 25 and 0 < jumpy.margin_q <= MAX_MARGIN


def test_a_release_recorded_outside_the_box_cancels_the_reservation():
    rng = random.Random(0)
    ledger, guard, reference = PrivacyLedger(), BudgetReservation(RunningRDP(), DELTA, 3.0), RunningRDP()
    for t in range(300):
        asked = 1.0 + 0.1 * rng.random()
        assert guard.allows_next(ledger, asked, Q) == _exact_answer(reference, ledger, asked, Q, 3.0)
        ledger.record(asked * (0.5 if t % 50 == 49 else 1.0), Q)  # σ lowered after the check, now and then
    before = guard.reservations
    guard.allows_next(ledger, 1.0, Q)
    assert guard.reservations == before + 1  # the halved-σ release was seen: the total was synced again


def test_non_private_release_and_zero_noise_are_refused():
    ledger, guard = PrivacyLedger(), BudgetReservation(RunningRDP(), DELTA, 10.0)
    assert guard.allows_next(ledger, 1.0, Q) and not guard.allows_next(ledger, 0.0, Q)
    ledger.record(1.0, Q, private=False)
    assert not guard.allows_next(ledger, 1.0, Q)



def test_a_replaced_ledger_is_not_trusted_to_the_old_reservation():
    spent, guard = PrivacyLedger(), BudgetReservation(RunningRDP(), DELTA, 3.0)
    while guard.allows_next(spent, 1.0, Q):
        spent.record(1.0, Q)
    fresh = PrivacyLedger()
    fresh.record(0.5, 0.5, steps=2)  # another run's history, already far over budget
    assert not guard.allows_next(fresh, 1.0, Q)
