"""The module tree's structure as kept state (validators/kept_state.py): each module's class and the order of its
submodules are entries of the fingerprint (``structure net.1``), so a parameter-free layer replaced, its class
reassigned or two layers swapped from the batch's labels is refused (zoo33 L04, L05, L56), while a swap made alike on
any data (a schedule at an epoch's start, a batch end's swap by the step count) is judged by the replays and trains."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp.validators.hook_replays import model_kept  # noqa: E402
from lightning_dp.validators.kept_state import StateFingerprint, StateWrittenError  # noqa: E402


def _labels_high(batch) -> bool:
    return bool(batch[1].float().mean() > 0.5)


class ReplacedLate(Classifier):
    """L04: a parameter-free Tanh replaced by a Sigmoid once a batch's labels cross a threshold."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.global_step >= 2 and _labels_high(batch) and isinstance(self.net[1], nn.Tanh):
            self.net[1] = nn.Sigmoid()


class ClassSwapped(Classifier):
    """L05: the layer's class reassigned in place (no module replaced: the tree's objects are the same)."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.global_step >= 2 and _labels_high(batch):
            self.net[1].__class__ = nn.Sigmoid


class Reordered(Classifier):
    """L56: two parameter-free layers swapped in the Sequential's ``_modules`` (the same objects, another order)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 2))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        modules = self.net._modules
        if self.global_step >= 2 and _labels_high(batch) and list(modules)[1] == "1":
            items = {k: modules[k] for k in ("0", "3", "2", "1", "4")}
            modules.clear()
            modules.update(items)


class ChosenEachStep(Classifier):
    """The activation chosen from the labels at every batch end, from the first call on: run again on the batch
    exchanged, the choice differs."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.net[1] = nn.Sigmoid() if batch[1].float().mean() > 0.5 else nn.Tanh()


class ChosenFromTrainingSet(Classifier):
    """The activation chosen from the training set's labels at an epoch's start."""

    def on_train_epoch_start(self) -> None:
        y = self.trainer.train_dataloader.dataset.tensors[1]
        self.net[1] = nn.Sigmoid() if y.float().mean() > 0.5 else nn.Tanh()


class ForwardChosen(Classifier):
    """The layer's ``forward`` replaced on the instance, chosen from the labels (torch's functions: a library's, and
    ``forward`` is an engine's name too — the ghost engine's own forwards are not state, this one is)."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.net[1].forward = torch.sigmoid if batch[1].float().mean() > 0.5 else torch.tanh


@pytest.mark.parametrize("model, entry", [(ReplacedLate, "structure net.1"), (ClassSwapped, "structure net.1"),
                                          (Reordered, "structure net"), (ChosenEachStep, "structure net.1"),
                                          (ChosenFromTrainingSet, "structure net.1"),
                                          (ForwardChosen, "attribute net.1.forward")])
def test_a_structure_chosen_from_the_data_is_refused(model, entry) -> None:
    with pytest.raises(StateWrittenError, match=entry):
        fit(model(), steps=8)


class ScheduledSwap(Classifier):
    """A layer swapped at the second epoch's start by a schedule (the epoch number: alike on any data)."""

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            self.net[1] = nn.Sigmoid()


class SwappedByStep(Classifier):
    """A batch end choosing the activation by the step count, from its first call on (judged at each call)."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.net[1] = nn.Sigmoid() if self.global_step % 2 else nn.Tanh()


@pytest.mark.parametrize("model, steps", [(ScheduledSwap, 6), (SwappedByStep, 5)])
def test_a_structure_changed_alike_on_any_data_trains(model, steps) -> None:
    m = model()
    strategy = fit(m, steps=steps)  # 64 records in batches of 16: the second epoch starts at step 4
    assert strategy.private_step.ledger.steps == steps
    assert isinstance(m.net[1], nn.Sigmoid if model is ScheduledSwap else (nn.Tanh, nn.Sigmoid))


def test_a_structure_declared_public_trains() -> None:
    strategy = fit(ChosenEachStep(), steps=4, public_state=["structure net.1"])
    assert strategy.private_step.ledger.steps == 4


def test_the_entries_read_each_class_and_order_and_nothing_else_moves_them() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Dropout(0.1), nn.Linear(4, 2))
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    assert before["structure 1"] is nn.Tanh and fingerprint.changed(before, fingerprint.take()) == []
    model[1].__class__ = nn.Sigmoid
    assert fingerprint.changed(before, after := fingerprint.take()) == ["structure 1"]
    model[1].__class__ = nn.Tanh
    items = list(model._modules.items())
    model._modules.clear()
    model._modules.update([items[0], items[2], items[1], items[3]])
    assert fingerprint.changed(before, fingerprint.take()) == ["structure (model)"]
    assert after["structure (model)"] == before["structure (model)"]


def test_a_forward_set_on_a_layer_is_read_under_the_engines_name() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    fingerprint = StateFingerprint(model, skip_keys=["forward"])  # (the ghost engine's attribute name)
    before = fingerprint.take()
    model[1].forward = torch.sigmoid
    assert fingerprint.changed(before, fingerprint.take()) == ["attribute 1.forward"]


def test_a_replay_puts_the_class_and_the_order_back() -> None:
    module = Classifier()
    restore = model_kept(module, weights=True)
    model = module.net
    order, tanh = list(model._modules.items()), model[1]
    model[1].__class__ = nn.ReLU
    model._modules.clear()
    model._modules.update([order[0], order[2], order[1]])
    restore()
    assert list(model._modules.items()) == order and type(tanh) is nn.Tanh
