"""Values logged from the training data, read back by the user's code (validators/logged_reads.py, rule 10 of
docs/release_boundary.md): refused inside a step; elsewhere the reader's later writes are kept state."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, fit, loader, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.logged_reads import LoggedMetrics, LoggedReads  # noqa: E402


class Logs(Classifier):
    """Logs its training loss (per step and per epoch)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


class ScalesByLastLoss(Logs):
    """Scales its loss by the last logged one (read inside training_step)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        last = self.trainer.callback_metrics.get("train_loss_step")
        loss = super().training_step(batch, batch_idx)
        return loss if last is None else loss * float(last)


def test_a_logged_loss_read_inside_training_step_is_refused_before_that_release():
    model = ScalesByLastLoss()
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)'train_loss_step' were read back in training_step"):
        quiet_trainer(strategy=dp, max_steps=4).fit(model, loader())
    assert dp.ledger.steps == 1, "the first step (nothing logged yet) released; the second refused"


def test_a_name_declared_public_may_be_read_back():
    dp = fit(ScalesByLastLoss(), steps=3, public_state=["train_loss*"])
    assert dp.ledger.steps == 3


class RateFromLossAfterUpdate(Logs):
    """Lightning's documented optimizer_step override, setting the rate from the logged loss after the update."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * float(self.trainer.callback_metrics["train_loss_step"])


def test_a_rate_set_from_the_logged_loss_in_optimizer_step_is_refused():
    with pytest.raises(PrivacyConfigurationError, match="read back in optimizer_step"):
        fit(RateFromLossAfterUpdate(), steps=3)


class Keeps(pl.Callback):
    """Keeps the epoch's training loss (a callback handed no batch)."""

    def __init__(self) -> None:
        self.last = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last = float(trainer.callback_metrics["train_loss_epoch"])


def test_a_callback_that_keeps_a_logged_value_is_refused_before_the_next_release():
    keeps = Keeps()
    model = Logs()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)at the end of an epoch.*callback Keeps\.last"):
        fit(model, steps=8, callbacks=[keeps])  # 4 steps an epoch: refused before the fifth release
    assert model.trainer.strategy.ledger.steps == 4


class ManualPlateau(pl.Callback):
    """Halves the rate at epoch end when the training loss went up (ReduceLROnPlateau by hand)."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if float(trainer.callback_metrics["train_loss_epoch"]) > 0.0:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] *= 0.5


def test_a_rate_set_at_epoch_end_from_the_logged_loss_is_refused_before_the_next_release():
    model = Logs()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)after the user's code read 'train_loss_epoch'.*param_groups\[0\]\.lr"):
        fit(model, steps=8, callbacks=[ManualPlateau()])
    assert model.trainer.strategy.ledger.steps == 4


class Prints(pl.Callback):
    """Reports the training loss, at batch end and epoch end (keeps nothing)."""

    def __init__(self) -> None:
        self.lines = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        print({k: float(v) for k, v in trainer.progress_bar_metrics.items()})

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(f"epoch loss {float(trainer.callback_metrics['train_loss_epoch']):.3f}")


class LogsWithSchedule(Logs):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}


def test_reporting_a_logged_value_with_a_scheduler_stepping_is_allowed_and_it_is_readable_after_the_fit(capsys):
    model = LogsWithSchedule()
    dp = fit(model, steps=8, callbacks=[Prints()])
    assert dp.ledger.steps == 8
    assert "epoch loss" in capsys.readouterr().out
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.25), "two epochs, two halvings"
    assert float(model.trainer.callback_metrics["train_loss_epoch"]) > 0  # the fit is over: a report


class ValidationSteered(Logs):
    """Reads a held-out metric inside training_step (allowed: validation data is not the training set)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        held_out = self.trainer.callback_metrics.get("val_loss")
        loss = super().training_step(batch, batch_idx)
        return loss if held_out is None else loss * (1 + 0 * float(held_out))


def test_a_held_out_metric_may_be_read_inside_a_step():
    model = ValidationSteered()
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=6, val_check_interval=2, limit_val_batches=1).fit(
        model, loader(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
            torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=8))
    assert dp.ledger.steps == 6


def test_the_metrics_dict_sees_each_way_of_reading_a_value_and_pickles_as_a_plain_dict():
    import copy
    import pickle

    class Trainer:
        lightning_module = None

    reads = LoggedReads(Trainer(), lambda: ["secret"])
    reads.active = True
    metrics = LoggedMetrics({"secret": torch.tensor(1.0), "other": 2}, reads)
    seen = []
    reads.on_read = lambda reader, names: seen.append(tuple(names))
    assert metrics["other"] == 2 and not seen
    for read in (lambda m: m["secret"], lambda m: m.get("secret"), lambda m: list(m.items()),
                 lambda m: list(m.values()), lambda m: m.copy(), lambda m: copy.deepcopy(m), lambda m: copy.copy(m),
                 lambda m: dict(m), lambda m: {**m}):
        read(metrics)
    assert seen == [("secret",)] * 9
    assert sorted(metrics) == ["other", "secret"] and len(seen) == 9, "the names alone are not the data's"
    assert type(pickle.loads(pickle.dumps(metrics))) is dict
    reads.stop()
    metrics["secret"]
    assert len(seen) == 9, "after the fit: not watched"


class KeepsTrainingLossAtValidation(Logs):
    """Validates on held-out data, and at its end keeps the training loss to scale the next steps' loss by."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", Classifier.training_step(self, batch, batch_idx))

    def on_validation_epoch_end(self) -> None:
        value = self.trainer.callback_metrics.get("train_loss_step")
        if value is not None:
            self.scale = float(value)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * getattr(self, "scale", 1.0)


class ReportsAtValidation(KeepsTrainingLossAtValidation):
    """Prints the training loss beside the held-out one and keeps held-out results (a report: allowed)."""

    def on_validation_epoch_end(self) -> None:
        print("train", float(self.trainer.callback_metrics["train_loss_step"]))
        self.held_out = getattr(self, "held_out", []) + [float(self.trainer.callback_metrics["val_loss"])]


def _validated_fit(model: Logs, seed: int = 0, **kwargs: Any) -> Any:
    dp = strategy(**kwargs)
    quiet_trainer(strategy=dp, max_steps=8, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0).fit(
        model, loader(seed=seed), loader(32, seed=seed))
    return dp


def test_state_kept_during_validation_after_reading_a_training_value_is_refused():
    model = KeepsTrainingLossAtValidation()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)during validation after it read training data.*attribute scale"):
        _validated_fit(model)
    assert model.trainer.strategy.ledger.steps == 2, "refused at the first validation's end"


def test_held_out_results_kept_after_reading_a_training_value_are_refused_unless_declared_public():
    model = ReportsAtValidation()
    with pytest.raises(PrivacyConfigurationError, match="attribute held_out"):
        _validated_fit(model)  # held-out results kept after the read: not told apart from a kept training value
    dp = _validated_fit(ReportsAtValidation(), seed=1, public_state=["held_out"])  # other records: its own ledger
    assert dp.ledger.steps == 8


class FrozenFirstLayer(Logs):
    def __init__(self) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)


class Unfreeze(pl.Callback):
    """Unfreezes the first layer at the second epoch: the engine re-attaches and the checks (with the batch hooks'
    replays) run again, now with a training loss logged."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            pl_module.net[0].weight.requires_grad_(True)


class PrintsAtBatchEnd(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if "train_loss_step" in trainer.callback_metrics:
            print("loss", float(trainer.callback_metrics["train_loss_step"]))


def test_a_report_at_batch_end_is_not_refused_when_the_checks_replay_the_hooks_later(capsys):
    dp = fit(FrozenFirstLayer(), steps=8, callbacks=[Unfreeze(), PrintsAtBatchEnd()])
    assert dp.ledger.steps == 8
    assert capsys.readouterr().out.count("loss") >= 7


class UnfreezeFromTheLoss(pl.Callback):
    """Unfreezes the first layer at an epoch's start once the logged epoch loss is positive (always, for a
    cross-entropy): a decision from a logged value that moving the value far or near zero leaves alike."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if float(trainer.callback_metrics.get("train_loss_epoch", -1.0)) > 0.0:
            pl_module.net[0].weight.requires_grad_(True)


def test_a_layer_unfrozen_from_the_logged_loss_at_an_epochs_start_is_refused_before_the_next_release():
    model = FrozenFirstLayer()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)read 'train_loss_epoch'.*model trainable"):
        fit(model, steps=8, callbacks=[UnfreezeFromTheLoss()])
    assert model.trainer.strategy.ledger.steps == 4


class WeightsByItsRunningLoss(Classifier):
    """Keeps a running mean of the loss in a torchmetrics metric (updated at batch end) and scales the loss by it."""

    def __init__(self) -> None:
        import torchmetrics

        super().__init__()
        self.running = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        weight = float(self.running.compute()) if self.running.update_count else 1.0
        return super().training_step(batch, batch_idx) * weight

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.running.update(outputs["loss"])


class LogsItsAccuracy(Classifier):
    """The ordinary use: a metric updated in training_step and logged (Lightning computes it)."""

    def __init__(self) -> None:
        import torchmetrics

        super().__init__()
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        self.accuracy(logits.argmax(1), batch[1])
        self.log("train_acc", self.accuracy, on_step=True, on_epoch=True)
        return torch.nn.functional.cross_entropy(logits, batch[1])


def test_a_metric_computed_inside_the_step_is_refused_and_a_logged_one_trains():
    model = WeightsByItsRunningLoss()
    with pytest.raises(PrivacyConfigurationError, match=r"'running\.compute\(\)' were read back in training_step"):
        fit(model, steps=4)
    assert model.trainer.strategy.ledger.steps == 1
    assert model.running.compute.__name__ != "guarded", "the metric computes as before once training ends"
    logged = LogsItsAccuracy()
    assert fit(logged, steps=8, seed=1).ledger.steps == 8  # other records: its own ledger
    assert 0 <= float(logged.accuracy.compute()) <= 1


class LogsItsRunningLoss(Classifier):
    """A running mean of the earlier steps' losses (MeanMetric), its compute() logged from training_step (a report: only
    self.log reads it), and an accuracy updated then computed and logged the same way."""

    def __init__(self, scale: bool = False) -> None:
        import torchmetrics

        super().__init__()
        self.scale = scale
        self.running = torchmetrics.MeanMetric()
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        loss = torch.nn.functional.cross_entropy(logits, batch[1])
        self.accuracy.update(logits.argmax(1), batch[1])
        self.log("train_acc", self.accuracy.compute())
        if not self.running.update_count:
            return loss
        self.log("running_loss", self.running.compute(), prog_bar=True)
        return loss * self.running.compute() if self.scale else loss  # scaled by the earlier steps' losses

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.running.update(outputs["loss"])


def test_a_metric_computed_by_the_user_in_the_step_may_be_logged_not_used():
    logged = LogsItsRunningLoss()
    assert fit(logged, steps=6).ledger.steps == 6
    assert float(logged.trainer.callback_metrics["running_loss"]) > 0
    model = LogsItsRunningLoss(scale=True)
    with pytest.raises(PrivacyConfigurationError, match=r"'running\.compute\(\)' were read back in training_step"):
        fit(model, steps=4, seed=1)  # other records: its own ledger
    assert model.trainer.strategy.ledger.steps == 1


class RateFromValidationLoss(Classifier):
    """Sets the learning rate by hand from the validation loss at validation end (a plateau rule of its own)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def on_validation_epoch_end(self) -> None:
        value = self.trainer.callback_metrics.get("val_loss")
        if value is not None:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = 0.1 * float(value)


def _validating_fit(model: pl.LightningModule, val: Any) -> Any:
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, max_steps=12, val_check_interval=2, num_sanity_val_steps=0)
    trainer.fit(model, loader(64), val)
    return dp


def test_validation_values_are_the_training_datas_when_validation_reads_the_training_records():
    model = RateFromValidationLoss()
    with pytest.raises(PrivacyConfigurationError, match=r"read 'val_loss'|at the end of a validation.*lr"):
        _validating_fit(model, loader(64))  # the training records again: refused where the rate is set from it


def test_held_out_validation_values_may_steer_the_rate():
    from torch.utils.data import DataLoader

    from cases import data

    dp = _validating_fit(RateFromValidationLoss(), DataLoader(data(32, seed=5), batch_size=16))
    assert dp.ledger.steps == 12


class _AccuracyAtBatchEnd(pl.Callback):
    """A callback holding a torchmetrics metric, updated with the training batch at batch end."""

    def __init__(self) -> None:
        import torchmetrics

        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=2)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.accuracy.update(module(batch[0]).argmax(1), batch[1])


class WeightsByACallbacksMetric(Classifier):
    """Reads a callback's metric (computed in training_step) into its loss weight."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        held = next(c for c in self.trainer.callbacks if isinstance(c, _AccuracyAtBatchEnd)).accuracy
        weight = 2.0 - float(held.compute()) if held.update_count else 1.0
        return super().training_step(batch, batch_idx) * weight


class WeightsByADictsMetric(Classifier):
    """Keeps its metric in a plain dict (not a submodule), updated at batch end, computed into the next loss."""

    def __init__(self) -> None:
        import torchmetrics

        super().__init__()
        self.metrics = {"train_acc": torchmetrics.Accuracy(task="multiclass", num_classes=2)}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        held = self.metrics["train_acc"]
        weight = 2.0 - float(held.compute()) if held.update_count else 1.0
        return super().training_step(batch, batch_idx) * weight

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.metrics["train_acc"].update(self(batch[0]).argmax(1), batch[1])


class WeightsByTheBatchAccuracy(LogsItsAccuracy):
    """Uses what the metric's forward returns (the batch's accuracy) in its loss, from the second step (the first
    step's probe would see the examples interact)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        accuracy = self.accuracy(logits.argmax(1), batch[1])
        loss = torch.nn.functional.cross_entropy(logits, batch[1])
        return loss * (2.0 - accuracy) if batch_idx else loss


class ScalesByAMetricsForward(Classifier):
    """Uses what a metric's forward returns in its loss (a running mean of a constant: the seal, not the probe)."""

    def __init__(self) -> None:
        import torchmetrics

        super().__init__()
        self.steps = torchmetrics.SumMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) / self.steps(torch.ones(()))


class LogsTheBatchAccuracy(LogsItsAccuracy):
    """Logs what the metric's forward returns, and a dict-held metric, each in the standard way (reports)."""

    def __init__(self) -> None:
        import torchmetrics

        super().__init__()
        self.metrics = {"train_f1": torchmetrics.F1Score(task="multiclass", num_classes=2)}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        self.log("train_acc", self.accuracy(logits.argmax(1), batch[1]), prog_bar=True)
        self.metrics["train_f1"].update(logits.argmax(1), batch[1])
        return torch.nn.functional.cross_entropy(logits, batch[1])

    def on_train_epoch_end(self) -> None:
        self.log("train_f1", self.metrics["train_f1"].compute())


def test_a_metric_is_watched_wherever_it_lives_and_its_value_only_reported():
    for model, callbacks in ((WeightsByACallbacksMetric(), [_AccuracyAtBatchEnd()]), (WeightsByADictsMetric(), []),
                             (WeightsByTheBatchAccuracy(), []), (ScalesByAMetricsForward(), [])):
        with pytest.raises(PrivacyConfigurationError, match=r"(?s)were read back in training_step|Examples interact"):
            fit(model, steps=4, callbacks=callbacks)
        assert model.trainer.strategy.ledger.steps <= 1, type(model).__name__
    import torchmetrics

    assert "__getattribute__" not in vars(torchmetrics.Metric), "the metrics are as they were once the fit ends"
    logged = LogsTheBatchAccuracy()
    assert fit(logged, steps=8, callbacks=[_AccuracyAtBatchEnd()]).ledger.steps == 8
    assert 0 <= float(logged.trainer.callback_metrics["train_acc"]) <= 1
    assert 0 <= float(logged.trainer.callback_metrics["train_f1"]) <= 1


class LogsToTheBar(Classifier):
    """Logs its training loss to the progress bar."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss


class ReadsTheProgressBar(LogsToTheBar):
    """Reads its logged loss back through the progress bar's public get_metrics (Lightning's code reads)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        last = self.trainer.progress_bar_callback.get_metrics(self.trainer, self).get("train_loss_step")
        loss = super().training_step(batch, batch_idx)
        return loss if last is None else loss / (0.5 + float(last))


class ReadsTheConnector(Logs):
    """Reads its logged loss back through the logger connector's metrics."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        last = self.trainer._logger_connector.metrics["callback"].get("train_loss_step")
        loss = super().training_step(batch, batch_idx)
        return loss if last is None else loss / (0.5 + float(last))


class _PrintsTheBar(pl.Callback):
    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        print("bar", trainer.progress_bar_callback.get_metrics(trainer, module).get("train_loss_step"))


def test_a_logged_value_read_through_a_librarys_accessor_inside_the_step_is_refused(capsys):
    for seed, model in enumerate((ReadsTheProgressBar(), ReadsTheConnector())):  # each on records of its own
        with pytest.raises(PrivacyConfigurationError, match=r"(?s)'train_loss_step' were read back in training_step"):
            quiet_trainer(strategy=strategy(), max_steps=4, enable_progress_bar=True).fit(model, loader(seed=seed))
        assert model.trainer.strategy.ledger.steps == 1, type(model).__name__
    capsys.readouterr()
    model = LogsToTheBar()
    quiet_trainer(strategy=strategy(), max_steps=4, enable_progress_bar=True, callbacks=[_PrintsTheBar()]).fit(
        model, loader(seed=2))
    assert model.trainer.strategy.ledger.steps == 4
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("bar ")]
    assert len(shown) >= 4, shown  # the bar's own reads, outside the step (and their replays): a report


class StopsWhileLossIsHigh(pl.Callback):
    """Stops at an epoch's end while the logged training loss is above a bound it is above (a decision the logged value
    moved far leaves as it was: moved near zero, it is not taken)."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.should_stop = float(trainer.callback_metrics["train_loss_epoch"]) > 0.01


def test_a_stop_while_a_logged_loss_is_above_a_bound_is_refused():
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"at the end of an epoch \(on_train_epoch_end.*should_stop"):
        quiet_trainer(strategy=dp, max_steps=12, callbacks=[StopsWhileLossIsHigh()]).fit(Logs(), loader())
    assert dp.ledger.steps == 4


class KeepsInCheckpoint(Logs):
    """Copies a logged value into every checkpoint (zoo22 c1: a model card's last training loss)."""

    name = "train_loss"

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["last"] = float(self.trainer.callback_metrics[self.name])


@pytest.mark.parametrize("card", [False, True], ids=["module hook", "callback copying logged_metrics"])
def test_a_training_logged_value_read_into_a_checkpoint_is_refused(card, tmp_path):
    class Card(pl.Callback):
        def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict) -> None:
            checkpoint["metrics"] = dict(trainer.logged_metrics)

    model = Logs() if card else KeepsInCheckpoint()
    trainer = quiet_trainer(strategy=strategy(), max_steps=3, enable_checkpointing=True, default_root_dir=tmp_path,
                            callbacks=[Card()] if card else [])
    with pytest.raises(PrivacyConfigurationError, match=r"checkpoint hook computed checkpoint entries from the "
                       r"training data: (last|metrics\.train_loss)"):
        trainer.fit(model, loader())
    assert not list(tmp_path.rglob("*.ckpt"))


class KeepsHeldOutMetrics(KeepsInCheckpoint):
    """Copies the held-out metrics, filtered from all of them by name (qa11 a1: reading every key was refused)."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["last"] = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val")}


@pytest.mark.parametrize("make", [KeepsInCheckpoint, KeepsHeldOutMetrics], ids=["by name", "filtered from all"])
def test_a_held_out_metric_read_into_a_checkpoint_trains(make, tmp_path):
    model = make()
    model.name = "val_loss"
    trainer = quiet_trainer(strategy=strategy(), max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path,
                            limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(model, loader(), torch.utils.data.DataLoader(data(16, seed=1), batch_size=16))  # held out
    [path] = list(tmp_path.rglob("*.ckpt"))
    assert "last" in torch.load(path, weights_only=False)
