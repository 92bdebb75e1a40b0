"""A module held outside the model's registry — a self-distillation teacher ``copy.deepcopy``-ed into a plain list at
``on_train_start`` — has its tensors put back by the snapshot after the first step's replays
(validators/snapshot.py, ``_REGISTERED``): an EMA of the weights kept there trains, as it does in a registered
submodule; the same teacher moved by a statistic of the batch is refused before any release."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_dp.validators.snapshot import StateSnapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit, parameters, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class ListTeacher(Classifier):
    """Distils towards an EMA teacher of its own weights, kept in a list (not a registered submodule)."""

    def on_train_start(self) -> None:
        self.teacher = [copy.deepcopy(self.net).requires_grad_(False)]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        with torch.no_grad():
            target = self.teacher[0](x).softmax(1)
        return nn.functional.cross_entropy(out, y) + 0.5 * nn.functional.kl_div(
            out.log_softmax(1), target, reduction="batchmean")

    def teacher_update(self, batch: Any) -> None:
        for pt, ps in zip(self.teacher[0].parameters(), self.net.parameters()):
            pt.mul_(0.9).add_(0.1 * ps)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.teacher_update(batch)


class ListTeacherMovedByTheBatch(ListTeacher):
    def teacher_update(self, batch: Any) -> None:
        for pt in self.teacher[0].parameters():
            pt.add_(batch[0].mean())


def test_an_ema_teacher_kept_in_a_list_trains():
    model = ListTeacher()
    fit(model, steps=4)
    teacher = model.teacher[0]
    assert not any(torch.equal(pt, ps) for pt, ps in zip(teacher.parameters(), model.net.parameters()))


def test_a_teacher_in_a_list_moved_by_the_batch_is_refused_before_any_release():
    model = ListTeacherMovedByTheBatch()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match="attribute teacher"):
        fit(model, steps=4)
    assert unchanged(before, model)


def test_a_snapshot_puts_back_a_held_modules_tensors_and_leaves_the_models_own():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.held = [copy.deepcopy(self.fc), self.fc]  # a copy outside the registry; an alias of a registered layer

    model = Model()
    copied, weight = model.held[0].weight.detach().clone(), model.fc.weight
    snapshot = StateSnapshot(model)
    with torch.no_grad():
        model.held[0].weight.add_(1.0)
    version = weight._version
    snapshot.restore()
    assert torch.equal(model.held[0].weight, copied)
    assert weight._version == version  # the model's parameter untouched
