"""Decisions made outside a step after the first one, verified when made (validators/decisions.py, rule 3 of
docs/release_boundary.md): a rate, a stop, an unfrozen backbone, a swapped optimizer or a scheduler's state set from
the training data once a threshold is crossed is refused; the same decisions from the step count, the clock or
held-out data train."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from pytorch_lightning.callbacks import EarlyStopping
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.decisions import DecisionWindows  # noqa: E402


def _train_set_loss(trainer: pl.Trainer, module: pl.LightningModule) -> float:
    x, y = trainer.train_dataloader.dataset.tensors
    with torch.no_grad():
        return float(F.cross_entropy(module(x), y))


def _train_set_accuracy(trainer: pl.Trainer, module: pl.LightningModule) -> float:
    x, y = trainer.train_dataloader.dataset.tensors
    with torch.no_grad():
        return float((module(x).argmax(1) == y).float().mean())


class Validates(Classifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


def _fit(module: pl.LightningModule, callbacks: list, steps: int | None = None, epochs: int | None = None,
         validate: bool = False, **strategy_kwargs: Any) -> pl.Trainer:
    limits = {"max_steps": steps} if steps is not None else {"max_epochs": epochs}
    trainer = quiet_trainer(strategy=strategy(**strategy_kwargs), callbacks=callbacks, **limits)
    held_out = DataLoader(data(32, seed=5), batch_size=16) if validate else None
    trainer.fit(module, loader(64), held_out)
    return trainer


# ----------------------------------------------------------------------------- at a batch's end
class CutWhenLow(pl.Callback):
    """Cuts the rate once the batch loss falls under a threshold (not at the first step: its loss is higher)."""

    def __init__(self) -> None:
        self.cut_at: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if float(outputs["loss"]) < 0.45:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.1


def test_a_rate_cut_when_the_batch_loss_crosses_a_threshold_later_is_refused_when_made() -> None:
    """Refused when made, or before any release: the first step's replays hand the hooks the loss moved near zero
    too (step_replays.py), where the cut is made."""
    with pytest.raises(PrivacyConfigurationError, match=r"at the end of step \d+ \(on_train_batch_end\)|"
                                                        r"replayed on the probe's examples.*param_groups\[0\]\.lr"):
        _fit(Classifier(), [CutWhenLow()], steps=40)


class WarmsUpByHand(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = min(1.0, (trainer.global_step + 1) / 10)


def test_a_warm_up_set_by_hand_at_every_batch_end_trains() -> None:
    trainer = _fit(Classifier(), [WarmsUpByHand()], steps=12)
    assert trainer.global_step == 12
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1.0)


class ObservingScheduler(torch.optim.lr_scheduler.LRScheduler):
    """A home-made scheduler told the loss, applying it at its next step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.scale = 1.0
        super().__init__(optimizer)

    def observe(self, loss: float) -> None:
        self.scale = 0.5 if loss < 0.6 else 1.0

    def get_lr(self) -> list[float]:
        return [base * self.scale for base in self.base_lrs]


class Observed(Classifier):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        self.scheduler = ObservingScheduler(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"}}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.scheduler.observe(float(outputs["loss"]))


def test_a_scheduler_told_the_batch_loss_is_refused() -> None:
    # the first step's replays (the loss moved near zero) meet the threshold: refused before any release
    with pytest.raises(PrivacyConfigurationError, match="scheduler 0 (scale|ObservingScheduler)"):
        _fit(Observed(), [], steps=30, public_state=["scheduler"])


# ----------------------------------------------------------------------------- at an epoch's end
class StopsWhenLow(pl.Callback):
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _train_set_loss(trainer, pl_module) < 0.45:
            trainer.should_stop = True


def test_a_stop_when_the_training_set_loss_crosses_a_threshold_is_refused() -> None:
    """The stop comes at the second epoch's end; the classifier is odd in its input, so exchanging every array (the
    features' signs, the labels' parity) leaves the loss alike: the features exchanged alone set it apart."""
    with pytest.raises(PrivacyConfigurationError, match=r"at the end of an epoch.*trainer should_stop"):
        _fit(Classifier(), [StopsWhenLow()], epochs=15)


class StopsOnTheClock(pl.Callback):
    def __init__(self) -> None:
        self.started = time.monotonic()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if time.monotonic() - self.started > 0.0:
            trainer.should_stop = True


def test_a_stop_on_the_clock_and_early_stopping_on_held_out_data_train() -> None:
    assert _fit(Classifier(), [StopsOnTheClock()], epochs=4).current_epoch == 1
    trainer = _fit(Validates(), [EarlyStopping("val_loss", patience=0, min_delta=10.0)], epochs=5, validate=True)
    assert trainer.current_epoch < 5


class Frozen(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)


class UnfreezesWhenAccurate(pl.Callback):
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _train_set_accuracy(trainer, pl_module) > 0.8:
            pl_module.net[0].requires_grad_(True)


def test_a_backbone_unfrozen_on_the_training_accuracy_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match="model trainable"):
        _fit(Frozen(), [UnfreezesWhenAccurate()], steps=40)


class SwapsWhenAccurate(Classifier):
    def on_train_epoch_end(self) -> None:
        if _train_set_accuracy(self.trainer, self) > 0.8:
            self.trainer.strategy.optimizers = [torch.optim.Adam(self.parameters(), lr=1e-2)]


def test_an_optimizer_swapped_on_the_training_accuracy_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match="trainer optimizers"):
        _fit(SwapsWhenAccurate(), [], steps=40)


class Phase(pl.Callback):
    """Never sees a batch; flips a flag on the training accuracy that training_step reads."""

    def __init__(self) -> None:
        self.hard = False

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hard = _train_set_accuracy(trainer, pl_module) > 0.8


class ReadsThePhase(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        phase = next(cb for cb in self.trainer.callbacks if isinstance(cb, Phase))
        return loss * 2 if phase.hard else loss


def test_a_flag_set_from_the_training_data_by_a_callback_that_sees_no_batch_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match="callback Phase.hard"):
        _fit(ReadsThePhase(), [Phase()], steps=40)


class CountsEpochs(pl.Callback):
    """Never sees a batch; keeps what does not come from the data: an epoch count and the epoch's start time."""

    def __init__(self) -> None:
        self.epochs = 0
        self.started = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.monotonic()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs += 1


def test_an_epoch_count_and_a_timer_in_a_callback_that_sees_no_batch_train() -> None:
    counter = CountsEpochs()
    _fit(Classifier(), [counter], epochs=3)
    assert counter.epochs == 3


class AppendsToAReport(Classifier):
    """Writes batch statistics, inside the step, into a callback that only reports at epoch end."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        report = next(cb for cb in self.trainer.callbacks if isinstance(cb, CountsEpochs))
        report.norms = [*getattr(report, "norms", []), batch[0].norm(dim=1)]
        return super().training_step(batch, batch_idx)


def test_the_step_writing_into_a_callback_that_sees_no_batch_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match="callback CountsEpochs.norms"):
        _fit(AppendsToAReport(), [CountsEpochs()], steps=6)


# ----------------------------------------------------------------------------- at a validation's end
class RateFromTheTrainingSet(pl.Callback):
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and _train_set_loss(trainer, pl_module) < 0.6:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.1


class RateFromTheHeldOutSet(pl.Callback):
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        x, y = trainer.val_dataloaders.dataset.tensors
        with torch.no_grad():
            low = float(F.cross_entropy(pl_module(x), y)) < 0.9
        if low:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.2


def test_a_rate_set_at_validation_end_from_the_training_set_is_refused_and_from_the_held_out_set_trains() -> None:
    with pytest.raises(PrivacyConfigurationError, match="at the end of a validation"):
        _fit(Validates(), [RateFromTheTrainingSet()], epochs=8, validate=True)
    trainer = _fit(Validates(), [RateFromTheHeldOutSet()], epochs=4, validate=True)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.2)


# ----------------------------------------------------------------------------- the callback itself
def test_the_windows_callback_is_first_during_the_fit_and_gone_after_it() -> None:
    seen = []

    class Looks(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            seen.append(type(trainer.callbacks[0]))

    trainer = _fit(Classifier(), [Looks()], steps=2)
    assert len(seen) >= 2 and set(seen) == {DecisionWindows}  # the checks' passes run the hook too
    assert not any(isinstance(cb, DecisionWindows) for cb in trainer.callbacks)


class DropoutWhenAccurate(Classifier):
    """Raises a dropout layer's rate once the training accuracy passes 0.8 (a torch layer's configuration)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.0),
                                       torch.nn.Linear(8, 2))

    def on_train_epoch_end(self) -> None:
        if _train_set_accuracy(self.trainer, self) > 0.8:
            self.net[2].p = 0.5


def test_state_an_epochs_hook_sets_past_a_threshold_is_judged_from_the_state_before_it():
    """The runs again start from the state as the epoch's window opened (rate 0), not as the real hook left it
    (0.5, which the exchanged run, below the threshold, would leave alike): refused, not accepted."""
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)at the end of an epoch.*configuration net\.2\.p"):
        _fit(DropoutWhenAccurate(), [], steps=40)


# ----------------------------------------------------------------------------- state the batch-end hooks write
class AveragesTheWeights(Classifier):
    """An EMA of the weights (torch's AveragedModel), updated at every batch's end from the released weights."""

    def __init__(self) -> None:
        super().__init__()
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        self.ema.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=1.0)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ema.update_parameters(self.net)


class CountsBatches(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches += 1


def test_an_ema_of_the_weights_and_a_batch_counter_kept_at_batch_end_train():
    """What the batch-end hooks write without the data (their runs on other data write it alike) is kept."""
    model, counter = AveragesTheWeights(), CountsBatches()
    assert _fit(model, [counter], steps=6).strategy.ledger.steps == 6
    assert counter.batches == 6 and int(model.ema.n_averaged) == 6
    assert not torch.equal(model.ema.module[0].weight, model.net[0].weight)  # an average, not a copy


class KeepsTheBatchMeanLater(pl.Callback):
    """Writes a constant at batch end for three calls (its own count: the first step's replays, run as of the plan's
    last step, do not reach it), then the batch's mean: the same entry, from the data."""

    def __init__(self) -> None:
        self.level, self.calls = 0.0, 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.calls += 1
        self.level = float(batch[0].mean()) if self.calls > 3 else 0.0


def test_a_batch_end_write_that_turns_to_the_data_later_is_refused_at_a_checked_step():
    """Accepted while it is written alike, judged again at the steps the batch check runs (every step here)."""
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)at the end of step 4.*callback KeepsTheBatchMeanLater"):
        _fit(Classifier(), [KeepsTheBatchMeanLater()], steps=8, verify="every_step")
