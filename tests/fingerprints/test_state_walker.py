"""A callback's ``state_dict()`` is built afresh at every call: beyond the walk's depth its containers' identities are
the allocator's, not state (fingerprints/state_walker.Walker.named(fresh=True)). Lightning's BaseFinetuning keeps its
optimizer's param groups 5 levels down; two replays alike were told apart by a new list's address in the full
suite's order, refusing test_loop_contract's unfreezing fit."""

from __future__ import annotations

import copy

import torch
from conftest import at_freed_address

from lightning_dp.fingerprints.checksums import Checksums
from lightning_dp.fingerprints.state_walker import MAX_DEPTH, Walker, closure_token, freeze


def _nested(depth: int, leaf: list) -> dict:
    value: object = leaf
    for level in range(depth):
        value = {f"level {level}": [value]} if level % 2 else {f"level {level}": value}
    return value  # type: ignore[return-value]


def _walker() -> Walker:
    return Walker(set(), set(), Checksums(), full=False)


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


def test_plain_values_are_tokened_by_the_walks_own_rules():
    """freeze (an optimizer's extra state, a scheduler's state) reads scalars and NumPy values as the walk does."""
    np = __import__("numpy")
    for value in (None, True, 3, "a", b"x", 0.5, float("nan"), np.int64(7), np.zeros(3)):
        assert freeze(value) == _walker().token(value), value
    assert freeze(1) != freeze(True) and freeze(1) != freeze(1.0)


def test_a_nan_hyper_parameter_equals_itself():
    """The optimizer's settings are tokened by freeze: a NaN learning rate (a float by its repr) is not a change."""
    from lightning_dp.fingerprints.fingerprint_entries import changed_entries
    from lightning_dp.validators.steered_settings import settings

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    opt.param_groups[0]["lr"] = float("nan")
    opt.param_groups[0]["lr_tensor"] = torch.tensor([float("nan"), 1.0])
    assert changed_entries(settings(opt), settings(opt)) == []
    before = settings(opt)
    opt.param_groups[0]["lr_tensor"][1] = 2.0
    assert changed_entries(before, settings(opt)) == ["optimizer param_groups[0].lr_tensor"]


def test_a_closures_token_follows_its_cells_and_defaults():
    def make(scale: float):
        def fn(step: int, floor: float = 0.1) -> float:
            return max(floor, scale * step)
        return fn

    first, again = make(0.5), make(0.5)
    assert closure_token(first) == closure_token(again)
    assert closure_token(first) != closure_token(make(0.25))
    again.__defaults__ = (0.2,)
    assert closure_token(first) != closure_token(again)


def test_a_setting_token_holds_what_it_compares_by_identity():
    """A large tensor in an optimizer's or scheduler's state is tokened by identity and version: the token holds it,
    so a tensor made after it is freed (a state rebound at each step) never takes its id and passes for it."""

    class Opaque:
        __slots__ = ("value",)

    for make in (lambda: torch.zeros(64), lambda: Opaque()):
        kept = {"state": make()}
        before = freeze(kept)
        freed = id(kept["state"])
        kept["state"] = None
        kept["state"], _ = at_freed_address(freed, make, count=500)
        assert freeze(kept) != before


def test_a_hook_lightning_dp_wraps_for_a_fit_is_read_as_the_user_wrote_it():
    """CI: the logger judge wraps a user's epoch hook at the class level for the fit (functools.wraps); the wrapper's
    closure holds no list, so the class's entry for the hook's closure state came and went with it and a fit was
    refused for state "written" by the library's own wrapping."""
    import functools

    from lightning_dp.fingerprints.state_walker import callable_state, class_attributes
    from lightning_dp.records.library_objects import mark_wrapper

    calls: list = []

    class Hooked:
        def on_train_start(self) -> None:
            calls.append(1)

    before = [(k, v) for _, k, v in class_attributes([Hooked])]
    original = Hooked.__dict__["on_train_start"]

    @functools.wraps(original)
    def judged(self):
        return original(self)

    Hooked.on_train_start = mark_wrapper(judged)
    assert [(k, v) for _, k, v in class_attributes([Hooked])] == before != []
    assert callable_state(Hooked.on_train_start) == callable_state(original) == [calls]
