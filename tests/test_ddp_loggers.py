"""Logger refusals under DDP (validators/logger_outputs.py, validators/logger_judge.py), on 2 CPU processes (gloo).

Loggers write on rank 0 only, so the usual idiom is ``if self.global_rank == 0: self.logger.experiment.add_images(…)``:
a refusal made on that rank alone must be raised on every rank together (nothing written on any), and a judged call
held on one rank only must not leave its peer out of the hook's run again, nor out of the refusal.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from ddp_helpers import SeededClassifier, classification_data, loader
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_dp import DPStrategy
from lightning_dp.errors import PrivacyConfigurationError

WORLD = 2
TIMEOUT = timedelta(seconds=10)  # a rank left waiting in a collective fails the test fast instead of hanging
REFUSED = "PrivacyConfigurationError"


class ErrorsRecorded(pl.Trainer):
    """A trainer whose ranks each write the error their fit raised to ``<errors>/rank<r>.err``; each rank waits (up to
    ``wait_s``) for the other ranks' files before raising, so the launcher does not end a rank about to raise too (a
    rank stuck in a collective writes its timeout's error when the timeout ends it)."""

    def __init__(self, errors: Path, wait_s: float = 20.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.errors, self.wait_s = errors, wait_s

    def _run_stage(self) -> Any:
        try:
            return super()._run_stage()
        except Exception as err:
            kind = REFUSED if isinstance(err, PrivacyConfigurationError) else type(err).__name__
            Path(self.errors, f"rank{self.global_rank}.err").write_text(f"{kind}\n{err}")
            deadline = time.monotonic() + self.wait_s
            while time.monotonic() < deadline and len(list(Path(self.errors).glob("rank*.err"))) < WORLD:
                time.sleep(0.1)
            raise


def _fit(tmp_path: Path, model: pl.LightningModule, callbacks: list[Any] = (), max_steps: int = 4) -> dict[int, str]:
    """Fit ``model`` on 2 ranks with a TensorBoard logger under ``tmp_path / "logs"``; each rank's error (none: '')."""
    errors = tmp_path / "errors"
    errors.mkdir()
    strategy = DPStrategy(start_method="fork", timeout=TIMEOUT, noise_multiplier=1.0, max_grad_norm=1.0,
                          sampler_seed=0)
    trainer = ErrorsRecorded(errors, accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=max_steps,
                             callbacks=list(callbacks), logger=TensorBoardLogger(tmp_path / "logs"),
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0)
    try:
        trainer.fit(model, loader(classification_data(64), 8))  # 4 steps per epoch on each rank
    except Exception:  # noqa: BLE001  (each rank's error is read from its file)
        pass
    return {r: (errors / f"rank{r}.err").read_text() if (errors / f"rank{r}.err").exists() else "" for r in
            range(WORLD)}


def _tags(tmp_path: Path) -> set[str]:
    """Every tag the event files under ``tmp_path / "logs"`` hold."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in (tmp_path / "logs").rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent), size_guidance={"images": 0, "histograms": 0})
        accumulator.Reload()
        tags.update(tag for names in accumulator.Tags().values() if isinstance(names, list) for tag in names)
    return tags


class Rank0Images(SeededClassifier):
    """The Lightning idiom: the training batch as images, from rank 0 only (loggers write on rank 0)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 0:
            self.logger.experiment.add_images("train/batch", batch[0].reshape(-1, 1, 2, 3).sigmoid(), self.global_step)
        return super().training_step(batch, batch_idx)


class Rank0Weights(pl.Callback):
    """All the weights as one histogram at each epoch's end, from rank 0 only, beside a broadcast: no released tensor
    as a whole, so held and judged by running the hook again (every rank runs it again: the broadcasts stay paired);
    the weights are released: written."""

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            weights = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
            trainer.logger.experiment.add_histogram("weights", weights, trainer.current_epoch)
        trainer.strategy.broadcast(trainer.current_epoch, src=0)


class FeaturesOnRank0(pl.Callback):
    """At epoch end every rank logs a histogram: rank 0 of its training features' means (moved by the exchange:
    refused), rank 1 of the weights (reproduced): the judge refuses on rank 0 only."""

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            values = trainer.train_dataloader.dataset.tensors[0].mean(0)
        else:
            values = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        trainer.logger.experiment.add_histogram("epoch_values", values, trainer.current_epoch)


def test_rank_zero_only_images_in_training_step_are_refused_on_every_rank(tmp_path):
    start = time.monotonic()
    errors = _fit(tmp_path, Rank0Images())
    assert all(e.startswith(REFUSED) for e in errors.values()), errors
    assert "add_images was called in training_step" in errors[0]
    assert "another rank" in errors[1]
    assert "train/batch" not in _tags(tmp_path)  # nothing written
    assert time.monotonic() - start < 40


def test_rank_zero_only_epoch_end_weights_histogram_is_written(tmp_path):
    start = time.monotonic()
    errors = _fit(tmp_path, SeededClassifier(), [Rank0Weights()], max_steps=8)  # two epochs' ends
    assert errors == {0: "", 1: ""}
    assert "weights" in _tags(tmp_path)
    assert time.monotonic() - start < 40


def test_a_judge_that_refuses_on_one_rank_refuses_on_every_rank(tmp_path):
    start = time.monotonic()
    errors = _fit(tmp_path, SeededClassifier(), [FeaturesOnRank0()])
    assert all(e.startswith(REFUSED) for e in errors.values()), errors
    assert "add_histogram was called in on_train_epoch_end" in errors[0]
    assert "another rank" in errors[1]
    assert "epoch_values" not in _tags(tmp_path)
    assert time.monotonic() - start < 40
