"""A user's own Logger re-fed with the moved values (value_copies/refed_loggers.py, wired by
validators/logger_copies.py; rule 6 of docs/release_boundary.md): whatever encoding of the logged training loss it
keeps (zoo29 v01-v04, v06, v07), a learning rate set from it is refused; its safe twins train, and it is put back."""

from __future__ import annotations

import os
import pickle
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
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

Encode = Callable[["Encoded", float], None]
Decode = Callable[["Encoded"], Optional[float]]


def _npy(logger: "Encoded") -> str:
    return os.path.join(logger.folder, "hist.npy")


def _save_npy(logger: "Encoded", v: float) -> None:
    kept = np.load(_npy(logger)) if os.path.exists(_npy(logger)) else np.zeros(0)
    np.save(_npy(logger), np.append(kept, v))


def _last(logger: "Encoded") -> Any:
    return logger.hist[-1] if logger.hist else None


ENCODINGS: dict[str, tuple[Encode, Decode]] = {
    "v01-rounded": (lambda s, v: s.hist.append(round(v, 2)), _last),
    "v02-scaled-int": (lambda s, v: s.hist.append(int(v * 1000)), lambda s: s.hist[-1] / 1000 if s.hist else None),
    "v03-prefixed-text": (lambda s, v: s.hist.append(f"L{v:.6f}"), lambda s: float(s.hist[-1][1:]) if s.hist else None),
    "v04-pickled": (lambda s, v: s.hist.append(pickle.dumps(v)), lambda s: pickle.loads(s.hist[-1]) if s.hist else None),
    "v06-npy-file": (_save_npy, lambda s: float(np.load(_npy(s))[-1]) if os.path.exists(_npy(s)) else None),
    "v07-split": (lambda s, v: s.hist.append((v * 0.37, v * 0.63)), lambda s: sum(s.hist[-1]) if s.hist else None),
}


class Encoded(UserLogger):
    """zoo29 v01-v07: keeps the values logged under ``name`` re-encoded (``encode``), read back by ``decode``."""

    NAME = "encoded"

    def __init__(self, folder: Path, encode: Encode, decode: Decode, name: str = "train_loss") -> None:
        super().__init__()
        self.folder, self.encode, self.decode, self.key, self.hist = str(folder), encode, decode, name, []
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def log_dir(self) -> str:
        return self.folder

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        if self.key in metrics:
            self.encode(self, float(metrics[self.key]))

    def last(self) -> Optional[float]:
        return self.decode(self)


class RateFromLogger(pl.Callback):
    """zoo29's callback: the learning rate set from the last value the logger keeps, at each epoch's start."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.loggers[0].last()
        if value is not None:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.1 * value


class HalvesOnPlateau(pl.Callback):
    """A plateau rule by hand on the values the logger keeps (the held-out loss: sound)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        kept = [float(v) for v in trainer.loggers[0].hist]
        if len(kept) >= 2 and kept[-1] > kept[-2] - 1.0:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] *= 0.5


class LogsLosses(Classifier):
    """Logs its training loss once an epoch, and a held-out loss."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))


def _fit(logger: Logger, callback: pl.Callback, val: bool = False) -> tuple[Any, LogsLosses]:
    dp, model = strategy(noise_multiplier=0.1), LogsLosses()
    trainer = quiet_trainer(strategy=dp, max_epochs=4, logger=logger, num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(model, loader(), DataLoader(data(32, seed=7), batch_size=16) if val else None)
    return dp, model


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_a_rate_set_from_any_encoding_the_users_logger_keeps_is_refused(encoding, tmp_path):
    logger = Encoded(tmp_path / "run", *ENCODINGS[encoding])
    with pytest.raises(PrivacyConfigurationError, match="from the training data"):
        _fit(logger, RateFromLogger())
    last = logger.last()
    assert last is not None and 0 < last < 10, "the logger's state and files are put back after each run"
    assert not [f for f in os.listdir(tmp_path / "run") if f.startswith(".")], "no file left behind"


def test_a_plateau_rule_on_the_held_out_loss_the_users_logger_keeps_rounded_trains(tmp_path):
    logger = Encoded(tmp_path / "run", lambda s, v: s.hist.append(round(v, 2)), _last, name="val_loss")
    dp, model = _fit(logger, HalvesOnPlateau(), val=True)
    assert dp.ledger.steps == 16
    assert model.optimizers().param_groups[0]["lr"] < 1.0, "the rule halved the rate at least once"
    assert len(logger.hist) == 4 and all(0 < v < 10 for v in logger.hist)


class Prints(UserLogger):
    """A logger that only prints what it is given."""

    NAME = "prints"

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        print("metrics:", {k: round(float(v), 4) for k, v in metrics.items()})


class RateFromEpoch(pl.Callback):
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = 1.0 / (1 + trainer.current_epoch)


def test_a_logger_that_only_prints_trains_and_prints_the_real_values(capsys):
    own = vars(Prints)["log_metrics"]
    dp, model = _fit(Prints(), RateFromEpoch(), val=True)
    assert dp.ledger.steps == 16 and model.optimizers().param_groups[0]["lr"] == pytest.approx(0.25)
    printed = [line for line in capsys.readouterr().out.splitlines() if "train_loss" in line]
    assert len(printed) == 4 and all("train_loss': 0." in line for line in printed), "a run's re-feed prints nothing"
    assert vars(Prints)["log_metrics"] is own and "save" not in vars(Prints), "the class's methods are its own again"


class Locked(Encoded):
    """Holds a lock: its attributes do not copy."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, lambda s, v: s.hist.append(v), _last)
        self.lock = threading.Lock()


def test_a_decision_judged_with_a_logger_that_does_not_copy_is_refused(tmp_path):
    with pytest.warns(UserWarning, match="the logger Locked cannot be rebuilt"), \
            pytest.raises(PrivacyConfigurationError, match="The logger Locked cannot be rebuilt .*cannot pickle "
                          "'_thread.lock' object.*__deepcopy__"):
        _fit(Locked(tmp_path / "run"), RateFromLogger())  # fail closed (zoo30 l06, x01, x02)
