"""StateSnapshot (lightning_dp/validators/snapshot.py): what the probe's and the checks' passes write is put back,
whatever the user's objects hold (NumPy arrays written in place, NumPy scalars, read-only arrays)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import quiet_trainer
from lightning_dp import DPStrategy, PrivacyConfigurationError
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


def test_an_underscored_attribute_a_pass_added_on_a_users_object_is_removed_a_libraries_is_kept():
    """A private attribute made lazily by the user's code (``self._n = 0`` at a hook's first call) goes away with
    the pass that made it, as a public one does; one torch's own layer or the engine (``_dp_``) makes is left."""

    class Users(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

    model, holder = Users(), Holder()
    snapshot = StateSnapshot(model, callbacks=[holder])
    model._n, holder._seen, model.count_ = 1, True, 3
    model._dp_engine_note, model.layer._lazily_cached = "engine", "torch's"
    snapshot.restore()
    assert not hasattr(model, "_n") and not hasattr(holder, "_seen") and not hasattr(model, "count_")
    assert model._dp_engine_note == "engine" and model.layer._lazily_cached == "torch's"


def _lazy_fit(kind: str) -> pl.LightningModule:
    class Lazy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.net(x)
            return out * 2 if getattr(self, "_positive", False) else out

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            if kind == "counter":  # lazily made private state, alike on any data
                if not hasattr(self, "_steps"):
                    self._steps = 0
                    self._handle = self.net[0].register_forward_hook(lambda m, i, o: None)  # a logging hook
                self._steps += 1
            elif not hasattr(self, "_positive"):  # made lazily too, but chosen by the batch's labels
                self._positive = bool(batch[1].float().mean() > 0.5)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 4, generator=g)
    model = Lazy()
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0), max_steps=6).fit(
        model, DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=40))
    return model


def test_private_state_made_lazily_at_a_hooks_first_call_trains_and_one_the_labels_choose_is_refused():
    assert _lazy_fit("counter")._steps == 6  # (refused on main before: 'attribute _steps')
    with pytest.raises(PrivacyConfigurationError, match="attribute _positive"):
        _lazy_fit("chosen")
