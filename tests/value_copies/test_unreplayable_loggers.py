"""A user's logger that cannot be rebuilt for the runs that judge a decision (it holds a sqlite connection or a file
open: zoo30 x01, x02) is not trusted there: a decision judged is refused, naming it, what deepcopy said and the fixes
(value_copies/refed_loggers.py); without a decision it trains; one with a ``__deepcopy__`` of its own (a new lock for
the copy) is rebuilt and judged."""

from __future__ import annotations

import copy
import sqlite3
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.loggers.logger import Logger
from torch.utils.data import DataLoader
from user_loggers import UserLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class HeldDatabase(UserLogger):
    """zoo30 x01: a sqlite connection opened in ``__init__`` and kept; one row per step, the first one kept."""

    NAME = "held_database"

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = str(path)
        self.connection = sqlite3.connect(self.path, check_same_thread=False)
        self.connection.execute("create table if not exists m (step integer primary key, v real)")

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        if "train_loss" in metrics:
            self.connection.execute("insert or ignore into m values (?, ?)", (step, float(metrics["train_loss"])))
            self.connection.commit()

    def last(self) -> Optional[float]:
        reader = sqlite3.connect(self.path)
        row = reader.execute("select v from m order by step desc limit 1").fetchone()
        reader.close()
        return row[0] if row else None


class HeldFile(UserLogger):
    """zoo30 x02: a text file opened in ``__init__`` and kept open (append), one line per step, flushed."""

    NAME = "held_file"

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = str(path)
        self.file = open(self.path, "a")

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        with open(self.path) as kept:
            if "train_loss" in metrics and not any(line.startswith(f"{step} ") for line in kept):
                self.file.write(f"{step} {float(metrics['train_loss'])}\n")
                self.file.flush()

    def last(self) -> Optional[float]:
        with open(self.path) as kept:
            lines = [line for line in kept.read().split("\n") if line]
        return float(lines[-1].split()[1]) if lines else None


class OwnCopy(UserLogger):
    """Keeps the values logged under ``key`` as ``int(v * 1000)`` and holds a lock (it does not deep-copy); its
    ``__deepcopy__`` gives the copy a new lock, the rest copied."""

    NAME = "own_copy"

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key, self.hist, self.lock = key, [], threading.Lock()

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        if self.key in metrics:
            with self.lock:
                self.hist.append(int(float(metrics[self.key]) * 1000))

    def last(self) -> Optional[float]:
        return self.hist[-1] / 1000 if self.hist else None

    def __deepcopy__(self, memo: dict) -> "OwnCopy":
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in vars(self).items() if k != "lock"})
        new.lock = threading.Lock()
        return new


class RateFromLogger(pl.Callback):
    """The learning rate set from the last value the logger keeps, at each epoch's start (a decision judged)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.loggers[0].last()
        if value is not None:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.1 * value


class Reads(pl.Callback):
    """Reads the logger's last value at each epoch's start, and neither decides nor keeps anything (no run judges)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert trainer.loggers[0].last() is None or trainer.current_epoch > 0


class HalvesOnPlateau(pl.Callback):
    """A plateau rule on the held-out loss the logger keeps (sound: judged, and it trains)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        kept = trainer.loggers[0].hist
        if len(kept) >= 2 and kept[-1] > kept[-2] - 1000:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] *= 0.5


class LogsLosses(Classifier):
    """Logs its training loss every step, and a held-out loss."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))


def _fit(logger: Logger, callback: pl.Callback) -> tuple[Any, LogsLosses]:
    dp, model = strategy(noise_multiplier=0.1), LogsLosses()
    trainer = quiet_trainer(strategy=dp, max_epochs=4, logger=logger, num_sanity_val_steps=0, callbacks=[callback],
                            log_every_n_steps=1)
    trainer.fit(model, loader(), DataLoader(data(32, seed=7), batch_size=16))
    return dp, model


HELD = {"x01-sqlite-connection": (HeldDatabase, "runs.db", "sqlite3.Connection"),
        "x02-open-file": (HeldFile, "ext.txt", "TextIOWrapper")}


@pytest.mark.parametrize("case", list(HELD))
def test_a_decision_judged_from_a_logger_holding_a_store_open_is_refused_with_the_fixes(case, tmp_path):
    cls, name, held = HELD[case]
    logger = cls(tmp_path / name)
    with pytest.warns(UserWarning, match=f"the logger {cls.__name__} cannot be rebuilt"), \
            pytest.raises(PrivacyConfigurationError) as refused:
        _fit(logger, RateFromLogger())
    message = str(refused.value)
    assert f"The logger {cls.__name__} cannot be rebuilt" in message and held in message, "named, with deepcopy's word"
    assert "inside each log_metrics call" in message and "__deepcopy__" in message and "CSVLogger" in message
    assert "0." not in message.split("rule 6")[0].replace("(docs/", ""), "no logged value quoted"


@pytest.mark.parametrize("case", list(HELD))
def test_the_same_logger_with_no_decision_judged_trains(case, tmp_path):
    cls, name, _ = HELD[case]
    logger = cls(tmp_path / name)
    with pytest.warns(UserWarning, match=f"the logger {cls.__name__} cannot be rebuilt .* it trains, but a decision"):
        dp, model = _fit(logger, Reads())
    assert dp.ledger.entries[-1].steps == 16 and model.optimizers().param_groups[0]["lr"] == 1.0
    assert logger.last() is not None and 0 < logger.last() < 10, "it logged the real losses"


def test_a_logger_with_a_deepcopy_of_its_own_is_rebuilt_and_judged():
    logger = OwnCopy("train_loss")
    with pytest.raises(PrivacyConfigurationError, match="from the training data") as refused:
        _fit(logger, RateFromLogger())
    assert "cannot be rebuilt" not in str(refused.value), "rebuilt: the decision is judged, and leaks"
    assert 0 < logger.last() < 10, "put back after the runs"
    logger = OwnCopy("val_loss")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp, model = _fit(logger, HalvesOnPlateau())
    assert not [w for w in caught if "the logger OwnCopy" in str(w.message)], "rebuilt: not named in a warning"
    assert dp.ledger.entries[-1].steps == 16 and model.optimizers().param_groups[0]["lr"] < 1.0, "judged, and trains"
    assert len(logger.hist) == 4 and all(0 < v < 10_000 for v in logger.hist)
