"""The step's loss sealed inside optimizer_step (validators/sealed_loss.py): its value read there — after the closure
ran the step and its release — would steer the update by the private batch; everywhere else it is a report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit, loader, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.sealed_loss import HandedLoss, SealedLoss, handed, sealed, watch  # noqa: E402


class RateFromTheClosuresLoss(Classifier):
    """Lightning's optimizer_step override, with the rate of the next step set from the loss the closure returned."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        loss = optimizer.step(closure=optimizer_closure)
        for group in optimizer.param_groups:
            group["lr"] = 0.5 / float(loss)


class StepsTwiceWhenHigh(Classifier):
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        loss = optimizer_closure()
        if loss > 0.6:
            optimizer.step()
        optimizer.step()


class RateAsATensor(Classifier):
    """The rate set to a tensor computed from the loss: refused when the optimizer reads it."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        loss = optimizer_closure()
        for group in optimizer.param_groups:
            group["lr"] = 0.5 / loss.detach()
        optimizer.step()


@pytest.mark.parametrize("model", [StepsTwiceWhenHigh, RateAsATensor])
def test_the_loss_read_inside_optimizer_step_is_refused_before_the_update(model):
    instance = model()
    before = parameters(instance)
    with pytest.raises(PrivacyConfigurationError, match="loss was read inside optimizer_step"):
        fit(instance, steps=3)
    assert unchanged(before, instance), "an update was made"


def test_a_rate_set_from_the_loss_after_the_update_is_refused_before_the_next():
    """``optimizer.step(closure)`` returns the loss after its update: the rate it would set is never used."""
    model = RateFromTheClosuresLoss()
    with pytest.raises(PrivacyConfigurationError, match="loss was read inside optimizer_step"):
        fit(model, steps=3)
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == 1.0


class WarmsUpInOptimizerStep(Classifier):
    """Lightning's documented warm-up: the rate from the step count, set before the closure runs."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        for group in optimizer.param_groups:
            group["lr"] = min(1.0, (self.trainer.global_step + 1) / 4)
        optimizer.step(closure=optimizer_closure)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.print(f"loss {float(outputs['loss']):.3f}")  # a report, at batch end: allowed


def test_a_warm_up_in_optimizer_step_and_a_loss_printed_at_batch_end_train():
    assert fit(WarmsUpInOptimizerStep(), steps=4).ledger.steps == 4


def test_a_sealed_loss_is_a_tensor_whose_value_is_free_outside_optimizer_step():
    class Module:
        _current_fx_name = "training_step"

    module = Module()
    watch(module)
    w = torch.ones(3, requires_grad=True)
    loss = sealed((w * 2).sum())
    assert isinstance(loss, SealedLoss) and isinstance(0.5 / loss.detach(), SealedLoss)
    loss.backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0)) and float(loss) == 6.0
    module._current_fx_name = "optimizer_step"
    with pytest.raises(PrivacyConfigurationError):
        bool(loss.detach() > 1)
    assert sealed({"loss": loss, "n": 1})["n"] == 1
    watch(None)  # the fit is over: free again
    assert float(loss) == 6.0


class LogsTheLossAtBatchEnd(Classifier):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("loss_at_batch_end", outputs["loss"])  # a report, logged: ModelCheckpoint deep-copies it


def test_the_loss_logged_at_batch_end_is_deep_copied_by_model_checkpoint(tmp_path):
    """torch's own ``__deepcopy__`` fails for a tensor subclass: a published ``on_train_batch_end`` logging
    ``outputs["loss"]`` crashed in ``ModelCheckpoint``'s copy of the logged metrics. The copy stays sealed."""
    import copy

    from conftest import quiet_trainer
    from pytorch_lightning.callbacks import ModelCheckpoint

    model, dp = LogsTheLossAtBatchEnd(), strategy()
    quiet_trainer(strategy=dp, max_steps=3, enable_checkpointing=True,
                  callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)]).fit(model, loader(64))
    assert dp.ledger.steps == 3
    assert float(copy.deepcopy(model.trainer.callback_metrics)["loss_at_batch_end"]) > 0
    copied = copy.deepcopy(handed(torch.tensor(2.0)))
    assert isinstance(copied, HandedLoss)
    with pytest.raises(PrivacyConfigurationError):
        float(copied)


class OpTracer(torch.overrides.TorchFunctionMode):
    """A user's op tracer around the fit: counts every torch call by name and passes it on unchanged."""

    def __init__(self, read_loss: bool = False) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.read_loss = read_loss
        self.seen: list[float] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "?")
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.read_loss and isinstance(args[0] if args else None, SealedLoss):
            self.seen.append(float(args[0]))  # the mode reads the loss itself
        return func(*args, **(kwargs or {}))


def test_a_pass_through_function_mode_around_the_fit_trains():
    """Lightning divides the loss by the accumulation factor inside optimizer_step; the mode's frame handing that
    division on is not the caller (it was refused as a read of the loss, zoo35 R34)."""
    tracer, model = OpTracer(), Classifier()
    before = parameters(model)
    with tracer:
        fit(model, steps=3)
    assert model.trainer.global_step == 3 and not unchanged(before, model)
    assert tracer.calls.get("__truediv__", 0) + tracer.calls.get("div", 0) > 0  # the mode saw the division


def test_a_function_mode_reading_the_loss_inside_optimizer_step_is_refused():
    tracer, model = OpTracer(read_loss=True), Classifier()
    before = parameters(model)
    with tracer, pytest.raises(PrivacyConfigurationError, match="loss was read inside optimizer_step"):
        fit(model, steps=3)
    assert unchanged(before, model)


def test_the_users_read_of_the_loss_under_a_pass_through_mode_is_refused():
    model = StepsTwiceWhenHigh()
    with OpTracer(), pytest.raises(PrivacyConfigurationError, match="loss was read inside optimizer_step"):
        fit(model, steps=3)
