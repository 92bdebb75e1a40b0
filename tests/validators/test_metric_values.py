"""A torchmetrics Metric's accumulated state is the training data's, like a logged value (validators/metric_values.py,
rules 3 and 10 of docs/release_boundary.md): decisions and kept state set from it outside a step are refused; logging
it, a custom metric's own update, and held-out metrics deciding train."""

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
from cases import Classifier, fit, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torchmetrics = pytest.importorskip("torchmetrics")


class Tracks(Classifier):
    """Updates a running mean of its loss and its accuracy in training_step (nothing logged)."""

    def __init__(self) -> None:
        super().__init__()
        self.running = torchmetrics.MeanMetric()
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.running.update(loss.detach())
        self.accuracy.update(logits.argmax(1), y)
        return loss


class Decides(pl.Callback):
    """At an epoch's end, decides from the module's training metrics (read by compute()), then resets them."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss, acc = float(pl_module.running.compute()), float(pl_module.accuracy.compute())
        if self.how == "stop below":  # a stop once the loss falls under a bound it is under
            trainer.should_stop = loss < 100.0
        elif self.how == "stop above":  # a stop while it is above one it is above
            trainer.should_stop = loss > 0.01
        elif self.how == "lr":
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.1 * (1 + acc)
        pl_module.running.reset()
        pl_module.accuracy.reset()


@pytest.mark.parametrize("how", ["stop below", "stop above", "lr"])
def test_a_decision_from_a_training_metric_is_refused(how):
    """Refused at the first epoch's end: the window's runs on other data read the metrics moved far, then near zero
    (a stop while the loss is above a bound too)."""
    model = Tracks()
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"changed at the end of an epoch \(on_train_epoch_end"):
        quiet_trainer(strategy=dp, max_steps=12, callbacks=[Decides(how)]).fit(model, loader())
    assert dp.ledger.steps == 4, "the first epoch released; the decision at its end refused before the next"


class Remembers(Classifier):
    """Collects its features and labels in CatMetrics and copies their statistics into buffers at an epoch's end (a
    center loss's centroids, class weights): read by compute() or by a state directly."""

    def __init__(self, direct: bool = False) -> None:
        super().__init__()
        self.direct = direct
        self.feats, self.labels = torchmetrics.CatMetric(), torchmetrics.CatMetric()
        self.register_buffer("centroids", torch.zeros(2, 8))
        self.register_buffer("class_w", torch.ones(2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.net[1](self.net[0](x))
        self.feats.update(h.detach())
        self.labels.update(y.float())
        loss = nn.functional.cross_entropy(self.net[2](h), y, weight=self.class_w)
        return loss + 0.1 * ((h - self.centroids[y]) ** 2).sum(1).mean()

    def on_train_epoch_end(self) -> None:
        with torch.no_grad():
            if self.direct:  # the state itself (a list of the batches' tensors), not compute()
                ys = torch.cat(self.labels.value).long().clamp(0, 1)
                counts = torch.bincount(ys, minlength=2).float()
                self.class_w.copy_(counts.sum() / (2 * counts.clamp(min=1)))
            else:
                hs, ys = self.feats.compute(), self.labels.compute().long().clamp(0, 1)
                for k in range(2):
                    self.centroids[k] = hs[ys == k].mean(0) if bool((ys == k).any()) else 0.0
        self.feats.reset()
        self.labels.reset()


@pytest.mark.parametrize("direct", [False, True])
def test_a_buffer_set_from_a_training_metrics_state_is_refused(direct):
    model = Remembers(direct)
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"Kept state written outside the release: buffer "):
        quiet_trainer(strategy=dp, max_steps=12).fit(model, loader())
    assert dp.ledger.steps == 4


class MyAccuracy(torchmetrics.Metric):
    """torchmetrics' "Implementing a Metric" example: its update adds to its own states in place."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self._count(preds, target)
        self.total += target.numel()

    def _count(self, preds: torch.Tensor, target: torch.Tensor) -> None:  # a helper of its own update
        self.correct += torch.sum(preds == target)

    def compute(self) -> torch.Tensor:
        return self.correct.float() / self.total

    def correct_so_far(self) -> torch.Tensor:  # not its machinery: what it returns is its state
        return self.correct


class LogsMyAccuracy(Classifier):
    def __init__(self, peek: bool = False) -> None:
        super().__init__()
        self.peek = peek
        self.acc = MyAccuracy()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.acc(logits.argmax(1), y)
        self.log("train_acc", self.acc, on_step=False, on_epoch=True)
        loss = nn.functional.cross_entropy(logits, y)
        return loss * (1 + float(self.acc.correct_so_far())) if self.peek else loss


def test_a_custom_metric_adding_to_its_own_states_is_logged_and_trains():
    model = LogsMyAccuracy()
    assert fit(model, steps=8).ledger.steps == 8
    assert 0 <= float(model.trainer.callback_metrics["train_acc"]) <= 1
    peeking = LogsMyAccuracy(peek=True)
    with pytest.raises(PrivacyConfigurationError, match=r"'acc\.correct' were read back in training_step"):
        fit(peeking, steps=4)


class LogsAtEpochEnd(Tracks):
    """The ordinary use: the training metrics computed, logged and reset at an epoch's end; a held-out accuracy
    stops the fit and sets the rate at validation's end."""

    def __init__(self) -> None:
        super().__init__()
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)

    def on_train_epoch_end(self) -> None:
        self.log("train_loss_epoch", self.running.compute())
        self.log("train_acc_epoch", self.accuracy.compute())
        self.running.reset()
        self.accuracy.reset()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_acc.update(self(batch[0]).argmax(1), batch[1])

    def on_validation_epoch_end(self) -> None:
        acc = float(self.val_acc.compute())
        self.val_acc.reset()
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = 0.5 * (1 + acc)
        if self.trainer.current_epoch >= 1 and acc > -1.0:
            self.trainer.should_stop = True


def test_logging_a_training_metric_and_deciding_from_a_held_out_one_train():
    from cases import data
    from torch.utils.data import DataLoader

    model = LogsAtEpochEnd()
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, max_epochs=4, num_sanity_val_steps=0)
    trainer.fit(model, loader(), DataLoader(data(32, seed=1), batch_size=16))
    assert dp.ledger.steps == 8, "two epochs, stopped by the held-out accuracy"
    assert "train_acc_epoch" in trainer.callback_metrics


def test_a_training_metric_declared_public_may_decide():
    model = Tracks()
    dp = fit(model, steps=12, callbacks=[Decides("lr")], public_state=["running", "accuracy"])
    assert dp.ledger.steps == 12


class SavesWhenAccurate(pl.Callback):
    """Saves a checkpoint at an epoch's end when the training accuracy is above ``bound`` (-1: every epoch)."""

    def __init__(self, path: Path, bound: float) -> None:
        self.path, self.bound = path, bound

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc = float(pl_module.accuracy.compute())
        pl_module.accuracy.reset()
        pl_module.running.reset()
        if acc > self.bound:
            trainer.save_checkpoint(self.path / f"epoch{trainer.current_epoch}.ckpt")


def test_a_checkpoint_saved_when_a_training_metric_passes_a_bound_is_refused_and_one_every_epoch_is_written(tmp_path):
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"at the end of an epoch.*trainer checkpoints saved"):
        quiet_trainer(strategy=dp, max_steps=12, callbacks=[SavesWhenAccurate(tmp_path, 0.01)]).fit(Tracks(), loader())
    assert not list(tmp_path.iterdir()), "refused before the checkpoint was written"
    dp = strategy()  # on other records: its own ledger
    quiet_trainer(strategy=dp, max_steps=12, callbacks=[SavesWhenAccurate(tmp_path, -1.0)]).fit(Tracks(),
                                                                                                loader(seed=1))
    assert dp.ledger.steps == 12 and len(list(tmp_path.iterdir())) == 3



class SavesNamedByAccuracy(SavesWhenAccurate):
    """Saves every epoch under a name carrying the training accuracy (zoo23 d1: the value in the file name)."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc = float(pl_module.accuracy.compute())
        pl_module.accuracy.reset()
        pl_module.running.reset()
        trainer.save_checkpoint(self.path / f"epoch{trainer.current_epoch}-acc={acc:.6f}.ckpt")


def test_a_checkpoint_named_by_a_training_metric_is_refused_before_it_is_written(tmp_path):
    with pytest.raises(PrivacyConfigurationError, match=r"at the end of an epoch.*trainer checkpoints saved"):
        quiet_trainer(strategy=strategy(), max_steps=12, callbacks=[SavesNamedByAccuracy(tmp_path, -1.0)]).fit(
            Tracks(), loader())
    assert not list(tmp_path.iterdir())


def test_the_metric_watch_lets_the_fits_callbacks_go_when_it_ends():
    """validators/metric_values.unwatch: the callbacks ``watch`` was handed (closures over the fit's module, which
    holds its trainer and through it the training data) are not kept by that module's globals after the fit."""
    import gc
    import weakref

    from lightning_dp.validators import metric_values

    class Held:
        pass

    held = Held()
    ref = weakref.ref(held)
    metric_values.watch(lambda: None, lambda read, hook, kept=held: RuntimeError(f"{kept} {read}"),
                        lambda metric, kept=held: f"{kept}", lambda metric: False)
    metric_values.unwatch()
    del held
    gc.collect()
    assert ref() is None
