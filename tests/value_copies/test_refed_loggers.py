"""A user's own logger rebuilt for a run: its state at the fit's start re-fed the recorded calls with the values moved
(value_copies/refed_loggers.py)."""

from __future__ import annotations

import collections
import copy
import pickle
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.loggers import CSVLogger
from user_loggers import UserLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.value_copies import refed_loggers  # noqa: E402
from lightning_dp.value_copies.refed_loggers import Refeeds, users  # noqa: E402


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


def test_past_the_recorded_calls_a_decision_judged_is_refused_and_raising_when_re_fed_it_is_searched(monkeypatch):
    monkeypatch.setattr(refed_loggers, "CALLS", 4)
    logger = Kept()
    refeeds = Refeeds([logger], lambda lg: [], time.time())
    with pytest.warns(UserWarning, match="the logger Kept received more than 4 calls"):
        _fed(logger)
    with refeeds.moved(set(), MOVES) as rebuilt:  # nothing logged moved: nothing judged
        assert rebuilt == set()
    with pytest.raises(PrivacyConfigurationError, match=r"The logger Kept cannot be rebuilt .*received more than 4 "
                       r"calls.*Fix: log fewer calls \(Trainer\(log_every_n_steps"):
        with refeeds.moved({"train_loss"}, MOVES):
            pass
    assert logger.hist == [500, 250, 125] and refeeds.refed[0].calls == [], "the calls recorded dropped"
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


def _methods(cls: type) -> dict[str, object]:
    """The class's own attributes (not ``__slotnames__``: pickling's cache)."""
    return {k: v for k, v in vars(cls).items() if k != "__slotnames__"}


def test_only_the_recorded_instances_are_changed_each_recorded_and_put_back():
    before = _methods(Kept)
    first, second, other = Kept(), Kept(), Kept()
    refeeds = Refeeds([first, second], lambda lg: [], time.time())
    assert _methods(Kept) == before, "the class is never changed"
    assert "log_metrics" not in vars(other) and "save" not in vars(other)
    _fed(first)
    second.log_metrics({"train_loss": 0.5})
    other.log_metrics({"train_loss": 0.5})
    assert [len(r.calls) for r in refeeds.refed] == [6, 1], "each instance recorded, the other not"
    with refeeds.moved({"train_loss"}, MOVES) as rebuilt:
        assert rebuilt == {id(first), id(second)} and first.hist == [100500, -99750, 100125]
        assert second.hist == [100500] and other.hist == [500] and _methods(Kept) == before
    assert first.hist == [500, 250, 125] and second.hist == [500]
    copied = copy.deepcopy(first)
    unpickled = pickle.loads(pickle.dumps(second))
    copied.log_metrics({"train_loss": 1.0})
    unpickled.log_metrics({"train_loss": 1.0})
    assert copied.hist[-1] == unpickled.hist[-1] == 1000 and [len(r.calls) for r in refeeds.refed] == [6, 1], \
        "a copy calls its class's method, not recorded"
    refeeds.stop()
    assert _methods(Kept) == before and all("log_metrics" not in vars(lg) for lg in (first, second))


class LogsLoss(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss


class RateFromOne(pl.Callback):
    """Sets the rate from what the ``index``-th logger keeps (``int(v * 1000)``); notes the class as the fit sees it."""

    def __init__(self, index: int) -> None:
        self.index, self.seen = index, []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen.append((_methods(Kept), isinstance(trainer.logger, Kept)))
        hist = trainer.loggers[self.index].hist
        if hist:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.1 * hist[-1] / 1000


@pytest.mark.parametrize("index", [0, 1])
def test_in_a_fit_two_loggers_of_one_class_are_each_rebuilt_and_the_class_never_changes(index):
    before, loggers, callback = _methods(Kept), [Kept(), Kept()], RateFromOne(index)
    trainer = quiet_trainer(strategy=strategy(noise_multiplier=0.1), max_epochs=3, logger=loggers, callbacks=[callback])
    with pytest.raises(PrivacyConfigurationError, match=r"from the training data.*param_groups\[0\]\.lr"):
        trainer.fit(LogsLoss(), loader())  # kept as int(v * 1000): no search finds it, each logger rebuilt does
    assert callback.seen and all(seen == (before, True) for seen in callback.seen), "the class as it was, during"
    assert _methods(Kept) == before and all("log_metrics" not in vars(lg) and "save" not in vars(lg) for lg in loggers)
    assert all(lg.hist and all(0 < v < 10_000 for v in lg.hist) for lg in loggers), "each put back after the runs"
