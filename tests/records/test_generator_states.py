"""The generators' states noted and put back (records/generator_states.py): a pass started from them draws what the
step draws; any draw, from torch, NumPy, Python or a generator the model holds, shows as moved."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from lightning_dp.records import user_generators
from lightning_dp.records.generator_states import taken


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(1)


@pytest.fixture
def holder():
    owner = type("Owner", (), {})()
    module = Holder()
    user_generators.watch(owner, lambda: [module])
    yield module
    user_generators.stop()


def draws(module):
    return (float(torch.rand(())), float(np.random.rand()), random.random(),
            float(torch.rand((), generator=module.gen)))


@pytest.mark.parametrize("which", range(4))
def test_restored_states_draw_alike_and_any_draw_moves_them(holder, which):
    states = taken()
    first = draws(holder)
    assert states.moved()
    states.restore()
    assert not states.moved()
    assert draws(holder) == first
    states.restore()
    [lambda: torch.rand(()), np.random.rand, random.random, lambda: torch.rand((), generator=holder.gen)][which]()
    assert states.moved()


def test_inside_a_looked_for_once_block_the_generators_are_walked_once(holder, monkeypatch):
    """The record checks' loops of reads walk the model once (records/user_generators.looked_for_once): the same
    answer inside the block, a generator attached meanwhile seen only after it; nested blocks share the outer's."""
    walks = []
    find = user_generators.find
    monkeypatch.setattr(user_generators, "find", lambda roots: walks.append(1) or find(roots))
    with user_generators.looked_for_once():
        first = user_generators.held()
        holder.other = torch.Generator()
        with user_generators.looked_for_once():
            assert user_generators.held() is first
        assert [path for path, _ in user_generators.held()] == ["gen"]
    assert len(walks) == 1
    assert [path for path, _ in user_generators.held()] == ["gen", "other"] and len(walks) == 2
