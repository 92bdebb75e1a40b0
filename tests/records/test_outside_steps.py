"""The process-wide count of optimizer steps outside the private mechanism (records/outside_steps.py)."""

from __future__ import annotations

import gc

import torch
from torch import nn

import lightning_dp  # noqa: F401  (installs the hook once torch.optim is imported)
from lightning_dp.records.outside_steps import mark_private, public_steps, stepped_outside


def _step(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    opt.step()


def test_a_plain_optimizers_steps_are_counted_per_parameter_with_a_gradient():
    model, frozen = nn.Linear(3, 1), nn.Linear(3, 1).requires_grad_(False)
    opt = torch.optim.SGD([*model.parameters(), *frozen.parameters()], lr=0.1)
    for _ in range(3):
        _step(opt, model)
    assert [stepped_outside(p) for p in model.parameters()] == [3, 3]
    assert [stepped_outside(p) for p in frozen.parameters()] == [0, 0]  # no gradient: not stepped


def test_a_private_optimizer_and_public_steps_are_not_counted():
    model = nn.Linear(3, 1)
    private = torch.optim.SGD(model.parameters(), lr=0.1)
    mark_private(private)
    _step(private, model)
    with public_steps():
        _step(torch.optim.Adam(model.parameters(), lr=0.1), model)
    assert [stepped_outside(p) for p in model.parameters()] == [0, 0]
    _step(torch.optim.Adam(model.parameters(), lr=0.1), model)
    assert [stepped_outside(p) for p in model.parameters()] == [1, 1]


def test_the_count_goes_with_the_parameter():
    from lightning_dp.records import outside_steps

    model = nn.Linear(3, 1)
    _step(torch.optim.SGD(model.parameters(), lr=0.1), model)
    keys = {id(p) for p in model.parameters()}
    assert keys <= set(outside_steps._STEPPED)
    del model
    gc.collect()
    assert not keys & set(outside_steps._STEPPED)
