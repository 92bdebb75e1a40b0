"""A starting state saved piece by piece and put back (replays/starting_state.py): every piece put back, whatever
the block raised and even when one piece fails; generators and ĝ as they were."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lightning_dp.replays.starting_state import Generators, StartingState, gradients, put_back_after


def draws() -> tuple[float, float, float]:
    return float(torch.rand(())), float(np.random.rand()), random.random()


def test_generators_put_back_draw_again_what_was_drawn():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    start = StartingState(Generators)
    first = draws()
    assert draws() != first
    start.put_back()
    assert draws() == first


def test_put_back_after_restores_even_when_the_block_raises():
    box = {"value": 1}

    def piece():
        value = box["value"]
        return lambda: box.update(value=value)

    with pytest.raises(RuntimeError):
        with put_back_after(piece):
            box["value"] = 2
            raise RuntimeError("the run again failed")
    assert box["value"] == 1


def test_a_failing_piece_does_not_stop_the_others():
    box = {"a": 1, "b": 1}

    def broken():
        def put_back():
            raise ValueError("cannot")
        return put_back

    def piece():
        return lambda: box.update(b=1)

    start = StartingState(broken, piece)
    box["b"] = 2
    with pytest.raises(ValueError):
        start.put_back()
    assert box["b"] == 1


@pytest.mark.parametrize("copied", [True, False])
def test_gradients_copied_or_the_same_tensors(copied):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    real = p.grad
    start = StartingState(lambda: gradients([p], copied=copied))
    p.grad.mul_(10)  # written in place (clip_grad_norm_)
    start.put_back()
    if copied:
        assert p.grad is not real and torch.equal(p.grad, torch.full((3,), 2.0))
        p.grad.zero_()
        start.put_back()  # a fresh copy each time
        assert torch.equal(p.grad, torch.full((3,), 2.0))
    else:
        assert p.grad is real
