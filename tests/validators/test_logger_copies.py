"""Logged values read back through the logger object (validators/logger_copies.py, rule 6 of
docs/release_boundary.md): the replays that move the logged values move the loggers' own copies too, in memory and in
the CSVLogger's metrics.csv, and put them back after."""

from __future__ import annotations

import collections
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.logger import Logger
from torch.utils.data import DataLoader
from user_loggers import UserLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators import logger_copies  # noqa: E402
from lightning_dp.validators.hook_replays import moved_far  # noqa: E402


class History(UserLogger):
    """The in-memory logger of Lightning's tests and tutorials: every ``log_metrics`` call kept in ``history``."""

    NAME = "history"

    def __init__(self) -> None:
        super().__init__()
        self.history: list[dict[str, Any]] = []


    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.history.append(dict(metrics))


class LogsEpochLoss(Classifier):
    """Logs its training loss once an epoch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def halve_on_plateau(self, losses: list[float], drop: float = 0.3) -> None:
        """A plateau rule by hand: the rate halved unless the loss fell by ``drop`` since the last epoch (here at the
        second epoch's end: 0.64 to 0.41)."""
        if len(losses) >= 2 and losses[-1] > losses[-2] - drop:
            for group in self.optimizers().param_groups:
                group["lr"] *= 0.5


class PlateauFromHistory(LogsEpochLoss):
    """zoo26 b02: the rule reads the in-memory logger's history."""

    def on_train_epoch_start(self) -> None:
        self.halve_on_plateau([float(m["train_loss"]) for m in self.logger.history if "train_loss" in m])


class PlateauFromCsv(LogsEpochLoss):
    """zoo26 e01: the rule reads the CSVLogger's metrics.csv."""

    def on_train_epoch_start(self) -> None:
        path = Path(self.logger.experiment.metrics_file_path)
        if path.exists():
            with path.open() as file:
                self.halve_on_plateau([float(r["train_loss"]) for r in csv.DictReader(file) if r.get("train_loss")])


class TaskWeightsFromHistory(Classifier):
    """zoo26 b01: Dynamic Weight Average, the second task's weight from the last two epochs' losses in the history."""

    def __init__(self) -> None:
        super().__init__()
        self.w = 1.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        l1, l2 = torch.nn.functional.cross_entropy(out, y), (out ** 2).mean()
        self.log("l1", l1, on_step=False, on_epoch=True)
        self.log("l2", l2, on_step=False, on_epoch=True)
        return l1 + self.w * l2

    def on_train_epoch_start(self) -> None:
        h = [m for m in self.logger.history if "l1" in m]
        if len(h) >= 2:
            r1, r2 = h[-1]["l1"] / h[-2]["l1"], h[-1]["l2"] / h[-2]["l2"]
            self.w = 2 * math.exp(r2 / 2) / (math.exp(r1 / 2) + math.exp(r2 / 2))


class HalvesWhenLossRoseInHistory(Classifier):
    """A rule that compares the last two values only (the loss rose): moving every value of the history alike keeps
    their order, so only the alternate moves along the history set it apart. The logged value grows with the epoch, so
    the real run decides at its second epoch's start."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_stat", batch[0].abs().mean() * (self.current_epoch + 1), on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_start(self) -> None:
        h = [float(m["train_stat"]) for m in self.logger.history if "train_stat" in m]
        if len(h) >= 2 and h[-1] > h[-2]:
            for group in self.optimizers().param_groups:
                group["lr"] *= 0.5


def test_a_decision_from_the_order_of_the_history_is_refused():
    logger = History()
    with pytest.raises(PrivacyConfigurationError, match="from the training data"):
        _fit(HalvesWhenLossRoseInHistory(), logger, epochs=3)


def test_a_history_moves_alternately_along_its_values():
    holder = History()
    holder.history = [{"train_loss": 1.0}, {"val_loss": 5.0}, {"train_loss": 2.0}, {"train_loss": 3.0}]
    far, near = (lambda v: v + 100), (lambda v: v - 100)
    with logger_copies.moved([holder], {"train_loss"}, far, other=near):
        inside = [m.get("train_loss") for m in holder.history]
    assert inside == [101.0, None, -98.0, 103.0]
    assert [m.get("train_loss") for m in holder.history] == [1.0, None, 2.0, 3.0]


def _fit(model: pl.LightningModule, logger: Logger, epochs: int = 4, val: bool = False, **kwargs: Any) -> Any:
    dp = strategy(noise_multiplier=0.1)
    trainer = quiet_trainer(strategy=dp, max_epochs=epochs, logger=logger, num_sanity_val_steps=0, **kwargs)
    held_out = DataLoader(data(32, seed=7), batch_size=16) if val else None
    trainer.fit(model, loader(), held_out)
    return dp


@pytest.mark.parametrize("model", [PlateauFromHistory, TaskWeightsFromHistory], ids=["b02-plateau", "b01-dwa"])
def test_a_decision_from_the_in_memory_logger_history_is_refused(model):
    logger = History()
    with pytest.raises(PrivacyConfigurationError, match="from the training data"):
        _fit(model(), logger)
    assert all(v < 100 for m in logger.history for k, v in m.items() if k != "epoch"), "the history is put back"


def test_a_decision_from_the_csv_loggers_metrics_file_is_refused(tmp_path):
    logger = CSVLogger(tmp_path, name="run", flush_logs_every_n_steps=1)
    with pytest.raises(PrivacyConfigurationError, match="from the training data"):
        _fit(PlateauFromCsv(), logger)
    logger.save()
    with open(logger.experiment.metrics_file_path) as file:
        losses = [float(r["train_loss"]) for r in csv.DictReader(file) if r.get("train_loss")]
    assert losses and all(v < 100 for v in losses), "metrics.csv is put back"


class Validates(LogsEpochLoss):
    """Logs a held-out loss too."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))


class PlateauFromValidation(Validates):
    """The plateau rule by hand on the held-out loss the logger holds."""

    def on_train_epoch_start(self) -> None:
        self.halve_on_plateau([float(m["val_loss"]) for m in self.logger.history if "val_loss" in m], drop=1.0)


class ReducesOnPlateau(Validates):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, threshold=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


class PrintsHistory(pl.Callback):
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print("training losses:", [float(m["train_loss"]) for m in trainer.logger.history if "train_loss" in m])


def test_a_plateau_rule_on_the_held_out_loss_from_the_logger_trains():
    model, logger = PlateauFromValidation(), History()
    dp = _fit(model, logger, val=True)
    assert dp.ledger.steps == 16
    assert model.optimizers().param_groups[0]["lr"] < 1.0, "the rule halved the rate at least once"


def test_reduce_lr_on_plateau_on_the_held_out_loss_trains_with_a_csv_logger(tmp_path):
    dp = _fit(ReducesOnPlateau(), CSVLogger(tmp_path, name="run"), val=True)
    assert dp.ledger.steps == 16


def test_a_callback_printing_the_logger_history_at_train_end_trains(capsys):
    dp = _fit(LogsEpochLoss(), History(), callbacks=[PrintsHistory()])
    assert dp.ledger.steps == 16
    printed = capsys.readouterr().out.split("training losses: [")[1].split("]")[0].split(", ")
    assert len(printed) == 4 and all(float(v) < 100 for v in printed)


# ---------------------------------------------------------------- the copies moved and put back


class Holder:
    def __init__(self, path: str) -> None:
        self.history = [{"train_loss": 0.5, "epoch": 0},
                        {"fit-train_loss": torch.tensor(0.25), "val_loss": 0.7, "val-train_loss": 0.5}]
        self.series = {"train_loss": [0.5, 0.4], "other": (1.0,)}
        self.metrics_file_path = path
        self._prefix = "fit"


def test_the_copies_in_memory_and_in_a_csv_file_move_and_are_put_back(tmp_path):
    path = tmp_path / "metrics.csv"
    original = b"epoch,train_loss,val_loss\n0,0.5,0.7\n1,,0.6\n"
    path.write_bytes(original)
    holder = Holder(str(path))
    history, first, series = holder.history, holder.history[0], holder.series
    with logger_copies.moved([holder], {"train_loss"}, moved_far):
        assert holder.history is history, "the top list is moved in place (an alias reads the moved values)"
        assert history[0] == {"train_loss": 1500.0, "epoch": 0} and first["train_loss"] == 0.5
        assert float(history[1]["fit-train_loss"]) == 1250.0 and history[1]["val_loss"] == 0.7
        assert history[1]["val-train_loss"] == 0.5, "another prefix than the logger's: another value"
        assert series["train_loss"] == [1500.0, 1400.0] and series["other"] == (1.0,)
        with open(path) as file:
            rows = list(csv.DictReader(file))
        assert [r["train_loss"] for r in rows] == ["1500.0", ""] and [r["val_loss"] for r in rows] == ["0.7", "0.6"]
        holder.history.append({"train_loss": 9.0})  # a hook run again logs: dropped after
        holder.series = {}
    assert holder.history is history and history[0] is first and len(history) == 2
    assert holder.series is series and series["train_loss"] == [0.5, 0.4]
    assert path.read_bytes() == original


# ---------------------------------------------------------------- red team logcopies28: the copies found by value


class DequeLogger(History):
    """k01: the rows kept in a bounded ``collections.deque`` of dicts."""

    def __init__(self) -> None:
        super().__init__()
        self.history = collections.deque(maxlen=50)  # type: ignore[assignment]


class RowsLogger(History):
    """k02: a list of ``(step, name, value)`` rows: the logged name is a value beside the number, not a key."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.rows.extend((step or 0, name, value) for name, value in metrics.items())

    def losses(self, name: str) -> list[float]:
        return [float(v) for _, n, v in self.rows if n == name]


class JsonLinesLogger(History):
    """k03: one JSON line per ``log_metrics`` call in ``metrics.jsonl`` under its directory."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        with open(self.directory / "metrics.jsonl", "a") as file:
            file.write(json.dumps({"step": step, **metrics}) + "\n")

    def losses(self, name: str) -> list[float]:
        path = self.directory / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [float(r[name]) for r in rows if name in r]


class BareListsLogger(History):
    """k04: the values kept in plain lists of floats, no name beside them (found by value only)."""

    def __init__(self) -> None:
        super().__init__()
        self.mine: list[float] = []
        self.held_out: list[float] = []

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        for name, kept in (("train_loss", self.mine), ("val_loss", self.held_out)):
            if name in metrics:
                kept.append(metrics[name])

    def losses(self, name: str) -> list[float]:
        return list(self.mine if name == "train_loss" else self.held_out)


def _read(logger: Logger, name: str) -> list[float]:
    if isinstance(logger, (RowsLogger, JsonLinesLogger, BareListsLogger)):
        return logger.losses(name)
    return [float(m[name]) for m in logger.history if name in m]


class PlateauFromAnyCopy(Validates):
    """The plateau rule by hand in ``on_train_epoch_start`` on the un-noised epoch losses the logger holds."""

    def on_train_epoch_start(self) -> None:
        self.halve_on_plateau(_read(self.logger, "train_loss"))


class PlateauFromAnyCopyOnHeldOut(Validates):
    """Its safe twin: the same rule on the held-out loss the same logger holds."""

    def on_train_epoch_start(self) -> None:
        self.halve_on_plateau(_read(self.logger, "val_loss"), drop=1.0)


_CHANNELS = {"k01-deque": lambda tmp: DequeLogger(), "k02-rows": lambda tmp: RowsLogger(),
             "k03-jsonl": lambda tmp: JsonLinesLogger(tmp / "run"), "k04-bare-lists": lambda tmp: BareListsLogger()}


@pytest.mark.parametrize("channel", list(_CHANNELS))
def test_a_plateau_rule_on_a_copy_found_by_value_is_refused(channel, tmp_path):
    logger = _CHANNELS[channel](tmp_path)
    with pytest.raises(PrivacyConfigurationError, match="from the training data"):
        _fit(PlateauFromAnyCopy(), logger, val=True)
    assert _read(logger, "train_loss") and all(v < 100 for v in _read(logger, "train_loss")), "the copies put back"


@pytest.mark.parametrize("channel", list(_CHANNELS))
@pytest.mark.parametrize("model", [PlateauFromAnyCopyOnHeldOut, Validates], ids=["held-out-rule", "no-rule"])
def test_the_same_loggers_with_a_rule_on_held_out_data_or_none_train(channel, model, tmp_path):
    logger = _CHANNELS[channel](tmp_path)
    trained = model()
    dp = _fit(trained, logger, val=True)
    assert dp.ledger.steps == 16
    if model is PlateauFromAnyCopyOnHeldOut:
        assert trained.optimizers().param_groups[0]["lr"] < 1.0, "the rule halved the rate at least once"
    assert len(_read(logger, "train_loss")) == 4 and all(v < 100 for v in _read(logger, "train_loss"))


class BookkeepingLogger(DequeLogger):
    """Keeps the hyper-parameters, the steps and the times it was called at besides the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.hparams: dict[str, Any] = {}
        self.steps: list[int] = []
        self.times: list[float] = []

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.hparams.update(dict(params))

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        super().log_metrics(metrics, step)
        self.steps.append(step or 0)
        self.times.append(time.time())


class HalvesByTheLoggersBookkeeping(Validates):
    """A schedule from what the logger kept besides the values: the steps, the times, a hyper-parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"decay": 0.5123})

    def on_train_epoch_start(self) -> None:
        logger = self.logger
        if logger.steps and logger.steps[-1] >= 4 and logger.times[-1] >= logger.times[0]:
            for group in self.optimizers().param_groups:
                group["lr"] = logger.hparams.get("decay", 1.0) / (1 + self.current_epoch)


def test_a_schedule_from_the_loggers_steps_times_and_hyperparameters_trains():
    model = HalvesByTheLoggersBookkeeping()
    dp = _fit(model, BookkeepingLogger(), val=True)
    assert dp.ledger.steps == 16 and model.optimizers().param_groups[0]["lr"] == pytest.approx(0.5123 / 4)


def test_the_folders_looked_at_are_the_loggers_own_not_those_above_their_log_dir(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    logger.log_metrics({"train_loss": 0.6412345})
    logger.save()
    places = logger_copies._places(logger_copies._holders([logger]))
    assert logger.log_dir in places and str(tmp_path) not in places and logger.root_dir not in places
