"""What the closure hands the optimizer is sealed for good (validators/sealed_loss.py: HandedLoss, check_kept): an
optimizer or scheduler that keeps the un-noised loss (``loss.detach()`` in its step, a history in its state) would set
later updates from the private batch, and a checkpoint would carry it. Torch's optimizers, schedulers, checkpoints,
AdamVariant and ``outputs["loss"]`` at batch end work unchanged."""

from __future__ import annotations

import glob
import io
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit, loader, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.callbacks import AdamVariant  # noqa: E402
from lightning_dp.validators.sealed_loss import HandedLoss, SealedLoss, check_kept, handed, sealed, watch  # noqa: E402

KEPT = "keeps the loss its closure returned"
READ = "handed the optimizer, or a value computed from it, was read"


class KeepsLoss(torch.optim.SGD):
    """Keeps the last loss 'for monitoring', as custom optimizers often do; never reads it in its step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_loss = None

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self.last_loss = None if loss is None else loss.detach()
        return loss


class ScaledByTheKeptLoss(Classifier):
    def configure_optimizers(self):
        return KeepsLoss(self.parameters(), lr=0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        last = self.optimizers().optimizer.last_loss
        return loss if last is None else loss / (1.0 + float(last))


class RateFromTheKeptLoss(torch.optim.lr_scheduler.LRScheduler):
    def get_lr(self) -> list[float]:
        last = getattr(self.optimizer, "last_loss", None)
        factor = 1.0 if last is None else (0.5 if float(last) > 0.6 else 1.0)
        return [base * factor for base in self.base_lrs]


class ScheduledByTheKeptLoss(Classifier):
    def configure_optimizers(self):
        optimizer = KeepsLoss(self.parameters(), lr=0.5)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": RateFromTheKeptLoss(optimizer), "interval": "step"}}


class HistoryInState(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        state = self.state[self.param_groups[0]["params"][0]]
        state["loss_hist"] = state.get("loss_hist", []) + [loss.detach().clone()]
        return loss


class KeepsHistoryInState(Classifier):
    def configure_optimizers(self):
        return HistoryInState(self.parameters(), lr=0.5)


@pytest.mark.parametrize("model", [ScaledByTheKeptLoss, ScheduledByTheKeptLoss])
def test_an_optimizer_keeping_the_closures_loss_is_refused_after_its_first_step(model):
    instance = model()
    with pytest.raises(PrivacyConfigurationError, match=KEPT):
        fit(instance, steps=4)
    assert instance.trainer.global_step <= 1


def test_a_loss_history_in_the_optimizers_state_is_refused_before_a_checkpoint_carries_it(tmp_path):
    model = KeepsHistoryInState()
    trainer = quiet_trainer(strategy=strategy(), max_steps=4, enable_checkpointing=True, default_root_dir=tmp_path,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)])
    with pytest.raises(PrivacyConfigurationError, match=r"KEPT|optimizer.state\[p\]\['loss_hist'\]".replace(
            "KEPT", KEPT)):
        trainer.fit(model, loader(64))
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)


class Stats:
    pass


class KeepsLossInAnObject(torch.optim.SGD):
    """Out of the kept-state check's sight (an object of its own): the value still cannot be read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stats = Stats()

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self.stats.kept = loss.detach().clone()  # arithmetic here would be refused inside optimizer_step
        return loss


class ScaledByAnObjectsLoss(Classifier):
    def configure_optimizers(self):
        return KeepsLossInAnObject(self.parameters(), lr=0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        kept = getattr(self.optimizers().optimizer.stats, "kept", None)
        return loss if kept is None else loss * (1.0 + 0.1 * kept).item()


def test_what_the_optimizer_derives_from_the_loss_is_sealed_wherever_it_is_read():
    with pytest.raises(PrivacyConfigurationError, match=READ):
        fit(ScaledByAnObjectsLoss(), steps=4)


class KeepsTheStepsReturn(Classifier):
    """Lightning's optimizer_step override keeping what optimizer.step returned, read at the next batch's start."""

    kept = None

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        type(self).kept = optimizer.step(closure=optimizer_closure)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if type(self).kept is not None:
            self.lr_from_loss = float(type(self).kept)


def test_the_loss_optimizer_step_returned_stays_sealed_after_optimizer_step():
    try:
        with pytest.raises(PrivacyConfigurationError, match=READ):
            fit(KeepsTheStepsReturn(), steps=3)
    finally:  # kept in a class attribute of this module: later fits here fingerprint it (and would be refused)
        KeepsTheStepsReturn.kept = None


def test_the_handed_loss_is_another_object_sealed_for_good_and_the_report_is_not():
    class Module:
        _current_fx_name = "training_step"

    watch(Module())
    try:
        report = sealed(torch.tensor(0.7)).detach().clone()
        given = handed(report)
        assert given is not report and isinstance(given, HandedLoss) and float(report) == pytest.approx(0.7)
        assert given.data_ptr is not None and given.shape == () and given.dtype == torch.float32
        derived = [given.detach(), given.clone(), given.detach().clone(), given.to("cpu")]
        assert all(isinstance(d, HandedLoss) for d in derived)
        for read in (float, bool, lambda t: t.item(), lambda t: t * 2, lambda t: t.tolist(), repr,
                     lambda t: torch.save(t, io.BytesIO()), lambda t: t.as_subclass(torch.Tensor)):
            for value in [given, *derived]:
                with pytest.raises(PrivacyConfigurationError, match=READ):
                    read(value)
        assert handed(None) is None and {given: 1}[given] == 1
    finally:
        watch(None)
    with pytest.raises(PrivacyConfigurationError, match=READ):
        float(given)  # after the fit too


def test_check_kept_sees_attributes_state_groups_and_schedulers_but_not_moments():
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([weight], lr=0.1)
    weight.grad = torch.ones(2)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    check_kept(optimizer, [scheduler])  # moments, step counts, hyper-parameters
    loss = handed(torch.tensor(1.0))
    for keep, undo in [(lambda: setattr(optimizer, "last", loss.detach()), lambda: delattr(optimizer, "last")),
                       (lambda: optimizer.state[weight].__setitem__("h", [loss]),
                        lambda: optimizer.state[weight].pop("h")),
                       (lambda: optimizer.param_groups[0].__setitem__("l", loss),
                        lambda: optimizer.param_groups[0].pop("l")),
                       (lambda: setattr(scheduler, "seen", {"loss": loss}), lambda: delattr(scheduler, "seen"))]:
        keep()
        with pytest.raises(PrivacyConfigurationError, match=KEPT):
            check_kept(optimizer, [scheduler])
        undo()
        check_kept(optimizer, [scheduler])


# positive controls: what torch's optimizers, schedulers and Lightning's own machinery do with the loss


def _with(optimizer: Any, scheduler: Any = None) -> type:
    class Trained(Classifier):
        def configure_optimizers(self):
            opt = optimizer(self.parameters())
            if scheduler is None:
                return opt
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(opt), "interval": "step"}}
    return Trained


@pytest.mark.parametrize("model", [
    _with(lambda p: torch.optim.Adam(p, lr=0.01), lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5)),
    _with(lambda p: torch.optim.AdamW(p, lr=0.01), lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 4)),
    _with(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
          lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10)),
    _with(lambda p: torch.optim.RMSprop(p, lr=0.01)),
    _with(lambda p: torch.optim.Adagrad(p, lr=0.01)),
])
def test_torchs_optimizers_and_schedulers_train(model):
    assert fit(model(), steps=4).ledger.steps == 4


class ReadsTheReport(Classifier):
    """outputs["loss"] read at batch end (a report), logged to the progress bar; Lightning's optimizer_step override
    that only hands the closure on."""

    seen: list = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        returned = optimizer.step(closure=optimizer_closure)
        type(self).seen.append(("returned", type(returned)))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert float(outputs["loss"]) > 0  # read at batch end: a report
        type(self).seen.append(("outputs", type(outputs["loss"])))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_outputs_loss_the_progress_bar_checkpoints_and_adam_variant_are_unchanged(tmp_path):
    ReadsTheReport.seen = []
    model = ReadsTheReport()
    trainer = pl.Trainer(strategy=strategy(), max_steps=4, accelerator="cpu", devices=1, logger=False,
                         enable_model_summary=False, num_sanity_val_steps=0, enable_progress_bar=True,
                         default_root_dir=tmp_path,
                         callbacks=[AdamVariant("bias_corrected"),
                                    ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True)])
    trainer.fit(model, loader(64))
    returned = [s[1] for s in ReadsTheReport.seen if s[0] == "returned"]
    outputs = [s for s in ReadsTheReport.seen if s[0] == "outputs"]
    assert len(outputs) == 4 and all(t is SealedLoss for _, t in outputs)
    assert returned == [HandedLoss] * 4
    assert "train_loss" in trainer.progress_bar_metrics
    checkpoints = glob.glob(str(tmp_path / "*.ckpt"))
    assert checkpoints
    for path in checkpoints:
        state = torch.load(path, weights_only=False)["optimizer_states"][0]["state"]
        assert not any(isinstance(v, SealedLoss) for entry in state.values() for v in entry.values())
