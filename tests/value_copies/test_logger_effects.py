"""What a user's logger writes outside its copied state, set apart for each run that feeds it again, put back after
(value_copies/logger_effects.py; zoo30 l04, l04b, l13-l17)."""

from __future__ import annotations

import os
import socket
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from user_loggers import UserLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.value_copies.logger_effects import Effects  # noqa: E402
from lightning_dp.value_copies.refed_loggers import Refeeds  # noqa: E402


def test_a_path_first_written_is_set_apart_as_before_it_and_put_back_even_on_an_exception(tmp_path):
    kept, made = tmp_path / "kept.txt", tmp_path / "made.txt"
    kept.write_text("before\n")
    effects = Effects()
    with effects.recording("log_metrics"):
        with open(kept, "a") as file:
            file.write("real\n")
        made.write_text("real\n")
        assert kept.read_text() == "before\nreal\n"
    with open(kept) as file:  # read, outside a recorded call: not watched
        file.read()
    assert set(effects.first) == {str(kept), str(made)} and effects.undoable is None
    with pytest.raises(RuntimeError, match="inside"):
        with effects.set_apart():
            assert kept.read_text() == "before\n" and not made.exists(), "as before the first write"
            with effects.replaying():
                with open(kept, "a") as file:
                    file.write("moved\n")
                (tmp_path / "new").mkdir()
                (tmp_path / "new" / "other.txt").write_text("moved\n")
            raise RuntimeError("inside")
    assert kept.read_text() == "before\nreal\n" and made.read_text() == "real\n", "the real contents put back"
    assert not (tmp_path / "new").exists(), "what the run made is removed"


def test_a_sqlite_database_and_its_siblings_are_set_apart(tmp_path):
    path = tmp_path / "runs.db"
    effects = Effects()
    with effects.recording("log_metrics"):
        connection = sqlite3.connect(path)
        connection.execute("create table m (step integer primary key, v real)")
        connection.execute("insert or ignore into m values (0, 0.5)")
        connection.commit()
        connection.close()
    assert str(path) in effects.first and f"{path}-journal" in effects.first
    with effects.set_apart():
        assert not path.exists()
        with effects.replaying():
            connection = sqlite3.connect(path)
            connection.execute("create table m (step integer primary key, v real)")
            connection.execute("insert or ignore into m values (0, 100.5)")
            connection.commit()
            connection.close()
    connection = sqlite3.connect(path)
    assert connection.execute("select v from m").fetchall() == [(0.5,)]
    connection.close()


def _connect() -> None:
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=0.05).close()  # the discard port, closed here
    except OSError:
        pass


def test_what_cannot_be_set_apart_is_noted_and_blocked_in_a_run():
    effects = Effects()
    with effects.recording("save"):
        _connect()
    assert effects.undoable == "connected a socket in save"
    with effects.set_apart(), effects.replaying():
        with pytest.raises(PermissionError, match="not done"):
            socket.socket().connect(("127.0.0.1", 9))


class Outside(UserLogger):
    """Writes ``train_loss`` (and keeps each value it was sent in ``sent``) to a store outside its folders: its path in
    a tuple, not an attribute naming a path, so the searched loggers' places never hold it."""

    NAME = "outside"

    def __init__(self, store: str, kind: str) -> None:
        super().__init__()
        self.store, self.kind, self.sent = (store,), kind, []

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        if "train_loss" not in metrics:
            return
        value, path = float(metrics["train_loss"]), self.store[0]
        self.sent.append(value)
        if self.kind == "text":  # one line per epoch, the first kept
            lines = open(path).read().split() if os.path.exists(path) else []
            if not any(line.startswith(f"{metrics['epoch']}:") for line in lines):
                with open(path, "a") as file:
                    file.write(f"{metrics['epoch']}:{value!r}\n")
        elif self.kind == "socket":
            _connect()
        else:  # a sqlite database: "ignore" keeps the first row of an epoch, "replace" the last
            connection = _db(path)
            connection.execute(f"insert or {self.kind} into m values (?, ?)", (int(metrics["epoch"]), value))
            connection.commit()
            connection.close()


def _db(path: str) -> sqlite3.Connection:
    connection = sqlite3.connect(path)
    connection.execute("create table if not exists m (step integer primary key, v real)")
    return connection


def _last(logger: Outside) -> Optional[float]:
    path = logger.store[0]
    if logger.kind == "text":
        return float(open(path).read().split()[-1].split(":")[1]) if os.path.exists(path) else None
    connection = _db(path)
    row = connection.execute("select v from m order by step desc limit 1").fetchone()
    connection.close()
    return row[0] if row else None


def _kept(logger: Outside) -> list[float]:
    path = logger.store[0]
    if logger.kind == "text":
        return [float(line.split(":")[1]) for line in open(path).read().split()]
    connection = _db(path)
    rows = [v for _, v in connection.execute("select step, v from m order by step").fetchall()]
    connection.close()
    return rows


class LogsLoss(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss


class Plateau(pl.Callback):
    """At an epoch's start, the rate set from the last value the store holds (``alike``: 0.05 whenever it holds one,
    a decision that does not depend on it)."""

    def __init__(self, alike: bool = False) -> None:
        self.alike = alike

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        last = _last(trainer.loggers[0])
        if last is not None:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.05 if self.alike else 0.1 * last


def _fit(logger: Outside, callbacks: list[pl.Callback]) -> None:
    trainer = quiet_trainer(strategy=strategy(noise_multiplier=0.1), max_epochs=3, logger=logger, callbacks=callbacks,
                            default_root_dir=str(Path(logger.store[0]).parents[1] / "logs"))
    trainer.fit(LogsLoss(), loader())


def _outside(tmp_path: Path, name: str) -> str:
    (tmp_path / "outside").mkdir()
    return str(tmp_path / "outside" / name)


@pytest.mark.parametrize("kind, name", [("ignore", "runs.db"), ("replace", "runs.db"), ("text", "losses.txt")])
def test_a_rate_read_back_from_a_store_outside_the_loggers_folder_is_refused_and_the_store_kept_real(tmp_path, kind,
                                                                                                     name):
    logger = Outside(_outside(tmp_path, name), kind)
    with pytest.raises(PrivacyConfigurationError, match=r"from the training data.*param_groups\[0\]\.lr"):
        _fit(logger, [Plateau()])  # fed again into the real store, the moved values were ignored or left there
    assert logger.sent and _kept(logger) == logger.sent, "the store holds what the real calls wrote, nothing moved"


def test_an_accepted_decision_leaves_the_store_as_the_real_calls_wrote_it(tmp_path):
    logger = Outside(_outside(tmp_path, "runs.db"), "replace")
    _fit(logger, [Plateau(alike=True)])  # the runs feed it again (moved values replace the rows there), then put back
    assert len(logger.sent) == 3 and _kept(logger) == logger.sent


def test_the_safe_twin_a_store_outside_no_decision_reading_it_trains(tmp_path):
    logger = Outside(_outside(tmp_path, "runs.db"), "replace")
    _fit(logger, [])
    assert len(logger.sent) == 3 and _kept(logger) == logger.sent


def test_a_logger_that_connects_a_socket_is_named_when_a_decision_is_judged(tmp_path):
    logger = Outside(_outside(tmp_path, "runs.db"), "socket")
    named = "The logger Outside connected a socket in log_metrics.*finalize"
    with pytest.raises(PrivacyConfigurationError, match=named):
        _fit(logger, [_RateFromCallbackMetrics()])
    (tmp_path / "twin").mkdir()
    _fit(Outside(_outside(tmp_path / "twin", "runs.db"), "socket"), [])  # no decision judged: trains


class _RateFromCallbackMetrics(pl.Callback):
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.1 * float(loss)


def test_what_the_runs_hooks_make_the_rebuilt_logger_write_elsewhere_is_put_back(tmp_path):
    logger = Outside(_outside(tmp_path, "losses.txt"), "text")
    refeeds = Refeeds([logger], lambda lg: [], time.time())
    logger.log_metrics({"train_loss": 0.5, "epoch": 0})
    with refeeds.moved({"train_loss"}, (lambda v: v + 100, lambda v: v - 100)) as rebuilt:
        assert rebuilt == {id(logger)} and _kept(logger) == [100.5], "the store as the moved calls make it"
        logger.log_metrics({"train_loss": 0.25, "epoch": 1})  # a hook of the run logs to it
        logger.store = (str(tmp_path / "outside" / "other.txt"),)
        logger.log_metrics({"train_loss": 0.25, "epoch": 1})  # to a path its real calls never wrote
    refeeds.stop()
    assert _kept(logger) == [0.5] and logger.sent == [0.5] and os.listdir(tmp_path / "outside") == ["losses.txt"]
