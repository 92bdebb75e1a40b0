"""Time stamps kept in a container at a batch's end (validators/judged_writes.py with replays/clock.py): the runs
again read the clock values the real run read, so a throughput callback's list of ``time.perf_counter()`` (or
``time.time()``, ``time.monotonic()``, ``datetime.now()``) trains beside Lightning's ``Timer`` and
``ThroughputMonitor``; the same list with the batch or the loss mixed in is refused."""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ThroughputMonitor, Timer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class Stamps(pl.Callback):
    """A batch timer keeping every batch's end time and duration, in a list and a dict."""

    def __init__(self, clock: Callable[[], Any] = lambda: time.perf_counter(),
                 mixed: Callable[[Any, Any], float] = lambda outputs, batch: 0.0) -> None:
        self.clock, self.mixed = clock, mixed
        self.ends: list[Any] = []
        self.durations: dict[int, float] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        mixed = self.mixed(outputs, batch)
        self.ends.append(self.clock() if not mixed else (self.clock(), mixed))
        self.durations[trainer.global_step] = time.perf_counter() - self.start


class TimedModel(Classifier):
    """The module's own list of batch-end times."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(time.monotonic())


def _fit(model: pl.LightningModule, callbacks: list) -> pl.Trainer:
    trainer = quiet_trainer(strategy=strategy(), max_epochs=2, callbacks=callbacks)
    trainer.fit(model, loader())
    return trainer


@pytest.mark.parametrize("clock", [lambda: time.perf_counter(), lambda: time.time(), lambda: time.monotonic(),
                                   lambda: datetime.datetime.now()], ids=["perf_counter", "time", "monotonic", "now"])
def test_time_stamps_in_a_list_train(clock: Callable[[], Any]) -> None:
    stamps, timer = Stamps(clock), Timer()
    model = TimedModel()
    trainer = _fit(model, [stamps, timer, ThroughputMonitor(batch_size_fn=lambda batch: len(batch[0]))])
    assert len(stamps.ends) == len(model.times) == trainer.global_step == 8
    assert stamps.ends == sorted(stamps.ends) and len(set(stamps.ends)) == 8  # real, increasing time stamps
    assert timer.time_elapsed("train") > 0


@pytest.mark.parametrize("mixed", [lambda outputs, batch: float(batch[0].mean()),
                                   lambda outputs, batch: float(outputs["loss"])], ids=["batch", "loss"])
def test_time_stamps_with_the_data_mixed_in_are_refused(mixed: Callable[[Any, Any], float]) -> None:
    stamps = Stamps(mixed=mixed)
    with pytest.raises(PrivacyConfigurationError, match="Stamps.ends"):
        _fit(Classifier(), [stamps])
    assert not stamps.ends  # refused at the first batch's end, nothing of it kept
