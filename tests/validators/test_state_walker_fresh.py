"""A callback's ``state_dict()`` is built afresh at every call: beyond the walk's depth its containers' identities are
the allocator's, not state (validators/state_walker._Walker.named(fresh=True)). Lightning's BaseFinetuning keeps its
optimizer's param groups 5 levels down; two replays alike were told apart by a new list's address in the full
suite's order, refusing test_loop_contract's unfreezing fit."""

from __future__ import annotations

import copy

from lightning_dp.validators.checksums import _Checksums
from lightning_dp.validators.state_walker import MAX_DEPTH, _Walker


def _nested(depth: int, leaf: list) -> dict:
    value: object = leaf
    for level in range(depth):
        value = {f"level {level}": [value]} if level % 2 else {f"level {level}": value}
    return value  # type: ignore[return-value]


def _walker() -> _Walker:
    return _Walker(set(), set(), _Checksums(), full=False)


def test_two_equal_fresh_states_beyond_the_depth_give_one_token():
    first = _nested(MAX_DEPTH + 2, [1, 2, 3])
    second = copy.deepcopy(first)  # alive together: every container at another address
    assert _walker().named("cb.state_dict()", first, fresh=True) == _walker().named("cb.state_dict()", second,
                                                                                      fresh=True)
    # kept state is compared by identity beyond the depth: a container replaced there shows
    assert _walker().named("cb.memory", first) != _walker().named("cb.memory", second)


def _chain(levels: int, leaf: list) -> dict:
    value: object = leaf
    for _ in range(levels):
        value = {"inner": value}
    return value  # type: ignore[return-value]


def test_a_fresh_state_still_shows_a_change_within_the_depth_and_a_length_beyond_it():
    base = _walker().named("cb.state_dict()", _chain(MAX_DEPTH, [1, 2, 3]), fresh=True)  # the list: at the depth
    assert _walker().named("cb.state_dict()", _chain(MAX_DEPTH, [1, 2, 3]), fresh=True) == base
    assert _walker().named("cb.state_dict()", _chain(MAX_DEPTH, [1, 2, 3, 4]), fresh=True) != base
    near = {"kept": [0.5], "other": 1}
    assert _walker().named("cb.state_dict()", near, fresh=True) != _walker().named(
        "cb.state_dict()", {"kept": [0.25], "other": 1}, fresh=True)
