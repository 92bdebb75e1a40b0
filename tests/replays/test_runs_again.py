"""Runs again and their comparison (replays/runs_again.py): a failed run judges nothing, the third run only when the
first two differ, what the exchanged run sets apart, a tensor compared bit for bit."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from lightning_dp.fingerprints.fingerprint_entries import moved_by_data
from lightning_dp.replays.runs_again import bit_exact, plain_exchanged_again, run_once, set_apart
from lightning_dp.replays.starting_state import StartingState


def apart(runs):
    return set_apart(runs[0], runs[2], runs[1:2], moved_by_data) if len(runs) == 3 else []


def test_run_once_starts_from_the_state_and_puts_back_after_a_failure():
    box = {"value": 1, "entered": 0}

    def piece():
        value = box["value"]
        return lambda: box.update(value=value)

    @contextmanager
    def variant():
        box["entered"] += 1
        yield

    start = StartingState(piece)
    box["value"] = 5
    assert run_once(lambda: box["value"], variant(), start=start.put_back) == 1
    then = StartingState(piece)

    def fails():
        box["value"] = 9
        raise RuntimeError("needs more of the loop")
    assert run_once(fails, variant(), then=then.put_back) is None
    assert box == {"value": 1, "entered": 2}


def test_the_third_run_only_when_the_first_two_differ():
    seen: list[bool] = []

    def run(exchange):
        seen.append(exchange)
        return {"mean": "other" if exchange else "plain"}
    runs = plain_exchanged_again(run, lambda plain: True)
    assert seen == [False, True, False] and apart(runs) == ["mean"]
    seen.clear()
    runs = plain_exchanged_again(lambda exchange: seen.append(exchange) or {"count": 1}, lambda plain: True)
    assert seen == [False, True] and apart(runs) == []
    assert plain_exchanged_again(lambda exchange: {}, lambda plain: False) == [{}]


def test_a_clock_is_not_set_apart_and_a_failed_run_sets_nothing_apart():
    ticks = iter(range(10))
    runs = plain_exchanged_again(lambda exchange: {"time": next(ticks)}, lambda plain: True)
    assert len(runs) == 3 and apart(runs) == []
    assert set_apart({"a": 1}, None, [{"a": 2}], moved_by_data) == []


def test_what_any_other_run_set_apart_each_name_once():
    plain, again = {"a": 1, "b": 1, "t": 0}, {"a": 1, "b": 1, "t": 1}
    others = [{"a": 2, "b": 1, "t": 2}, None, {"a": 3, "b": 2, "t": 3}]
    assert set_apart(plain, again, others, moved_by_data) == ["a", "b"]


def test_bit_exact():
    t = torch.tensor([1.0, float("nan")])
    assert bit_exact(torch.ones(2), torch.ones(2)) and bit_exact(None, None)
    assert not bit_exact(torch.ones(2), None) and not bit_exact(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert not bit_exact(torch.ones(2), torch.ones(2).add(1e-7)) and not bit_exact(t, t.clone())


def test_what_a_run_wrote_is_read_once_its_contexts_closed():
    box = {"value": 1}

    @contextmanager
    def exchanged():
        box["value"] = -1
        yield
        box["value"] = 1
    assert run_once(lambda: box["value"], exchanged()) == -1
    assert run_once(lambda: None, exchanged(), read=lambda: box["value"]) == 1
