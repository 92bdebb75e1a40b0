"""The ``.grad`` of the trainable parameters as a step starts (validators/released_gradients.py): a statistic of the
batch written into it after the update (at a batch's end, by the module or a callback) and read by the next forward,
which runs before Lightning's ``zero_grad``, is refused; ``zero_grad(set_to_none=False)``, gradient accumulation, a
callback reading ``.grad`` for logging and a declared ``public_state=["p.grad"]`` train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit, loader, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.engine_api import mark_released  # noqa: E402
from lightning_dp.validators.released_gradients import rewritten_gradients  # noqa: E402


class ReadsItsGrad(Classifier):
    """The next forward reads what the first layer's bias ``.grad`` holds (before Lightning zeroes it)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        g = self.net[0].bias.grad
        if g is not None:
            x = x + g[:4]
        return torch.nn.functional.cross_entropy(self(x), y)


class KeepsInGrad(ReadsItsGrad):
    """At a batch's end, the positives' mean feature vector written into the bias ``.grad``."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        g = self.net[0].bias.grad
        if g is not None:
            g.copy_(batch[0][batch[1] == 1].mean(0).repeat(2))


class KeepsInGradCallback(pl.Callback):
    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if module.net[0].bias.grad is not None:
            module.net[0].bias.grad = batch[0].mean(0).repeat(2)


def test_a_batch_statistic_kept_in_a_trainable_parameters_grad_is_refused():
    with pytest.raises(PrivacyConfigurationError, match=r"The \.grad of net\.0\.bias was written after the last update"):
        fit(KeepsInGrad(), steps=4, per_sample="ghost")


def test_a_callback_rebinding_the_grad_to_a_statistic_is_refused():
    with pytest.raises(PrivacyConfigurationError, match=r"The \.grad of net\.0\.bias was written after the last update"):
        fit(ReadsItsGrad(), steps=4, callbacks=[KeepsInGradCallback()], per_sample="ghost")


class ZeroesInPlace(ReadsItsGrad):
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)


class LogsGradNorm(pl.Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.norms.append(float(sum(p.grad.norm() for p in module.parameters() if p.grad is not None)))


@pytest.mark.parametrize("setup", ["set_to_none=False", "accumulate", "reading callback", "declared public"])
def test_the_release_left_in_grad_trains(setup):
    model = ZeroesInPlace() if setup == "set_to_none=False" else \
        KeepsInGrad() if setup == "declared public" else ReadsItsGrad()
    reader = LogsGradNorm()
    kwargs = {"public_state": ["p.grad"]} if setup == "declared public" else {}
    trainer = quiet_trainer(strategy=strategy(per_sample="ghost", **kwargs), max_steps=4,
                            callbacks=[reader] if setup == "reading callback" else [],
                            accumulate_grad_batches=2 if setup == "accumulate" else 1)
    trainer.fit(model, loader())
    assert trainer.global_step == 4
    if setup == "reading callback":
        assert len(reader.norms) == 4 and all(n > 0 for n in reader.norms)


def test_rewritten_gradients_names_a_grad_neither_released_none_nor_zero():
    a, b, c, d = (torch.nn.Parameter(torch.zeros(3)) for _ in range(4))
    a.grad = torch.ones(3)
    mark_released(a.grad)  # the release as written
    b.grad = torch.zeros(3)  # zero_grad(set_to_none=False)
    d.grad = torch.ones(3)
    assert rewritten_gradients([("a", a), ("b", b), ("c", c), ("d", d)]) == ["d"]
    a.grad.mul_(2)  # written in place since the release
    assert rewritten_gradients([("a", a), ("b", b), ("c", c)]) == ["a"]
