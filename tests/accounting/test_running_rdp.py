"""RunningRDP: incremental total equals a from-scratch computation; resume; quantised bound."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from lightning_dp.accounting import PrivacyLedger, RunningRDP, ledger_epsilon, running_for
from lightning_dp.accounting.accountants import composed_rdp

DELTA = 1e-5


def _random_ledger_run(seed, n_steps=60):
    rng = random.Random(seed)
    ledger, run = PrivacyLedger(), RunningRDP()
    sigmas = [0.8, 1.0, 1.3]
    for _ in range(n_steps):
        ledger.record(rng.choice(sigmas), rng.choice([0.01, 0.02]), steps=rng.randint(1, 3))
        run.sync(ledger)
        assert run.steps == ledger.steps
    return ledger, run


def test_running_total_equals_from_scratch():
    ledger, run = _random_ledger_run(0)
    np.testing.assert_allclose(run.total, composed_rdp(ledger.entries), rtol=1e-12)
    assert run.epsilon(DELTA) == pytest.approx(ledger_epsilon(ledger, DELTA), rel=1e-12)


def test_epsilon_after_matches_recording_the_step():
    ledger, run = _random_ledger_run(1, 10)
    predicted = run.epsilon_after(DELTA, 0.9, 0.03)
    ledger.record(0.9, 0.03)
    run.sync(ledger)
    assert run.epsilon(DELTA) == pytest.approx(predicted, rel=1e-12)


def test_state_dict_round_trip_continues_and_detects_a_foreign_ledger():
    ledger, run = _random_ledger_run(2, 20)
    resumed = RunningRDP()
    resumed.load_state_dict(run.state_dict())
    ledger.record(1.0, 0.01, steps=5)
    resumed.sync(ledger)
    assert resumed.epsilon(DELTA) == pytest.approx(ledger_epsilon(ledger, DELTA), rel=1e-12)
    other = PrivacyLedger()
    other.record(2.0, 0.5, steps=3)
    stale = RunningRDP()
    stale.load_state_dict(run.state_dict())
    stale.sync(other)  # not an extension of what was seen: rebuilt
    assert stale.steps == 3
    assert stale.epsilon(DELTA) == pytest.approx(ledger_epsilon(other, DELTA), rel=1e-12)


def test_non_private_release_is_infinite():
    ledger, run = PrivacyLedger(), RunningRDP()
    ledger.record(1.0, 0.01, steps=3)
    ledger.record(1.0, 0.01, private=False)
    run.sync(ledger)
    assert run.epsilon(DELTA) == math.inf
    assert not run.private


def test_quantised_total_is_a_tight_upper_bound():
    ledger = PrivacyLedger()
    for t in range(25):
        ledger.record(1.2 - 0.01 * t, 0.01 * (1 + 0.1 * math.sin(t)))
    exact, rounded = RunningRDP(), RunningRDP(quantum=1e-2)
    exact.sync(ledger)
    rounded.sync(ledger)
    assert exact.epsilon(DELTA) <= rounded.epsilon(DELTA) <= exact.epsilon(DELTA) * 1.05
    assert np.all(rounded.total >= exact.total)


def test_integer_running_form_matches_accountant():
    ledger, _ = _random_ledger_run(3, 10)
    run = running_for("integer_rdp")
    run.sync(ledger)
    assert run.epsilon(DELTA) == pytest.approx(ledger_epsilon(ledger, DELTA, "integer_rdp"), rel=1e-12)
    assert running_for("pld") is None
