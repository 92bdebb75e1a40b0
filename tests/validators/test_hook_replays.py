"""Warm starts before training (validators/hook_replays.py, ``StepReplays._replay_epoch_hooks`` in
validators/step_replays.py, rule 3 of docs/release_boundary.md): a non-private fit of the weights on the training set
in a hook that sees no batch — plain SGD in ``setup``, the run's own optimizer in ``on_fit_start``, a callback's ``on_train_start``, a head refreshed at an
epoch's start, a least-squares head whose solve is not bit for bit repeatable — is refused before any release,
naming the hook; the same warm starts on public data train."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, plain_step, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.hook_replays import weights_moved_by_data  # noqa: E402


def _sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 5,
         optimizer: torch.optim.Optimizer | None = None) -> None:
    """A plain, non-private fit: full-batch SGD on (x, y)."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    optimizer.zero_grad()


class Data(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.train_set = data(64)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=16)


class WarmInSetup(Classifier):
    """Plain SGD on the training set in setup (before the engine is attached: the real fit trains)."""

    def setup(self, stage: str) -> None:
        _sgd(self, *self.trainer.datamodule.train_set.tensors)


class WarmWithTheRunsOptimizer(Classifier):
    """The run's own optimizer, stepped on the training set in on_fit_start."""

    def on_fit_start(self) -> None:
        _sgd(self, *self.trainer.datamodule.train_set.tensors, optimizer=self.trainer.optimizers[0])


class WarmCallback(pl.Callback):
    """A callback's setup: plain SGD on the training set."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _sgd(pl_module, *trainer.datamodule.train_set.tensors)


class WarmAtTrainStart(pl.Callback):
    """on_train_start (run by the loop with gradients on): plain SGD on the training loader's dataset."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sgd(pl_module, *trainer.train_dataloader.dataset.tensors)


class HeadRefreshedAtEpochStart(pl.Callback):
    """The last layer refitted by SGD on the whole training set at every epoch's start."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        x, y = trainer.train_dataloader.dataset.tensors
        _sgd(pl_module, x, y, optimizer=torch.optim.SGD(pl_module.net[2].parameters(), lr=0.5))


def _fit(model: pl.LightningModule, callbacks: list[Any] = (), steps: int = 4, **kwargs: Any):
    dp = strategy(**kwargs)
    quiet_trainer(strategy=dp, max_steps=steps, callbacks=list(callbacks)).fit(model, datamodule=Data())
    return dp


@pytest.mark.parametrize("model, callbacks, hook", [
    (WarmInSetup, [], "WarmInSetup.setup"),
    (WarmWithTheRunsOptimizer, [], "WarmWithTheRunsOptimizer.on_fit_start"),
    (Classifier, [WarmCallback], "WarmCallback.setup"),
    (Classifier, [WarmAtTrainStart], "WarmAtTrainStart.on_train_start"),
    (Classifier, [HeadRefreshedAtEpochStart], "HeadRefreshedAtEpochStart.on_train_epoch_start"),
])
def test_a_warm_start_on_the_training_set_is_refused_before_any_release_naming_its_hook(model, callbacks, hook):
    """The replays run with the engine put aside (ghost's book-keeping forward leaves the weights' gradients to the
    release: a warm start's steps moved nothing there) and with gradients on as the loop runs these hooks."""
    dp = strategy()
    pattern = rf"hooks that see no batch.*fitted to the training data by {hook.replace('.', '[.]')}.*parameter net[.]"
    with pytest.raises(PrivacyConfigurationError, match=pattern):
        quiet_trainer(strategy=dp, max_steps=4, callbacks=[cb() for cb in callbacks]).fit(model(), datamodule=Data())
    assert dp.ledger.steps == 0, "refused before any release"


@pytest.mark.parametrize("engine", ["vmap", "opacus_hooks"])
def test_a_warm_start_at_train_start_is_refused_on_every_engine(engine):
    """vmap and opacus_hooks leave ordinary gradients: their real on_train_start warm start trains the weights."""
    with pytest.raises(PrivacyConfigurationError, match=r"fitted to the training data by WarmAtTrainStart"):
        _fit(Classifier(), [WarmAtTrainStart()], per_sample=engine)


class LeastSquaresHead(Classifier):
    """A closed-form last layer on the training features, in setup; the solve's last bits vary from run to run (as a
    least-squares solve on several threads, or a GPU's atomic sums, do): each value one unit in the last place up or
    down at random, so the plain replays differ too."""

    def setup(self, stage: str) -> None:
        self.fit_head(*self.trainer.datamodule.train_set.tensors)

    def fit_head(self, x: torch.Tensor, y: torch.Tensor) -> None:
        head = self.net[2]
        with torch.no_grad():
            features = torch.cat([self.net[1](self.net[0](x)), torch.ones(len(x), 1)], 1)
            solution = torch.linalg.lstsq(features, nn.functional.one_hot(y, 2).float()).solution
            bits = torch.frombuffer(bytearray(os.urandom(solution.numel())), dtype=torch.uint8).view_as(solution)
            solution = torch.nextafter(solution, torch.where(bits % 2 == 1, 1.0, -1.0) * float("inf"))
            head.weight.copy_(solution[:-1].T)
            head.bias.copy_(solution[-1])


def test_a_closed_form_head_whose_plain_replays_round_apart_is_refused():
    """The plain replays leave the weights a unit in the last place apart (taken for a time stamp entry by entry);
    the exchanged training data moves them by orders of magnitude more."""
    with pytest.raises(PrivacyConfigurationError, match=r"by LeastSquaresHead\.setup.*parameter net\.2\.weight"):
        _fit(LeastSquaresHead())


def test_weights_moved_by_data_tells_rounding_from_the_data():
    values = torch.linspace(-1, 1, 10)
    ulp = torch.finfo(torch.float32).eps

    def moved(again: torch.Tensor, other: torch.Tensor, entries: tuple[int, int, int] = (1, 2, 3)) -> list[str]:
        plain_, again_, other_ = ({"parameter w": e, "attribute t": e} for e in entries)
        return weights_moved_by_data(plain_, again_, other_, [{"w": values}, {"w": other}, {"w": again}])

    # the plain replays a few ulps apart (a threaded solve), the exchanged one far: the data's
    assert moved(values + 2 * ulp, values + 0.1) == ["parameter w"]
    # a time stamp (or an unseeded draw) moves the second plain replay as far as the exchanged one
    assert moved(values - 0.1, values + 0.1) == []
    # the plain replays alike: any move of the exchanged one is the data's ...
    assert moved(values, values + 0.1, (1, 1, 2)) == ["parameter w"]
    assert moved(values, values, (1, 1, 2)) == ["parameter w"], "a move between the sampled positions"
    # ... but one of a few ulps is rounding (a threaded solve that happened to round alike twice)
    assert moved(values, values + 2 * ulp, (1, 1, 2)) == []
    # entries the fingerprint finds alike are not the sketches' to judge, nor state other than the weights
    assert moved(values, values + 0.1, (1, 1, 1)) == []


class PublicWarmStart(Classifier):
    """Plain SGD on a public set (another population, not the training set) in setup and at train start."""

    def __init__(self) -> None:
        super().__init__()
        self.public = TensorDataset(*data(128, seed=7).tensors)

    def setup(self, stage: str) -> None:
        _sgd(self, *self.public.tensors)

    def on_train_start(self) -> None:
        _sgd(self, *self.public.tensors, steps=2)


class PublicLeastSquaresHead(LeastSquaresHead):
    """The same closed-form head, rounded at random in its last bit, fitted to a public set in on_fit_start."""

    def setup(self, stage: str) -> None:
        pass

    def on_fit_start(self) -> None:
        self.fit_head(*data(128, seed=7).tensors)


@pytest.mark.parametrize("model, engine", [(PublicWarmStart, "ghost"), (PublicWarmStart, "vmap"),
                                           (PublicLeastSquaresHead, "ghost")])
def test_a_warm_start_on_public_data_trains(model, engine):
    dp = _fit(model(), steps=6, per_sample=engine)
    assert dp.ledger.steps == 6


def test_the_engine_put_aside_gives_ordinary_gradients_and_comes_back_as_it_was():
    """Inside ``engine_aside`` a backward leaves ordinary gradients (ghost's book-keeping forward is gone) and an
    optimizer's step moves the weights; on exit the gradients are put back and the engine is attached again."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    step, _, _ = plain_step(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)  # plain_step's data
    try:
        linear = model[0]
        assert "forward" in vars(linear), "ghost's book-keeping forward is attached"
        with step.engine_aside():
            assert "forward" not in vars(linear)
            nn.functional.cross_entropy(model(x), y).backward()
            assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0
        assert linear.weight.grad is None, "the gradients put back as they were"
        assert "forward" in vars(linear), "the engine attached again"
        nn.functional.cross_entropy(model(x), y).backward()
        assert linear.weight.grad is None, "the book-keeping forward leaves the weights' gradients to the release"
    finally:
        step.detach()


class FrozenFirstLayer(Classifier):
    """Its first layer's weight frozen; a callback unfreezes it from the second epoch on."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)


class UnfreezesFromTheSecondEpoch(pl.Callback):
    """Sets the first layer trainable from epoch 1 on (frozen before). The first step replays this hook as the module
    runs at the plan's last step (epoch 1), where it unfreezes the layer; the real run's epoch 0 must not train it.
    Its batch-end hook only reads the flag (raises if the layer trains in epoch 0: nothing kept)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.net[0].weight.requires_grad_(trainer.current_epoch >= 1)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.current_epoch == 0 and pl_module.net[0].weight.requires_grad:
            raise AssertionError("a replay's unfreezing was left to the real run's first epoch")


def test_the_first_steps_replays_leave_the_parameters_trainability_as_the_real_hooks_set_it():
    model = FrozenFirstLayer()
    frozen = model.net[0].weight.detach().clone()
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=6, callbacks=[UnfreezesFromTheSecondEpoch()]).fit(model, DataLoader(
        data(64), batch_size=16))
    assert dp.ledger.steps == 6
    assert model.net[0].weight.requires_grad, "unfrozen by the real hook at epoch 1"
    assert not torch.equal(model.net[0].weight.detach(), frozen), "trained from epoch 1 on"


# A logger of the user's added to trainer.loggers in on_train_start (zoo30 l11): the epoch hooks' replays run that
# on_train_start again; the replays put the loggers' list back (one logger added, as by the real hook), and the logger
# is judged as one present from the fit's start is (it crashed: the replays muted a logger listed twice).

class Recording(pl.Callback):
    """A logger of the user's (made by ``make``; the callback keeps no reference to it: a callback's attributes are
    its state), appended to ``trainer.loggers`` as training starts."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.loggers = [*trainer.loggers, self.make()]


class RateFromTheLatestLogger(pl.Callback):
    """At each epoch's start from the second, the learning rate from what the last logger listed keeps."""

    def __init__(self, rule: Any) -> None:
        self.rule = rule

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > 0:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = self.rule(trainer.loggers[-1].kept)


class LogsTheLoss(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss


def _late_logger(encode: Any) -> Any:
    from user_loggers import UserLogger

    class Keeps(UserLogger):
        def __init__(self) -> None:
            super().__init__()
            self.kept: list[float] = []

        def log_metrics(self, metrics: dict, step: Any = None) -> None:
            if "train_loss" in metrics:
                self.kept.append(encode(float(metrics["train_loss"]), step))
    return Keeps()


@pytest.mark.parametrize("late", [True, False])
def test_a_logger_added_at_train_start_keeping_the_loss_is_refused_as_one_there_from_the_start(late, tmp_path):
    def keeps() -> Any:
        return _late_logger(lambda v, step: int(v * 1000))

    callbacks = [RateFromTheLatestLogger(lambda kept: 0.1 * kept[-1] / 1000 if kept else 0.05)]
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, max_epochs=3, log_every_n_steps=1, callbacks=callbacks + (
        [Recording(keeps)] if late else []), logger=[_late_logger(lambda v, step: step)] + ([] if late else [keeps()]),
        default_root_dir=tmp_path)
    with pytest.raises(PrivacyConfigurationError, match=r"optimizer's hyper-parameters.*end of an epoch"):
        trainer.fit(LogsTheLoss(), DataLoader(data(64), batch_size=16))
    assert dp.ledger.steps == 4, "the first epoch's releases only"


def test_a_logger_added_at_train_start_keeping_the_steps_trains_and_is_added_once(tmp_path):
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, max_epochs=3, log_every_n_steps=1, logger=[_late_logger(lambda v, s: s)],
                            callbacks=[Recording(lambda: _late_logger(lambda v, step: step)),
                                       RateFromTheLatestLogger(lambda kept: 0.5 if len(kept) > 3 else 1.0)],
                            default_root_dir=tmp_path)
    trainer.fit(LogsTheLoss(), DataLoader(data(64), batch_size=16))
    assert dp.ledger.steps == 12
    assert len(trainer.loggers) == 2, "the replays' on_train_start added no logger"
    assert trainer.loggers[1].kept == list(range(12)), "the real calls only"
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.5
