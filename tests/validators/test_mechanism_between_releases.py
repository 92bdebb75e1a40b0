"""σ and C between two releases (validators/mechanism_notes.py; zoo15 sm1-C): a clipping bound or noise multiplier set
in a learning-rate scheduler's lambda — after the batch-end hooks the decision windows judge — from a value read back
from a logger's storage (SecondMomentMonitor's non-private per-example norms, the logged training loss) is refused
before the next release; σ or C from the epoch number in a judged hook, and AdaptiveClipping, train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from pytorch_lightning.loggers import Logger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError, SecondMomentMonitor  # noqa: E402
from lightning_dp.clipping import AdaptiveClipping  # noqa: E402

MEDIAN = "nonprivate/grad_norm/median"


class MemoryLogger(Logger):
    """A user's logger that keeps every row it is given (the un-noised values are the data's)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self.rows.append(dict(metrics))

    def last(self, tag: str) -> Optional[float]:
        values = [row[tag] for row in self.rows if tag in row]
        return float(values[-1]) if values else None


class SetInTheLambda(Classifier):
    """A LambdaLR (interval "step") whose lambda calls ``setter(trainer, value)`` with the logger's last ``tag``."""

    def __init__(self, tag: str, setter: Callable[[pl.Trainer, float], None], log_loss: bool = False) -> None:
        super().__init__()
        self.tag, self.setter, self.log_loss = tag, setter, log_loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.log_loss:
            self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)

        def lam(step: int) -> float:
            value = self.trainer.logger.last(self.tag) if self.trainer.logger is not None else None
            if value is not None:
                self.setter(self.trainer, value)
            return 1.0

        sch = torch.optim.lr_scheduler.LambdaLR(opt, lam)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


SET_AT: list[int] = []  # the releases taken when a setter first changed σ or C


def _set_c(trainer: pl.Trainer, value: float) -> None:
    SET_AT.append(trainer.strategy.private_step.ledger.steps)
    trainer.strategy.private_step.max_grad_norm = max(0.05, value)


def _set_sigma(trainer: pl.Trainer, value: float) -> None:
    SET_AT.append(trainer.strategy.private_step.ledger.steps)
    trainer.strategy.private_step.noise_multiplier = 0.5 + value


def _fit(module: pl.LightningModule, callbacks: list, steps: Optional[int] = None, epochs: Optional[int] = None,
         logger: Any = False, **strategy_kwargs: Any) -> pl.Trainer:
    limits = {"max_steps": steps} if steps is not None else {"max_epochs": epochs}
    diagnostics = strategy_kwargs.pop("diagnostics", False)
    dp = strategy(**strategy_kwargs)
    if diagnostics:
        dp.enable_non_private_diagnostics()
    trainer = quiet_trainer(strategy=dp, callbacks=callbacks, logger=logger, log_every_n_steps=1, **limits)
    trainer.fit(module, loader(64))
    return trainer


def _monitor() -> SecondMomentMonitor:
    return SecondMomentMonitor(every_n_steps=1, diagnostics="non_private")


def test_a_clipping_bound_set_from_the_logged_non_private_norms_in_a_scheduler_lambda_is_refused() -> None:
    """zoo15 sm1-C: hand-rolled adaptive clipping from SecondMomentMonitor's clean per-example norms, read back from
    the logger's copy in a LambdaLR lambda; C would be released as privacy/clip_norm."""
    dp = strategy()
    dp.enable_non_private_diagnostics()
    logger = MemoryLogger()
    trainer = quiet_trainer(strategy=dp, callbacks=[_monitor()], logger=logger, log_every_n_steps=1, max_steps=4)
    SET_AT.clear()
    with pytest.raises(PrivacyConfigurationError, match=r"between two releases.*clipping bound C.*LambdaLR"):
        trainer.fit(SetInTheLambda(MEDIAN, _set_c), loader(64))
    assert any(MEDIAN in row for row in logger.rows)  # the value was there to read
    assert SET_AT and dp.private_step.ledger.steps == SET_AT[0]  # refused before the next release


def test_a_noise_multiplier_set_from_the_logged_loss_in_a_scheduler_lambda_is_refused() -> None:
    dp = strategy()
    trainer = quiet_trainer(strategy=dp, logger=MemoryLogger(), log_every_n_steps=1, max_steps=4)
    SET_AT.clear()
    with pytest.raises(PrivacyConfigurationError, match=r"between two releases.*noise multiplier σ"):
        trainer.fit(SetInTheLambda("train_loss", _set_sigma, log_loss=True), loader(64))
    assert SET_AT and dp.private_step.ledger.steps == SET_AT[0]  # refused before the next release


class SetInSchedulerStep(Classifier):
    """C written in ``lr_scheduler_step`` from the logger's last value (CSVLogger-like: a store of the logger's)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sch = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        value = self.trainer.logger.last(MEDIAN)
        if value is not None:
            SET_AT.append(self.trainer.strategy.private_step.ledger.steps)
            self.trainer.strategy.private_step.max_grad_norm = value
        scheduler.step()


def test_a_clipping_bound_set_in_lr_scheduler_step_is_refused() -> None:
    dp = strategy()
    dp.enable_non_private_diagnostics()
    trainer = quiet_trainer(strategy=dp, callbacks=[_monitor()], logger=MemoryLogger(), log_every_n_steps=1,
                            max_steps=4)
    SET_AT.clear()
    with pytest.raises(PrivacyConfigurationError, match=r"between two releases.*lr_scheduler_step"):
        trainer.fit(SetInSchedulerStep(), loader(64))
    assert SET_AT and dp.private_step.ledger.steps == SET_AT[0]  # refused before the next release


class SetAtTheLastStep(SetInTheLambda):
    """The lambda sets C only after the last release: nothing more is released, but the strategy would report it."""

    def configure_optimizers(self) -> Any:
        out = super().configure_optimizers()
        lam = out["lr_scheduler"]["scheduler"].lr_lambdas[0]
        out["lr_scheduler"]["scheduler"].lr_lambdas[0] = lambda step: lam(step) if step >= 3 else 1.0
        return out


def test_a_clipping_bound_set_after_the_last_release_is_refused_at_the_end_of_training() -> None:
    dp = strategy()
    dp.enable_non_private_diagnostics()
    trainer = quiet_trainer(strategy=dp, callbacks=[_monitor()], logger=MemoryLogger(), log_every_n_steps=1,
                            max_steps=3)
    with pytest.raises(PrivacyConfigurationError, match=r"end of training"):
        trainer.fit(SetAtTheLastStep(MEDIAN, _set_c), loader(64))


class ClipByEpoch(pl.Callback):
    """A public schedule: C from the epoch number, set in a judged hook."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.private_step.max_grad_norm = 1.0 / (1 + trainer.current_epoch)


class RateByStep(Classifier):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


def test_a_clipping_bound_from_the_epoch_number_trains_beside_a_scheduler() -> None:
    trainer = _fit(RateByStep(), [ClipByEpoch()], epochs=3)
    assert trainer.strategy.private_step.ledger.steps > 3
    assert trainer.strategy.private_step.max_grad_norm == pytest.approx(1.0 / 3)


class NoiseByBatchEnd(pl.Callback):
    """A public σ schedule from the step count at a batch's end (a window judges it)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        trainer.strategy.private_step.noise_multiplier = 1.0 + 0.1 * trainer.global_step


def test_a_noise_multiplier_from_the_step_count_at_batch_end_trains_beside_a_scheduler() -> None:
    trainer = _fit(RateByStep(), [NoiseByBatchEnd()], steps=5)
    sigmas = [entry.noise_multiplier for entry in trainer.strategy.private_step.ledger.entries]
    assert len({round(s, 6) for s in sigmas}) > 1


def test_adaptive_clipping_trains_beside_a_scheduler_and_the_monitor() -> None:
    trainer = _fit(RateByStep(), [_monitor()], steps=8, logger=MemoryLogger(), diagnostics=True,
                   max_grad_norm=None, clipping=AdaptiveClipping(initial_norm=1.0))
    assert trainer.strategy.private_step.ledger.steps == 8
    assert trainer.strategy.private_step.max_grad_norm != 1.0  # C moved with the releases


class SetInTheLambdaBesideABatchEndHook(SetInTheLambda):
    """A batch-end hook of the module's opens a window around the scheduler's step; the window judges the hook (a
    rate by step count), not the lambda that sets C after it."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.trainer.strategy.private_step.noise_multiplier = 1.0 + 0.01 * self.trainer.global_step


def test_a_clipping_bound_set_in_a_lambda_inside_a_judged_window_is_refused() -> None:
    dp = strategy()
    dp.enable_non_private_diagnostics()
    trainer = quiet_trainer(strategy=dp, callbacks=[_monitor()], logger=MemoryLogger(), log_every_n_steps=1,
                            max_steps=4)
    SET_AT.clear()
    with pytest.raises(PrivacyConfigurationError, match=r"set in lr_scheduler_step"):
        trainer.fit(SetInTheLambdaBesideABatchEndHook(MEDIAN, _set_c), loader(64))
    assert SET_AT and dp.private_step.ledger.steps == SET_AT[0]


class _WithAStepScheduler(Classifier):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2)}


class _SaveTheWholeModule(pl.Callback):
    """``torch.save(model)`` at each epoch's end (a whole-module pickle, as MLflow's ``log_model`` does; zoo31 s12)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(pl_module, self.path / f"epoch{trainer.current_epoch}.pt")


def test_the_module_pickles_during_the_fit_and_keeps_no_function_of_the_librarys(tmp_path: Path) -> None:
    """The scheduler's update is watched on Lightning's loop, not by a function put on the user's module (which made
    ``torch.save(model)`` fail mid-fit: "Can't pickle local object")."""
    model = _WithAStepScheduler()
    quiet_trainer(strategy=strategy(), max_epochs=2, callbacks=[_SaveTheWholeModule(tmp_path)]).fit(model, loader(64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch0.pt", "epoch1.pt"]
    loaded = torch.load(tmp_path / "epoch1.pt", weights_only=False)
    assert "lr_scheduler_step" not in vars(loaded) and "lr_scheduler_step" not in vars(model)
