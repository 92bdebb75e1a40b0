"""A user's own logger rebuilt for a run: its state at the fit's start re-fed the recorded calls with the values moved
(value_copies/refed_loggers.py)."""

from __future__ import annotations

import collections
import time
from typing import Optional

import pytest
from pytorch_lightning.loggers import CSVLogger
from user_loggers import UserLogger

from lightning_dp.value_copies import refed_loggers
from lightning_dp.value_copies.refed_loggers import Refeeds, users


class Kept(UserLogger):
    """Keeps ``train_loss`` as ``int(v * 1000)`` in a list, the held-out loss in a deque."""

    NAME = "kept"

    def __init__(self) -> None:
        super().__init__()
        self.hist: list[int] = []
        self.held_out: collections.deque = collections.deque(maxlen=10)
        self.saves = 0


    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        if "train_loss" in metrics:
            self.hist.append(int(metrics["train_loss"] * 1000))
        if "val_loss" in metrics:
            self.held_out.append(metrics["val_loss"])

    def save(self) -> None:
        self.saves += 1


MOVES = (lambda v: v + 100, lambda v: v - 100)


def _fed(logger: Kept) -> None:
    for i, loss in enumerate((0.5, 0.25, 0.125)):
        logger.log_metrics(metrics={"train_loss": loss, "val_loss": 0.75, "epoch": i}, step=i)
        logger.save()


def test_the_users_logger_is_rebuilt_from_the_moved_calls_and_put_back():
    logger, csv = Kept(), CSVLogger("unused")
    refeeds = Refeeds([logger, csv], lambda lg: [], time.time())
    assert [r.logger for r in refeeds.refed] == [logger] and not users(csv), "Lightning's loggers: searched"
    hist, held_out = logger.hist, logger.held_out
    _fed(logger)
    with refeeds.moved({"train_loss"}, MOVES) as rebuilt:
        assert rebuilt == {id(logger)}
        assert logger.hist is hist and hist == [100500, -99750, 100125], "alternately, in the list held before"
        assert list(held_out) == [0.75] * 3 and logger.saves == 3
        logger.log_metrics({"train_loss": 9.0})  # what the run logs: not recorded, dropped
    assert logger.hist is hist and hist == [500, 250, 125] and logger.saves == 3
    refeeds.stop()
    assert "log_metrics" in vars(Kept) and not hasattr(vars(Kept)["log_metrics"], "__lightning_dp_own__")
    assert "save" in vars(Kept) and len(refeeds.refed[0].calls) == 6, "the run's call was not recorded"


def test_past_the_recorded_calls_or_raising_when_re_fed_the_logger_is_named_and_searched(monkeypatch):
    monkeypatch.setattr(refed_loggers, "CALLS", 4)
    logger = Kept()
    refeeds = Refeeds([logger], lambda lg: [], time.time())
    with pytest.warns(UserWarning, match="the logger Kept received more than 4 calls"):
        _fed(logger)
    with refeeds.moved({"train_loss"}, MOVES) as rebuilt:
        assert rebuilt == set() and logger.hist == [500, 250, 125]
    refeeds.stop()
    monkeypatch.setattr(refed_loggers, "CALLS", 100)
    logger = Kept()
    refeeds = Refeeds([logger], lambda lg: [], time.time())
    _fed(logger)
    with pytest.warns(UserWarning, match="the logger Kept raised OverflowError when fed its calls again"):
        with refeeds.moved({"train_loss"}, (lambda v: float("inf"), lambda v: v)) as rebuilt:
            assert rebuilt == set() and logger.hist == [500, 250, 125]
    assert logger.hist == [500, 250, 125] and logger.saves == 3
    refeeds.stop()
