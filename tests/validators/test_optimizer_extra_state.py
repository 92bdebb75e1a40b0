"""An optimizer's state beyond its moments (validators/optimizer_extra_state.py, rule 3 of docs/release_boundary.md):
a loss kept in ``optimizer.state`` under a key that is not a parameter, or as a number in a parameter's entries, for
a loss-aware step size at the next update, is refused (zoo16 o1, o2, o3); a count of steps kept there trains."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.optimizer_extra_state import (  # noqa: E402
    extra_state, put_state, rebound_state, saved_state)


class LossAwareSGD(torch.optim.SGD):
    """SGD whose step size is scaled by a value kept in its state (a Polyak-like rule): ``state["scale"]``, or
    ``state[first parameter]["scale"]`` when ``per_parameter``."""

    def __init__(self, params: Any, per_parameter: bool = False) -> None:
        super().__init__(params, lr=0.1)
        self.per_parameter = per_parameter

    def where(self) -> dict:
        return self.state[self.param_groups[0]["params"][0]] if self.per_parameter else self.state

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Any:
        loss = closure() if closure is not None else None
        scale = float(self.where().get("scale", 1.0))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)
        return loss


class KeepsLoss(Classifier):
    """Keeps the batch loss in the optimizer's state, read by its next step: in ``training_step`` (``"step"``), or
    at a batch's end after the first update (``"batch_end"``: the first step's replays see no write)."""

    def __init__(self, where: str, per_parameter: bool = False) -> None:
        super().__init__()
        self.where, self.per_parameter = where, per_parameter

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.where == "step":
            self.optimizers().optimizer.where()["scale"] = 10 * float(loss.detach())
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.where == "batch_end" and self.global_step == 1:
            self.optimizers().optimizer.where()["scale"] = 10 * float(outputs["loss"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return LossAwareSGD(self.parameters(), self.per_parameter)


class CountsSteps(pl.Callback):
    """Keeps a count of the updates and a step-size schedule in the optimizer's state: the same on any data."""

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        state = trainer.optimizers[0].state
        state["updates"] = state.get("updates", 0) + 1
        state["scale"] = 1.0 / (1 + trainer.global_step)


@pytest.mark.parametrize("where", ["step", "batch_end"])
def test_loss_kept_under_a_key_that_is_no_parameter_is_refused(where: str) -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"optimizer (0 )?kept\['scale'\]"):
        fit(KeepsLoss(where), steps=3, noise_multiplier=1e-6)


def test_loss_kept_as_a_number_in_a_parameters_state_at_batch_end_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"optimizer 0 state\[0\]\[0\]\.scale"):
        fit(KeepsLoss("batch_end", per_parameter=True), steps=3, noise_multiplier=1e-6)


def test_a_count_and_a_schedule_kept_there_train_and_count_once() -> None:
    model = KeepsLoss("none")
    dp = fit(model, steps=4, callbacks=[CountsSteps()])
    assert dp.ledger.steps == 4
    assert model.trainer.optimizers[0].state["updates"] == 4  # the replays' runs put back, not counted


def test_extra_and_rebound_entries_are_named_and_put_back() -> None:
    layer = nn.Linear(2, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    opt.state[layer.weight]["momentum_buffer"] = torch.zeros(1, 2)
    opt.state[layer.weight]["scale"] = 0.5
    opt.state["loss"] = float("nan")
    assert list(extra_state(opt)) == ["optimizer kept['loss']"]
    assert extra_state(opt) == extra_state(opt)  # a NaN equals itself: no refusal from its mere presence
    assert set(rebound_state(opt)) == {"optimizer kept['loss']", "optimizer state[0][0].scale"}
    saved = saved_state(opt)
    opt.state["loss"], opt.state["added"] = 2.0, 1
    opt.state[layer.weight]["scale"] = 3.0
    put_state(opt, saved)
    assert "added" not in opt.state and opt.state[layer.weight]["scale"] == 0.5
    assert rebound_state(opt) == {"optimizer kept['loss']": rebound_state(opt)["optimizer kept['loss']"],
                                  "optimizer state[0][0].scale": rebound_state(opt)["optimizer state[0][0].scale"]}


def test_a_plain_loop_keeping_its_loss_in_the_optimizers_state_is_refused() -> None:
    """A loop of one's own that read its loss and keeps it for a loss-aware step size (validators/plain_loop.py)."""
    from lightning_dp.privacy.noise import GaussianNoise
    from lightning_dp.privacy.private_step import PrivateStep

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = LossAwareSGD(model.parameters())
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    step = PrivateStep(1.0, 1.0, GaussianNoise(seed=0), sampler_seed=0)
    step.attach(model, opt)
    try:
        loader = step.poisson_loader(torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16))
        step.verify(lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))
        with pytest.raises(PrivacyConfigurationError, match=r"optimizer kept\['scale'\].*after the loop read"):
            for _, (xb, yb) in zip(range(4), loader):
                loss = None
                if step.begin():
                    loss = nn.functional.cross_entropy(model(xb), yb)
                    loss.backward()
                step.release(optimizer=opt)
                opt.step()
                opt.zero_grad()
                opt.state["scale"] = 10 * loss.item() if loss is not None else 1.0
    finally:
        step.detach()
