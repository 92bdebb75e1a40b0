"""An optimizer's schedulers found by a referrer walk only when one may hold it (performance/scheduler_search.py)."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from lightning_dp.performance.scheduler_search import may_be_scheduled, schedulers_of


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


def test_an_optimizer_no_scheduler_marked_has_none_and_is_not_walked() -> None:
    opt = _optimizer()
    assert not may_be_scheduled(opt) and schedulers_of(opt) == []
    assert schedulers_of(object()) == []  # an object of one's own handed as the optimizer: no groups, no step


def test_torchs_schedulers_mark_the_optimizer_and_are_found_but_not_a_plateau_rule() -> None:
    opt = _optimizer()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    assert schedulers_of(opt) == [] and plateau is not None
    steps = torch.optim.lr_scheduler.StepLR(opt, 2)
    assert may_be_scheduled(opt) and schedulers_of(opt) == [steps]
    other = _optimizer()
    lr = torch.optim.lr_scheduler
    sequential = lr.SequentialLR(other, [lr.LinearLR(other, 0.5, total_iters=2), lr.StepLR(other, 2)], milestones=[2])
    assert sequential in schedulers_of(other) and len(schedulers_of(other)) == 3


def test_the_mark_survives_a_loaded_state_and_a_subclass_calling_its_base_init_is_trusted() -> None:
    opt = _optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    opt.load_state_dict(_optimizer().state_dict())  # initial_lr gone from the groups; the wrapped step stays
    assert schedulers_of(opt) == [scheduler]

    class Calls(torch.optim.lr_scheduler.LambdaLR):
        def __init__(self, optimizer: Any) -> None:
            super().__init__(optimizer, lambda step: 1.0)

    assert not may_be_scheduled(_optimizer())
    del Calls


def test_a_subclass_whose_init_calls_no_init_makes_every_optimizer_walked() -> None:
    """It may hold an optimizer it left unmarked: found by the walk, as before this search."""

    class Unmarked(LRScheduler):
        def __init__(self, optimizer: Any) -> None:
            self.optimizer = optimizer

    opt = _optimizer()
    held = Unmarked(opt)
    assert may_be_scheduled(opt) and schedulers_of(opt) == [held]
    del Unmarked, held
    gc.collect()
    assert not may_be_scheduled(_optimizer())
