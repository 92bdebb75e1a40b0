"""Writes to kept state between the release and the update — ``on_after_backward``, ``on_before_optimizer_step`` of
the module or a callback (validators/judged_writes.py, lw31): judged by whether they depend on the private data
beyond the released ĝ. A statistic of the training set kept in a buffer is refused, whether written at every step or
only at some (a late write: run again from the user's state as the call started); the norm of ĝ, a step counter and
an EMA of the weights, at every step or every 5th, train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torch.set_num_threads(1)

Rule = Callable[[int], bool]
EVERY: Rule = lambda step: True  # noqa: E731
FIFTH: Rule = lambda step: step % 5 == 3  # noqa: E731  (silent at the first call: a late write at step 3)


def _statistic(trainer: pl.Trainer) -> torch.Tensor:
    return trainer.train_dataloader.dataset.tensors[0].mean(0)


def _gradient_norm(module: pl.LightningModule) -> torch.Tensor:
    return torch.stack([p.grad.norm() for p in module.parameters()]).norm()


class Hinted(Classifier):
    """Keeps a buffer ``hint`` (zeros at the start); ``write(self)`` runs in ``hook`` when ``when(global_step)``."""

    def __init__(self, hook: str = "", when: Rule = EVERY, write: Callable[[Any], None] = lambda m: None) -> None:
        super().__init__()
        self.register_buffer("hint", torch.zeros(4))
        self.hook, self.when, self.write = hook, when, write

    def _maybe(self, hook: str) -> None:
        if hook == self.hook and self.when(self.global_step):
            with torch.no_grad():
                self.write(self)

    def on_after_backward(self) -> None:
        self._maybe("on_after_backward")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._maybe("on_before_optimizer_step")


class Writes(pl.Callback):
    """A callback doing the same in its own ``hook``."""

    def __init__(self, hook: str, when: Rule, write: Callable[[Any], None]) -> None:
        self.hook, self.when, self.write = hook, when, write

    def _maybe(self, hook: str, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if hook == self.hook and self.when(trainer.global_step):
            with torch.no_grad():
                self.write(module)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe("on_after_backward", trainer, pl_module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._maybe("on_before_optimizer_step", trainer, pl_module)


def _leak(module: Any) -> None:
    module.hint.copy_(_statistic(module.trainer))


def _fit(model: pl.LightningModule, callbacks: tuple = (), loader: Any = None) -> pl.Trainer:
    trainer = quiet_trainer(strategy=strategy(), max_steps=10, callbacks=list(callbacks), num_sanity_val_steps=0)
    trainer.fit(model, loader if loader is not None else DataLoader(data(64), batch_size=8))
    return trainer


def _in(owner: str, hook: str, when: Rule, write: Callable[[Any], None]) -> tuple[Hinted, tuple]:
    return (Hinted(hook, when, write), ()) if owner == "module" else (Hinted(), (Writes(hook, when, write),))


@pytest.mark.parametrize("owner, hook, when", [
    ("module", "on_after_backward", EVERY), ("module", "on_after_backward", FIFTH),
    ("module", "on_before_optimizer_step", FIFTH), ("callback", "on_before_optimizer_step", EVERY),
    ("callback", "on_before_optimizer_step", FIFTH), ("callback", "on_after_backward", FIFTH)],
    ids=["module-backward-every", "module-backward-5th", "module-optimizer-5th", "callback-optimizer-every",
         "callback-optimizer-5th", "callback-backward-5th"])
def test_a_statistic_of_the_training_set_kept_between_the_release_and_the_update_is_refused(
        owner: str, hook: str, when: Rule) -> None:
    model, callbacks = _in(owner, hook, when, _leak)
    with pytest.raises(PrivacyConfigurationError, match="public_state") as refusal:
        _fit(model, callbacks)
    assert "hint" in str(refusal.value) and hook in str(refusal.value)
    assert model.trainer.global_step == (0 if when is EVERY else 3)
    assert not model.hint.any()  # nothing of the refused write stays in memory


def test_a_statistic_of_the_datamodules_copy_kept_every_fifth_step_is_refused() -> None:
    class Data(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.x = data(64).tensors[0]

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(self.x, (self.x[:, 0] > 0).long()), batch_size=8)

    model = Hinted("on_before_optimizer_step", FIFTH, lambda m: m.hint.copy_(m.trainer.datamodule.x.mean(0)))
    trainer = quiet_trainer(strategy=strategy(), max_steps=10, num_sanity_val_steps=0)
    with pytest.raises(PrivacyConfigurationError, match="hint"):
        trainer.fit(model, datamodule=Data())
    assert trainer.global_step == 3 and not model.hint.any()


def _norm_into_hint(module: Any) -> None:
    module.hint[0] = _gradient_norm(module)


def _count(module: Any) -> None:
    module.hint[1] += 1


@pytest.mark.parametrize("owner, hook, when, write", [
    ("module", "on_after_backward", EVERY, _norm_into_hint), ("module", "on_before_optimizer_step", FIFTH,
                                                              _norm_into_hint),
    ("callback", "on_before_optimizer_step", FIFTH, _norm_into_hint), ("module", "on_after_backward", EVERY, _count),
    ("callback", "on_after_backward", FIFTH, _count)],
    ids=["gnorm-every", "gnorm-5th", "callback-gnorm-5th", "counter-every", "callback-counter-5th"])
def test_the_norm_of_the_released_gradient_and_a_step_counter_train(owner: str, hook: str, when: Rule,
                                                                    write: Callable[[Any], None]) -> None:
    model, callbacks = _in(owner, hook, when, write)
    assert _fit(model, callbacks).global_step == 10
    assert float(model.hint[0]) > 0 if write is _norm_into_hint else float(model.hint[1]) == (10 if when is EVERY
                                                                                               else 2)


class Averaging(Classifier):
    """An EMA of the weights in a buffer, updated in ``on_before_optimizer_step`` (accepted before lw31 too)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", self.net[0].weight.detach().clone())

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(self.net[0].weight, alpha=0.1)


def test_an_ema_of_the_weights_kept_before_the_update_trains() -> None:
    model = Averaging()
    start = model.ema.clone()
    assert _fit(model).global_step == 10
    assert not torch.equal(model.ema, start)


class Scheduled(Classifier):
    """SGD with momentum and a StepLR scheduler; ``write(self, optimizer)`` runs in ``on_before_optimizer_step`` when
    ``when(global_step)`` (the optimizer's and the scheduler's state, saved in the checkpoint: zoo32 j04, j05, j11)."""

    def __init__(self, when: Rule = EVERY, write: Callable[[Any, Any], None] = lambda m, o: None) -> None:
        super().__init__()
        self.when, self.write = when, write

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 100)
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.when(self.global_step):
            with torch.no_grad():
                self.write(self, optimizer)


def _first(module: Any) -> torch.Tensor:
    return next(module.parameters())


@pytest.mark.parametrize("when", [EVERY, FIFTH], ids=["every", "5th"])
@pytest.mark.parametrize("write, named", [
    (lambda m, o: o.state[_first(m)].__setitem__("feat_mean", _statistic(m.trainer).clone()), "feat_mean"),
    (lambda m, o: o.param_groups[0].__setitem__("x_mean", _statistic(m.trainer).tolist()), "x_mean"),
    (lambda m, o: setattr(m.scheduler, "feature_mean", _statistic(m.trainer).clone()), "feature_mean")],
    ids=["optimizer-state", "param-group", "scheduler"])
def test_a_statistic_of_the_training_set_kept_in_the_optimizer_or_its_scheduler_is_refused(
        write: Callable[[Any, Any], None], named: str, when: Rule) -> None:
    model = Scheduled(when, write)
    with pytest.raises(PrivacyConfigurationError, match="Optimizer or scheduler state") as refusal:
        _fit(model)
    message = str(refusal.value)
    assert named in message and "on_before_optimizer_step" in message and "step count" in message
    assert model.trainer.global_step == (0 if when is EVERY else 3)
    optimizer = model.trainer.optimizers[0]  # nothing of the refused write stays in memory
    assert "feat_mean" not in optimizer.state.get(_first(model), {}) and "x_mean" not in optimizer.param_groups[0]
    assert not hasattr(model.scheduler, "feature_mean")


def _warm_up(module: Any, optimizer: Any) -> None:
    for group in optimizer.param_groups:
        group["lr"] = 0.5 * min(1.0, (module.global_step + 1) / 10)


def _steps_kept(module: Any, optimizer: Any) -> None:  # a count in the optimizer's state, a group's, a scheduler's
    optimizer.state[_first(module)]["hook_steps"] = torch.tensor(float(module.global_step))
    optimizer.param_groups[0]["hook_steps"] = module.global_step
    module.scheduler.hook_steps = module.global_step


def _clip_and_decay(module: Any, optimizer: Any) -> None:
    torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
    for p in module.parameters():
        p.grad.add_(p, alpha=1e-3)
    module.log_dict(pl.utilities.grad_norm(module, norm_type=2))


@pytest.mark.parametrize("when, write", [(EVERY, _warm_up), (FIFTH, _warm_up), (EVERY, _steps_kept),
                                         (FIFTH, _steps_kept), (EVERY, _clip_and_decay)],
                         ids=["warm-up", "warm-up-5th", "counts", "counts-5th", "clip-decay-grad-norm"])
def test_settings_from_the_step_count_and_the_released_gradient_train(when: Rule,
                                                                       write: Callable[[Any, Any], None]) -> None:
    model = Scheduled(when, write)
    assert _fit(model).global_step == 10
    optimizer = model.trainer.optimizers[0]
    if write is _warm_up:
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 if when is EVERY else 0.5 * 9 / 10)
    if write is _steps_kept:
        assert optimizer.param_groups[0]["hook_steps"] == model.scheduler.hook_steps == (9 if when is EVERY else 8)
        assert float(optimizer.state[_first(model)]["hook_steps"]) == model.scheduler.hook_steps


def test_an_ema_callback_trains_beside_a_warm_up() -> None:
    from pytorch_lightning.callbacks import WeightAveraging

    model = Scheduled(EVERY, _warm_up)
    assert _fit(model, (WeightAveraging(),)).global_step == 10
