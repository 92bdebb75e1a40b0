"""The learning-rate schedule's own state (validators/schedule_state.py, rule 3 of docs/release_boundary.md): a
scheduler told the batch's loss or labels within a step, a ``StepLR.step_size``, a Lightning config's ``frequency``
or a lambda's closure cell set from the loss steer every later rate, and are refused (zoo16 s1, s2, s3); a scheduler
told the step count at a batch's start or end, or a frequency from the epoch number, trains."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.core.optimizer import LRSchedulerConfig
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.schedule_state import ScheduleNote, put_schedules, schedule_controls  # noqa: E402


class Told(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler that is told a value and scales the rate by it at its next step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.told = None
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        return 1.0 if self.told is None else float(self.told)

    def tell(self, value: Any) -> None:
        self.told = float(value)


def _closure_lambda(box: dict) -> Any:
    return lambda step: box.get("scale", 1.0)


class Schedules(Classifier):
    """Writes its schedule from the data (``how``) in ``training_step`` or ``on_train_batch_start``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.how == "labels at batch start":
            self.lr_schedulers().tell(batch[1].float().mean())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        config = self.trainer.lr_scheduler_configs[0]
        if self.how == "loss":
            self.lr_schedulers().tell(loss.detach())
        elif self.how == "frequency":
            config.frequency = 1 + int(100 * float(loss)) % 3
        elif self.how == "closure":
            config.scheduler.lr_lambdas[0].__closure__[0].cell_contents["scale"] = float(loss)
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _closure_lambda({})) if self.how == "closure" else Told(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ByStepCount(pl.Callback):
    """Tells the scheduler the step count at a batch's start and end, and sets its frequency from the epoch."""

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        trainer.lr_scheduler_configs[0].scheduler.tell(1.0 / (1 + batch_idx))

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        trainer.lr_scheduler_configs[0].scheduler.tell(1.0 / (1 + trainer.global_step))

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        trainer.lr_scheduler_configs[0].frequency = 1 + trainer.current_epoch


@pytest.mark.parametrize("how", ["loss", "labels at batch start", "frequency", "closure"])
def test_a_schedule_set_from_the_batch_is_refused(how: str) -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"lr scheduler 0 (Told|LambdaLR)"):
        fit(Schedules(how), steps=3, noise_multiplier=1e-6)


def test_a_schedule_set_from_the_step_count_trains() -> None:
    model = Schedules("none")
    dp = fit(model, steps=6, callbacks=[ByStepCount()])
    assert dp.ledger.steps == 6
    assert model.trainer.lr_scheduler_configs[0].scheduler.told == pytest.approx(1 / 7)


def test_a_note_compares_the_state_fields_and_closure_and_puts_them_back() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    told = LRSchedulerConfig(Told(opt))
    box: dict = {}
    closure = LRSchedulerConfig(torch.optim.lr_scheduler.LambdaLR(opt, _closure_lambda(box)))
    trainer = type("Trainer", (), {"lr_scheduler_configs": [told, closure]})()
    noted = schedule_controls(trainer)
    assert list(noted) == ["lr scheduler 0 Told", "lr scheduler 1 LambdaLR"]
    assert schedule_controls(trainer) == noted
    told.scheduler.tell(float("nan"))
    told.frequency = 3
    box["scale"] = 2.0
    now = schedule_controls(trainer)
    assert all(now[name] != noted[name] for name in noted)
    assert ScheduleNote(told) == ScheduleNote(told)  # a NaN told equals itself
    put_schedules(trainer, noted)
    assert told.scheduler.told is None and told.frequency == 1
    assert schedule_controls(trainer)["lr scheduler 0 Told"] == noted["lr scheduler 0 Told"]


# ------------------------------------------------------------------ a loop of one's own (validators/plain_loop.py)
def _plain_loop(schedule: Any, steps: int = 4) -> Any:
    """A plain loop that reads (prints) its loss at every step; ``schedule(scheduler, loss)`` runs after the update.
    Returns the step (detached)."""
    from lightning_dp.privacy.noise import GaussianNoise
    from lightning_dp.privacy.private_step import PrivateStep

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = schedule(opt, None)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    step = PrivateStep(1.0, 1.0, GaussianNoise(seed=0), sampler_seed=0)
    step.attach(model, opt)
    try:
        loader = step.poisson_loader(torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16))
        step.verify(lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))
        for _, (xb, yb) in zip(range(steps), loader):
            loss = None
            if step.begin():
                loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
            step.release(optimizer=opt)
            opt.step()
            opt.zero_grad()
            printed = f"{loss.item() if loss is not None else 0.0:.3f}"
            schedule(scheduler, float(printed))
    finally:
        step.detach()
    return step


def _told_the_loss(opt: Any, loss: Any) -> Any:
    if loss is None:
        return Told(opt)
    opt.tell(loss)
    opt.step()


def test_a_plain_loop_telling_a_scheduler_its_loss_is_refused() -> None:
    """A LambdaLR subclass told the loss sets the rate at its step: not a schedule of the step count (zoo16 pl1)."""
    with pytest.raises(PrivacyConfigurationError, match=r"scheduler 0 Told told.*after the loop read"):
        _plain_loop(_told_the_loss)


@pytest.mark.parametrize("kind", ["warm restarts", "sequential", "one cycle"])
def test_a_plain_loop_printing_its_loss_with_torchs_schedulers_trains(kind: str) -> None:
    lr = torch.optim.lr_scheduler
    makers = {"warm restarts": lambda opt: lr.CosineAnnealingWarmRestarts(opt, T_0=2),
              "sequential": lambda opt: lr.SequentialLR(opt, [lr.LinearLR(opt, 0.5, total_iters=2), lr.StepLR(opt, 2)],
                                                        milestones=[2]),
              "one cycle": lambda opt: lr.OneCycleLR(opt, max_lr=0.5, total_steps=20)}

    def schedule(opt_or_scheduler: Any, loss: Any) -> Any:
        if loss is None:
            return makers[kind](opt_or_scheduler)
        opt_or_scheduler.step()

    assert _plain_loop(schedule).ledger.steps == 4


def test_a_scheduler_made_after_the_first_releases_and_told_the_loss_is_refused() -> None:
    """The schedulers are looked for until one is found: one made at the third step is seen (its mark on the
    optimizer, ``initial_lr``, sends the loop to walk the optimizer's referrers again)."""
    made: list[Any] = []

    def late(opt: Any, loss: Any) -> Any:
        if loss is None:
            return opt
        if not made and len(late.seen) == 2:
            made.append(Told(opt))
        late.seen.append(loss)
        if made:
            made[0].tell(loss)
            made[0].step()
        return None

    late.seen = []  # type: ignore[attr-defined]
    with pytest.raises(PrivacyConfigurationError, match=r"scheduler 0 Told told.*after the loop read"):
        _plain_loop(late, steps=6)



def test_a_plain_loop_without_a_scheduler_walks_no_referrers(monkeypatch: pytest.MonkeyPatch) -> None:
    """No scheduler can hold an optimizer no ``LRScheduler.__init__`` marked: the referrer walk (tens of ms a step in
    a large process, issue 38) is not repeated at every release (performance/scheduler_search.py)."""
    import gc

    from lightning_dp.performance import scheduler_search

    walks: list[Any] = []
    monkeypatch.setattr(scheduler_search, "gc", type("Gc", (), {"get_referrers": staticmethod(
        lambda obj: walks.append(obj) or gc.get_referrers(obj))}))
    assert _plain_loop(lambda opt, loss: None).ledger.steps == 4
    assert walks == []
