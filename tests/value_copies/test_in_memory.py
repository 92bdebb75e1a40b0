"""The copies of logged values in memory, found by name and by value, moved and put back
(lightning_dp/value_copies/in_memory.py)."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import NamedTuple

import numpy as np
import torch

from lightning_dp.value_copies.in_memory import Walk
from lightning_dp.value_copies.logged_values import LoggedValues

A, B = float(torch.tensor(0.6412345)), float(torch.tensor(0.5923417))  # two epochs' losses, as the loggers keep them
FAR, NEAR = (lambda v: v + 100), (lambda v: v - 100)


class Row(NamedTuple):
    step: int
    name: str
    value: float


@dataclasses.dataclass(frozen=True)
class Record:
    step: int
    loss: float


class Store:
    def __init__(self) -> None:
        self.kept = [A, B]


class Logger:
    def __init__(self) -> None:
        self.deque = collections.deque([{"train_loss": A}, {"train_loss": B}], maxlen=50)
        self.rows = [(0, "train_loss", A), (0, "epoch", 0), (1, "train_loss", B)]
        self.named = [Row(0, "train_loss", A), Row(1, "train_loss", B)]
        self.records = [Record(0, A), Record(1, B)]
        self.store = Store()
        self.array = np.array([A, B, 7.25])
        self.tensor = torch.tensor([A, B])
        self.seen = {A}
        self.line = f"epoch 0 loss {A:.4f} lr 0.5"
        self.hparams = {"lr": 0.5, "momentum": 0.9, "decay": 0.0001234, "steps": 16}
        self.step, self.started = 3, time.time()
        self.path = "/tmp/run/0.6412345/metrics.csv"


def _walk() -> Walk:
    return Walk(LoggedValues({"train_loss"}, {"train_loss": [A, B]}, (FAR, NEAR)))


def test_every_kind_of_copy_moves_alternately_and_is_put_back():
    logger = Logger()
    before = {k: v for k, v in vars(logger).items()}
    deque, first_row = logger.deque, logger.deque[0]
    walk = _walk()
    walk.in_place(logger)
    assert logger.deque is deque and deque.maxlen == 50, "a top container moves in place"
    assert [r["train_loss"] for r in deque] == [A + 100, B - 100] and first_row["train_loss"] == A
    assert [r[2] for r in logger.rows] == [A + 100, 0, B - 100], "the name is a value beside it: the step stays"
    assert [r.value for r in logger.named] == [A + 100, B - 100] and isinstance(logger.named[0], Row)
    assert [r.loss for r in logger.records] == [A + 100, B - 100] and logger.records[0].step == 0
    assert logger.store is not before["store"] and logger.store.kept == [A + 100, B - 100]
    assert logger.array.tolist() == [A + 100, B - 100, 7.25] and before["array"][0] == A
    assert torch.allclose(logger.tensor, torch.tensor([A + 100, B - 100]))
    assert logger.seen == {A + 100}
    assert logger.line == f"epoch 0 loss {0.6412 + 100!r} lr 0.5", "a line of text: its number rounded to 4 digits"
    assert logger.hparams == before["hparams"] and logger.step == 3 and logger.started == before["started"]
    assert logger.path == before["path"], "a path is not text"
    logger.deque.append({"train_loss": 9.0})  # a hook run again logs: dropped after
    logger.rows = []
    walk.put_back()
    assert all(vars(logger)[k] is v for k, v in before.items())
    assert list(deque) == [first_row, before["deque"][1]] and [r["train_loss"] for r in deque] == [A, B]
    assert logger.store.kept == [A, B] and logger.array.tolist() == [A, B, 7.25]


def test_a_name_keys_its_values_whole_or_not_and_nothing_else_moves():
    holder = type("Holder", (), {})()
    holder.history = {"train_loss": [1, 2.5, 3], "val_loss": [A]}
    holder.epochs = [0, 1, 2]
    walk = Walk(LoggedValues({"train_loss"}, {}, (FAR, NEAR)))
    walk.in_place(holder)
    assert holder.history == {"train_loss": [101, -97.5, 103], "val_loss": [A]} and holder.epochs == [0, 1, 2]
    walk.put_back()
    assert holder.history == {"train_loss": [1, 2.5, 3], "val_loss": [A]}


def test_a_cycle_and_a_library_object_are_walked_once_or_not_at_all():
    holder = type("Holder", (), {})()
    holder.rows = [{"train_loss": A}]
    holder.rows.append(holder.rows)  # a list holding itself
    holder.module = torch.nn.Linear(1, 1)
    holder.module.loss = A
    walk = _walk()
    walk.in_place(holder)
    assert holder.rows[0] == {"train_loss": A + 100} and holder.module.loss == A
    walk.put_back()
    assert holder.rows[0] == {"train_loss": A}
