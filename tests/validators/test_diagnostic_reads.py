"""The non-private diagnostics fed back into training or a checkpoint (validators/diagnostic_reads.py): read inside a
step, refused at once; read elsewhere, the replays on other data see them moved, so what is set from them is refused;
logged or printed, they train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.diagnostics import StepDiagnostics  # noqa: E402
from lightning_dp.validators.diagnostic_reads import moved, moved_diagnostics  # noqa: E402

torch.set_num_threads(1)


class Enable(pl.Callback):
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.strategy.enable_non_private_diagnostics()


def _fit(model: pl.LightningModule, steps: int = 6, callbacks: Any = (), **trainer_kwargs: Any) -> Any:
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=steps, callbacks=[Enable(), *callbacks], **trainer_kwargs).fit(model,
                                                                                                          loader())
    return dp


def _diagnostics(trainer: pl.Trainer) -> Any:
    return trainer.strategy.non_private_diagnostics


class LrFromClipFraction(pl.Callback):
    """D1: the learning rate set at batch end from the last step's clip fraction."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        d = _diagnostics(trainer)
        if d is not None:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.1 if d.clip_fraction > self.threshold else 0.5


@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.99])
def test_a_learning_rate_set_at_batch_end_from_the_clip_fraction_is_refused(threshold: float):
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match="at the end of step"):
        quiet_trainer(strategy=dp, max_steps=6, callbacks=[Enable(), LrFromClipFraction(threshold)]).fit(
            Classifier(), loader())
    assert dp.ledger.steps < 6


class CFromMedianNorm(pl.Callback):
    """D2: C set at batch end from the median per-example norm (adaptive clipping without noise)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        d = _diagnostics(trainer)
        if d is not None:
            trainer.strategy.private_step.max_grad_norm = float(d.norm_quantiles((0.5,))[0])


def test_c_set_at_batch_end_from_the_median_norm_is_refused():
    with pytest.raises(PrivacyConfigurationError, match="σ or C"):
        _fit(Classifier(), callbacks=[CFromMedianNorm()])


class ScalesByCleanMean(Classifier):
    """D4: the loss scaled by the last step's ‖clean mean‖/C."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        d = self.trainer.strategy.non_private_diagnostics
        scale = 1.0 if d is None else 1.0 / max(d.clean_mean_norm_over_c, 1e-3)
        return super().training_step(batch, batch_idx) * scale


def test_a_loss_scaled_by_the_diagnostics_inside_the_step_is_refused():
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"StepDiagnostics\.clean_mean\) were read in training_step"):
        quiet_trainer(strategy=dp, max_steps=4, callbacks=[Enable()]).fit(ScalesByCleanMean(), loader())
    assert dp.ledger.steps == 1, "the first step (no diagnostics yet) released; the second refused"


class ScalesGradientsBeforeTheUpdate(Classifier):
    """D4 in on_before_optimizer_step: the learning rate of this update from the last step's norms."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        d = self.trainer.strategy.non_private_diagnostics
        if d is not None:
            try:  # a swallowed refusal is refused again before the release
                self.median = float(d.norms.median())
            except PrivacyConfigurationError:
                pass


def test_a_read_inside_on_before_optimizer_step_is_refused_even_if_swallowed():
    with pytest.raises(PrivacyConfigurationError, match=r"StepDiagnostics\.norms\) were read in "
                                                        "on_before_optimizer_step"):
        _fit(ScalesGradientsBeforeTheUpdate(), steps=4)


class RateAtEpochEnd(Classifier):
    """D1 at an epoch's end (4 steps an epoch)."""

    def on_train_epoch_end(self) -> None:
        d = self.trainer.strategy.non_private_diagnostics
        if d is not None:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = 0.1 if float(d.norms.median()) > d.max_grad_norm else 0.5


def test_a_learning_rate_set_at_epoch_end_from_the_norms_is_refused():
    with pytest.raises(PrivacyConfigurationError, match="at the end of an epoch"):
        _fit(RateAtEpochEnd(), steps=8)


class Validates(Classifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))


class CAtValidationEnd(pl.Callback):
    """D2 in a callback's on_validation_end."""

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        d = _diagnostics(trainer)
        if d is not None and not trainer.sanity_checking:
            trainer.strategy.private_step.max_grad_norm = 2.0 if d.clip_fraction > 0.5 else 0.5


def test_c_set_at_validation_end_from_the_clip_fraction_is_refused():
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match="validation"):
        quiet_trainer(strategy=dp, max_steps=8, val_check_interval=2, num_sanity_val_steps=0,
                      callbacks=[Enable(), CAtValidationEnd()]).fit(Validates(), loader(), loader(32, 16))


class NormsInCheckpoint(Classifier):
    """D6: the last step's per-example norms written into the checkpoint."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        d = self.trainer.strategy.non_private_diagnostics
        if d is not None:
            checkpoint["per_example_grad_norms"] = d.norms.clone()


class LastDiagnosticsInState(pl.Callback):
    """D6 by a callback's state_dict: the clip fraction saved with the checkpoint."""

    def __init__(self) -> None:
        self.strategy: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self.strategy = trainer.strategy

    def state_dict(self) -> dict:
        d = self.strategy.non_private_diagnostics if self.strategy is not None else None
        return {"clip_fraction": None if d is None else d.clip_fraction}


@pytest.mark.parametrize("model, callbacks", [(NormsInCheckpoint, []), (Classifier, [LastDiagnosticsInState])],
                         ids=["on_save_checkpoint", "callback_state_dict"])
def test_diagnostics_written_into_a_checkpoint_are_refused(tmp_path: Path, model: Any, callbacks: list):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    # the checkpoint replays refuse it; a callback's state_dict is also read by the release boundary inside the step
    with pytest.raises(PrivacyConfigurationError, match="A checkpoint hook computed checkpoint entries|were read in"):
        _fit(model(), callbacks=[checkpoint, *(cb() for cb in callbacks)], enable_checkpointing=True)
    assert not list(tmp_path.glob("*.ckpt")), "no checkpoint was written"


class ReportsDiagnostics(pl.Callback):
    """What the diagnostics are for: logged (a logger's scalars) and printed every other step."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        d = _diagnostics(trainer)
        if d is None or trainer.global_step % 2:
            return
        low, median, high = d.norm_quantiles((0.0, 0.5, 1.0))
        pl_module.log_dict({"nonprivate/clip_fraction": d.clip_fraction, "nonprivate/median_norm": median,
                            "nonprivate/clean_over_c": d.clean_mean_norm_over_c})
        trainer.logger.log_metrics({"nonprivate/max_norm": high, "nonprivate/min_norm": low},
                                   step=trainer.global_step)
        print(f"step {trainer.global_step}: clip fraction {d.clip_fraction:.2f}, norms {d.norms.tolist()}")


def test_logging_and_printing_the_diagnostics_trains(tmp_path: Path, capsys: Any):
    dp = _fit(Classifier(), steps=6, callbacks=[ReportsDiagnostics()], logger=CSVLogger(tmp_path),
              log_every_n_steps=1)
    assert dp.ledger.steps == 6
    assert sorted(set(line.split(":")[0] for line in capsys.readouterr().out.splitlines()
                      if "clip fraction" in line)) == ["step 2", "step 4", "step 6"]
    assert "nonprivate/median_norm" in next(tmp_path.rglob("metrics.csv")).read_text()


def _some_diagnostics() -> StepDiagnostics:
    p = torch.zeros(3)
    return StepDiagnostics({p: torch.tensor([0.1, -0.2, 0.3])}, torch.tensor([0.5, 1.5, 3.0]), 2 / 3, 3, 1.0)


def test_moved_diagnostics_sit_on_either_side_of_c_and_are_put_back():
    d = _some_diagnostics()
    up, down = moved_diagnostics(d, up=True), moved_diagnostics(d, up=False)
    assert up.clip_fraction == 1.0 and down.clip_fraction == 0.0
    assert bool((up.norms > 1000 * d.max_grad_norm).all()) and bool((down.norms <= 1e-3 * d.max_grad_norm).all())
    assert up.clean_mean_norm_over_c > 100 * d.clean_mean_norm_over_c > 1e4 * down.clean_mean_norm_over_c
    assert (up.batch_size, up.max_grad_norm) == (d.batch_size, d.max_grad_norm)

    class Holder:
        diagnostics = d

    holder = Holder()
    with pytest.raises(RuntimeError), moved(holder, up=True):
        assert holder.diagnostics.clip_fraction == 1.0
        raise RuntimeError
    assert holder.diagnostics is d
