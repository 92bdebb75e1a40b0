"""StateSnapshot (lightning_dp/validators/snapshot.py): what the probe's and the checks' passes write is put back,
whatever the user's objects hold (NumPy arrays written in place, NumPy scalars, read-only arrays)."""

from __future__ import annotations

import collections

import numpy as np
import torch
from torch import nn

from lightning_dp.validators.snapshot import StateSnapshot


class Holder:
    """A callback-like object with NumPy state of every kind."""

    def __init__(self) -> None:
        self.running = np.zeros(3)
        self.best = np.float64(0.5)
        self.frozen = np.frombuffer(np.arange(3.0).tobytes())  # read-only
        self.count = 0


def test_numpy_state_is_restored_and_immutable_numpy_values_do_not_break_the_restore():
    holder, model = Holder(), nn.Linear(2, 2)
    running, frozen = holder.running, holder.frozen
    assert not frozen.flags.writeable
    snapshot = StateSnapshot(model, callbacks=[holder])
    holder.running += 7.0  # written in place by a pass
    holder.best = np.float64(0.9)  # rebound
    holder.count = 5
    with torch.no_grad():
        model.weight.add_(0.0)
    snapshot.restore()
    assert holder.running is running and np.array_equal(holder.running, np.zeros(3))
    assert holder.best == np.float64(0.5) and holder.count == 0
    assert holder.frozen is frozen and np.array_equal(frozen, np.arange(3.0))


COUNT = 0
ITEMS: list[int] = [1, 2]
TABLE: dict[str, int] = {"a": 1}


class Namespace:
    """Data in a class body of the user's module (a mutable configuration)."""

    temperature = 1.0
    history: list[float] = []


def test_the_user_modules_globals_and_class_bodies_are_restored():
    import sys

    global COUNT, TABLE
    items, table, history = ITEMS, TABLE, Namespace.history
    snapshot = StateSnapshot(nn.Linear(2, 2), modules=[sys.modules[__name__]])
    COUNT += 3  # rebound
    ITEMS.append(3)  # appended in place
    TABLE["b"] = 2
    TABLE = {"c": 3}  # rebound to a new dict
    Namespace.temperature = 2.5
    Namespace.history.append(0.1)
    globals()["ADDED_BY_A_PASS"] = 1
    snapshot.restore()
    assert COUNT == 0
    assert ITEMS is items and ITEMS == [1, 2]
    assert TABLE is table and TABLE == {"a": 1}
    assert Namespace.temperature == 1.0 and Namespace.history is history and history == []
    assert "ADDED_BY_A_PASS" not in globals()


VOCABULARY = collections.Counter(alpha=5, beta=2)
ORDER = collections.OrderedDict(b=1, a=2)


def test_a_counter_and_an_ordered_dict_come_back_as_they_were():
    """newcomer30: a module's vocabulary Counter that no hook touched came back as counts of its (word, count) pairs
    (``Counter.update`` counts), read as written: refused, and the user's data changed."""
    import sys

    snapshot = StateSnapshot(nn.Linear(2, 2), modules=[sys.modules[__name__]])
    VOCABULARY["gamma"] += 1
    ORDER.move_to_end("b")
    snapshot.restore()
    assert list(VOCABULARY.items()) == [("alpha", 5), ("beta", 2)]
    assert list(ORDER.items()) == [("b", 1), ("a", 2)]


def test_which_parameters_train_is_restored():
    """A pass that unfreezes a layer (or freezes one) leaves the trainable set as it found it."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].weight.requires_grad_(False)
    snapshot = StateSnapshot(model)
    model[0].weight.requires_grad_(True)
    model[1].bias.requires_grad_(False)
    snapshot.restore()
    assert [p.requires_grad for p in model.parameters()] == [False, True, True, True]


def test_inference_tensors_a_metric_kept_from_trainer_test_do_not_break_the_snapshot():
    """trainer.test() before a private fit leaves torchmetrics' states as inference tensors (qa13 d3): no version
    counter to read, and nothing outside inference mode can write them in place; rebinding is still put back."""
    model = nn.Linear(2, 2)
    with torch.inference_mode():
        model.tp = torch.zeros(3)
    kept = model.tp
    snapshot = StateSnapshot(model)
    model.tp = torch.ones(3)  # rebound by a pass
    snapshot.restore()
    assert model.tp is kept and not model.tp.any()
