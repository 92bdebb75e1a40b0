"""The Python numbers and strings the user's state holds, given other values for a judged hook's run again
(fingerprints/held_numbers.py): data-derived values move, public ones (declared, saved hyper-parameters, parameter-group
settings, counters, the framework's own) stay, and every value is bound back."""

from __future__ import annotations

import types

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_dp.fingerprints.held_numbers import held_numbers, other


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)  # torch's: its in_features are not walked
        self.stat = 0.25


class Model(pl.LightningModule):
    def __init__(self, lr: float = 0.1, hidden: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.hidden, self.alias = lr, hidden, lr  # saved: public
        self.encoder = Encoder()
        self.count = 37
        self.name = "records: a, b"
        self.counts = [3, 5]
        self.stats = {"mean": 0.5, "n": 4, "flag": True}
        self.steps = 12  # a counter in step with the trainer's
        self.weight_decay = 0.01  # a parameter group's setting
        self.declared = 1.5
        self.flag = True  # a bool: left


def test_data_derived_values_move_public_ones_stay_and_all_come_back():
    model = Model()
    callback = types.SimpleNamespace(extent=(0.5, 2.0))
    found = held_numbers([("model", model), ("Extent", callback)], public=["declared"],
                         settings=[model.hparams, {"lr": 0.2, "weight_decay": 0.01}], counters=[12])
    assert sorted(found.names) == ["Extent.extent", "count", "counts", "encoder.stat", "name", "stats"]
    before = {name: getattr(model, name) for name in ("count", "name", "counts", "stats", "lr", "steps")}
    with found.exchanged():
        assert model.count != 37 and model.name != "records: a, b" and model.counts != [3, 5]
        assert model.stats["mean"] != 0.5 and model.stats["n"] != 4 and model.stats["flag"] is True
        assert model.encoder.stat != 0.25 and callback.extent != (0.5, 2.0)
        assert model.lr == 0.1 and model.steps == 12 and model.declared == 1.5
    assert {name: getattr(model, name) for name in before} == before
    assert model.counts is before["counts"] and model.encoder.stat == 0.25 and callback.extent == (0.5, 2.0)


def test_other_values_differ_for_every_value_of_each_kind():
    for value in (0.0, -0.4, -1.0, 1e300, float("inf"), float("nan"), 0, 1, -7, "", "ab", [1, 2], (0.5,)):
        changed = other(value)
        assert type(changed) is type(value) and repr(changed) != repr(value)
    assert other(True) is True and other(None) is None
