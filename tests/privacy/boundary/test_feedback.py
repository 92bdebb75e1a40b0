"""Rule 6 (privacy/boundary/feedback.py): a value logged from the training batch does not feed back into training.
A plateau scheduler, EarlyStopping or ModelCheckpoint monitoring a training-logged value is refused before the
release it would steer (nothing released, parameters untouched); monitoring a validation metric, ε, or a name
declared public is not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cases import Classifier, data, fit, loader, parameters, strategy, unchanged
from conftest import quiet_trainer
from pytorch_lightning.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dp import PrivacyConfigurationError
from lightning_dp.callbacks import PrivacyBudget
from lightning_dp.validators.monitored import NOT_FROM_DATA, consumers, fed_back


class LogsTrainLoss(Classifier):
    """Logs its training loss (on_step and on_epoch: the forked names too) and a validation loss."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx))


class PlateauOn(LogsTrainLoss):
    """ReduceLROnPlateau on a monitored name."""

    def __init__(self, monitor: str, interval: str = "step") -> None:
        super().__init__()
        self.monitor, self.interval = monitor, interval

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": self.monitor,
                                                   "interval": self.interval}}


class EpochEndTrainAccuracy(LogsTrainLoss):
    """Logs a training statistic only at epoch end (after the epoch's releases)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self._correct = getattr(self, "_correct", 0) + int((self(x).argmax(1) == y).sum())  # public_state below
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.log("train_acc", float(self._correct))


def _refused(model, callbacks=(), **kwargs) -> str:
    before = parameters(model)
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer = quiet_trainer(strategy=strategy(**kwargs), max_steps=3, callbacks=list(callbacks),
                            enable_checkpointing=checkpointing)
    with pytest.raises(PrivacyConfigurationError, match="feeds back into training") as info:
        trainer.fit(model, loader())
    assert unchanged(before, model), "a release was made before the refusal"
    return str(info.value)


@pytest.mark.parametrize("monitor", ["train_loss", "train_loss_step"])
def test_plateau_scheduler_on_the_training_loss_is_refused_before_any_release(monitor):
    message = _refused(PlateauOn(monitor))
    assert f"ReduceLROnPlateau monitors {monitor!r}" in message and "validation_step" in message


@pytest.mark.parametrize("make", [lambda: EarlyStopping(monitor="train_loss", check_on_train_epoch_end=True),
                                  lambda: ModelCheckpoint(monitor="train_loss_epoch")],
                         ids=["EarlyStopping", "ModelCheckpoint"])
def test_callbacks_monitoring_the_training_loss_are_refused(make, tmp_path):
    callback = make()
    if isinstance(callback, ModelCheckpoint):
        callback.dirpath = str(tmp_path)
    assert type(callback).__name__ in _refused(LogsTrainLoss(), [callback])


@pytest.mark.parametrize("template", ["{epoch}-{train_loss:.6f}", "{epoch}-{step}-{train_loss_step}"])
def test_a_checkpoint_filename_naming_the_training_loss_is_refused(template, tmp_path):
    """zoo22 e1: the un-noised loss would be in every checkpoint's file name and in the callback's saved paths."""
    callback = ModelCheckpoint(dirpath=str(tmp_path), filename=template, every_n_train_steps=1, save_top_k=-1)
    assert "ModelCheckpoint's filename template monitors 'train_loss" in _refused(LogsTrainLoss(), [callback])
    assert not list(tmp_path.glob("*.ckpt"))


def test_a_checkpoint_filename_of_counts_or_validation_metrics_trains(tmp_path):
    callback = ModelCheckpoint(dirpath=str(tmp_path), filename="{epoch}-{step}-{val_loss:.3f}", every_n_epochs=1)
    trainer = quiet_trainer(strategy=strategy(), max_epochs=1, callbacks=[callback], limit_val_batches=1,
                            num_sanity_val_steps=0, enable_checkpointing=True)
    trainer.fit(LogsTrainLoss(), loader(64), DataLoader(data(16, seed=1), batch_size=16))
    assert [p.name.startswith("epoch=0-step=") and "val_loss=" in p.name for p in tmp_path.glob("*.ckpt")] == [True]


def test_an_epoch_end_training_statistic_is_refused_before_the_next_release():
    """Logged in on_train_epoch_end (after the epoch's releases and its validation): the epoch-interval plateau
    update reads it, and the next epoch's first release is refused: no release is made with what it steered."""
    model = PlateauOn("train_acc", interval="epoch")
    model.__class__ = type("PlateauOnEpochAcc", (EpochEndTrainAccuracy, PlateauOn), {})
    dp = strategy(public_state=["_correct"])
    trainer = quiet_trainer(strategy=dp, max_epochs=2, limit_val_batches=1, num_sanity_val_steps=0)
    with pytest.raises(PrivacyConfigurationError, match="monitors 'train_acc'"):
        trainer.fit(model, loader(64), DataLoader(data(16, seed=1), batch_size=16))  # held out: other records
    assert trainer.current_epoch == 1 and dp.ledger.steps == len(trainer.train_dataloader), \
        "refused at the second epoch's first release"


def test_a_user_callback_with_a_monitor_is_a_consumer():
    class Steer(Callback):
        monitor = "train_loss"

    with pytest.raises(PrivacyConfigurationError, match="the callback Steer monitors 'train_loss'"):
        fit(LogsTrainLoss(), callbacks=[Steer()])


def test_monitoring_validation_loss_epsilon_or_a_public_name_is_allowed(tmp_path):
    fit(PlateauOn("val_loss", interval="epoch"), steps=3)
    assert "privacy/epsilon" in NOT_FROM_DATA
    stop = EarlyStopping(monitor="privacy/epsilon", stopping_threshold=1e9, check_on_train_epoch_end=True)
    fit(LogsTrainLoss(), steps=3, callbacks=[PrivacyBudget(delta=1e-5), stop])
    fit(PlateauOn("train_loss"), steps=3, public_state=["train_loss"])


def test_consumers_and_fed_back_read_the_trainer():
    class Config:
        reduce_on_plateau, monitor = True, "a"
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD([torch.zeros(1)], lr=1.0))

    class NotPlateau(Config):
        reduce_on_plateau = False

    class Meta:
        def __init__(self, name: str, forked: bool) -> None:
            self.name, self.forked = name, forked

        def forked_name(self, on_step: bool) -> str:
            return self.name + ("_step" if on_step else "_epoch")

    class Result:
        def __init__(self, meta: Meta) -> None:
            self.meta = meta

    class Trainer:
        lr_scheduler_configs = [Config(), NotPlateau()]
        callbacks = [EarlyStopping(monitor="b_epoch"), EarlyStopping(monitor="c")]

        class fit_loop:  # noqa: N801  (Lightning's attribute names)
            class epoch_loop:  # noqa: N801
                _results = {"training_step.a": Result(Meta("a", False)), "training_step.b": Result(Meta("b", True))}

    assert [name for _, name in consumers(Trainer())] == ["a", "b_epoch", "c"]
    assert [name for _, name, _ in fed_back(Trainer(), lambda n: False)] == ["a", "b_epoch"]
    assert [name for _, name, _ in fed_back(Trainer(), lambda n: n == "a")] == ["b_epoch"]


def _split_loaders(kind: str):
    from torch.utils.data import DataLoader, Subset, SubsetRandomSampler, TensorDataset, random_split

    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    y = (x[:, 0] > 0).long()
    full = TensorDataset(x, y)
    if kind == "same loader":
        train = val = full
    elif kind == "same tensors":
        train, val = full, TensorDataset(x, y)
    elif kind == "overlapping subsets":
        train, val = Subset(full, range(0, 64)), Subset(full, range(48, 96))
    elif kind == "random_split":
        train, val = random_split(full, [64, 32], generator=g)
    elif kind == "a copy":  # the training data copied (a float64 original cast again), in other memory
        train, val = full, TensorDataset(x.double().float().clone(), y.clone())
    elif kind == "a copy of some":
        train, val = full, TensorDataset(torch.cat([x[:20].clone(), torch.randn(12, 4, generator=g)]), y[:32].clone())
    elif kind.endswith("samplers"):  # the README's split: SubsetRandomSamplers over one dataset
        order = torch.randperm(96, generator=g).tolist()
        val_rows = order[64:] if kind == "disjoint samplers" else order[48:]
        return (DataLoader(full, batch_size=16, sampler=SubsetRandomSampler(order[:64])),
                DataLoader(full, batch_size=16, sampler=SubsetRandomSampler(val_rows)))
    elif kind.startswith("a sampler and"):  # the training SubsetRandomSampler, a validation Subset
        order = torch.randperm(96, generator=g).tolist()
        val_rows = order[64:] if kind.endswith("a disjoint Subset") else order[60:]
        return (DataLoader(full, batch_size=16, sampler=SubsetRandomSampler(order[:64])),
                DataLoader(Subset(full, val_rows), batch_size=16))
    else:  # disjoint slices of the same tensors
        train, val = TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])
    return DataLoader(train, batch_size=16), DataLoader(val, batch_size=16)


@pytest.mark.parametrize("kind", ["same loader", "same tensors", "overlapping subsets", "a copy", "a copy of some",
                                  "overlapping samplers", "a sampler and an overlapping Subset"])
def test_monitoring_validation_on_the_training_records_is_refused(kind):
    train, val = _split_loaders(kind)
    model = LogsTrainLoss()
    before = parameters(model)
    trainer = quiet_trainer(strategy=strategy(), max_steps=3, num_sanity_val_steps=0,
                            callbacks=[EarlyStopping(monitor="val_loss")])
    with pytest.raises(PrivacyConfigurationError, match="monitors 'val_loss', computed by validation on the training"):
        trainer.fit(model, train, val)
    assert unchanged(before, model)


@pytest.mark.parametrize("kind", ["random_split", "disjoint slices", "disjoint samplers",
                                  "a sampler and a disjoint Subset"])
def test_monitoring_held_out_validation_is_allowed(kind):
    """Disjoint SubsetRandomSamplers over one dataset (the README's split) are held out too: the training rows are
    the population Poisson sampling draws from, the validation rows its sampler's indices."""
    train, val = _split_loaders(kind)
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=3, num_sanity_val_steps=0, val_check_interval=2,
                  callbacks=[EarlyStopping(monitor="val_loss")]).fit(LogsTrainLoss(), train, val)
    assert dp.ledger.steps == 3


class LogsCounter(Classifier):
    """Logs a counter of the loop from ``training_step`` (the Lightning docs' "keep the latest k checkpoints":
    ``self.log("global_step", self.global_step)``, ``ModelCheckpoint(monitor="global_step", mode="max")``), or a
    twin that only looks like one."""

    def __init__(self, how: str = "global_step") -> None:
        super().__init__()
        self.how = how

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.how == "global_step":
            self.log("global_step", float(self.global_step))
        elif self.how == "epoch":
            self.log("global_step", float(self.current_epoch))
        elif self.how == "step plus a bit of the loss":  # a counter at most steps, the batch's at some
            self.log("global_step", float(self.global_step) + float(batch_idx == 1 and bool(loss > 0)))
        elif self.how == "reduced over the epoch":
            self.log("global_step", float(self.global_step), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx))


@pytest.mark.parametrize("how", ["global_step", "epoch"])
def test_monitoring_a_logged_counter_of_the_loop_trains(how, tmp_path):
    """zoo28 l13: the logged value equals the optimizer step (or the epoch) at every release and when validation
    starts after the step it counted: the checkpoints it keeps are chosen by a public count."""
    callback = ModelCheckpoint(dirpath=str(tmp_path), monitor="global_step", mode="max", save_top_k=2,
                               every_n_train_steps=2)
    dp = strategy()
    quiet_trainer(strategy=dp, max_epochs=2, callbacks=[callback], enable_checkpointing=True, limit_val_batches=1,
                  num_sanity_val_steps=0).fit(LogsCounter(how), loader(64), DataLoader(data(16, seed=1), batch_size=16))
    assert dp.ledger.steps == 8 and len(list(tmp_path.glob("*.ckpt"))) == 2


@pytest.mark.parametrize("how", ["step plus a bit of the loss", "reduced over the epoch"])
def test_a_value_that_is_not_a_counter_at_every_release_is_refused(how, tmp_path):
    """The unsafe twins: a value that differs from every counter at one release (before the callback reads it), or
    one Lightning reduces over the epoch, is the training data's."""
    callback = ModelCheckpoint(dirpath=str(tmp_path), monitor="global_step", mode="max", save_top_k=2,
                               every_n_train_steps=1)
    model = LogsCounter(how)
    before = parameters(model)
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, max_epochs=2, callbacks=[callback], enable_checkpointing=True)
    with pytest.raises(PrivacyConfigurationError, match="ModelCheckpoint monitors 'global_step', logged by a training"):
        trainer.fit(model, loader(64))
    if how == "step plus a bit of the loss":  # refused at the second step, before its release and its checkpoint
        assert dp.ledger.steps == 1 and len(list(tmp_path.glob("*.ckpt"))) == 1
    else:  # the name is the training data's from the first release on
        assert dp.ledger.steps == 0 and unchanged(before, model)
