"""Optimizer ⊆ mechanism (validators/optimizer_coverage.py): a tensor the optimizer updates but the release does not
write would be stepped with its raw batch gradient. Each case is refused before any release, naming the tensor."""

from __future__ import annotations

import re

import pytest
import torch
from cases import Classifier, fit, parameters, unchanged
from pytorch_lightning.callbacks import Callback
from torch import nn

from lightning_dp import PrivacyConfigurationError
from lightning_dp.validators.optimizer_coverage import uncovered_tensors, where_held


class LearnableTemperature(Classifier):
    """A plain tensor with requires_grad as a learnable temperature, handed to the optimizer beside the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.ones(1, requires_grad=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x) / self.temperature, y)

    def configure_optimizers(self):
        return torch.optim.SGD([*self.parameters(), self.temperature], lr=1.0)


class HeadsInAList(Classifier):
    """Extra heads kept in a Python list (never registered), their parameters added to the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = [nn.Linear(2, 2), nn.Linear(2, 2)]

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self(x)
        for head in self.heads:
            h = head(h)
        return nn.functional.cross_entropy(h, y)

    def configure_optimizers(self):
        extra = [p for head in self.heads for p in head.parameters()]
        return torch.optim.SGD([{"params": self.parameters()}, {"params": extra, "lr": 0.1}], lr=1.0)


class GroupAddedLater(Callback):
    """Adds a parameter group of an unregistered tensor at the start of the third batch."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            trainer.optimizers[0].add_param_group({"params": [self.tensor]})


class UsesBias(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.zeros(2, requires_grad=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x) + self.shift, y)


@pytest.mark.parametrize("factory,name", [(LearnableTemperature, "'temperature'"),
                                          (HeadsInAList, "'heads[0].weight'")])
@pytest.mark.parametrize("engine", ["ghost", "vmap", "opacus_hooks"])
def test_uncovered_optimizer_tensors_are_refused_before_any_release(factory, name, engine):
    model = factory()
    before = parameters(model)
    held = [t.detach().clone() for t in model.configure_optimizers().param_groups[-1]["params"]]
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)does not cover: {re.escape(name)}.*raw batch"):
        fit(model, per_sample=engine)
    assert unchanged(before, model), "a release happened"
    after = model.configure_optimizers().param_groups[-1]["params"]
    assert all(torch.equal(a.detach(), b) for a, b in zip(after, held)), "the uncovered tensor was stepped"


def test_a_parameter_group_added_mid_run_is_refused_at_that_step():
    """The tensor outside the parameters already holds its raw gradient at the first release: refused there (before
    the group is added), or at the step the group is added."""
    model = UsesBias()
    frozen_value = model.shift.detach().clone()
    with pytest.raises(PrivacyConfigurationError, match="'shift'|hold a gradient from this step's backward: shift"):
        fit(model, steps=5, callbacks=[GroupAddedLater(model.shift)])
    assert torch.equal(model.shift.detach(), frozen_value), "the uncovered tensor was stepped"


def test_uncovered_tensors_and_where_they_are_held():
    model = HeadsInAList()
    opt = model.configure_optimizers()
    covered = [p for p in model.parameters() if p.requires_grad]
    missing = uncovered_tensors(opt, covered)
    assert [g for g, _ in missing] == [1, 1, 1, 1]
    assert where_held(model, missing[2][1]) == "heads[1].weight"
    frozen = torch.zeros(1)  # no requires_grad: the optimizer skips it, nothing to cover
    opt.add_param_group({"params": [frozen]})
    assert len(uncovered_tensors(opt, covered)) == 4
