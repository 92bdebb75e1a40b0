"""Writes to kept state by the hooks outside the step computation (validators/judged_writes.py): post-processing of
the released state — a max-norm projection and a clamp of the weights, ``clip_grad_norm_`` of ĝ, an EMA swapped in
for validation, weight decay by hand (qa13 c1, c2, c5) — trains; the same hooks writing from the data are refused."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, parameters, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torch.set_num_threads(1)


def _sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1) -> None:
    """One step of plain (un-noised) gradient descent of the last layer of ``model`` (a :class:`Classifier`) on
    ``(x, y)``, in place: the cross-entropy's gradient written out (the engine's hooks are on the module's forward)."""
    with torch.no_grad():
        hidden = model.net[1](model.net[0](x))
        error = torch.softmax(model.net[2](hidden), dim=1) - nn.functional.one_hot(y, 2).float()
        model.net[2].weight.sub_(lr * error.T @ hidden / len(x))
        model.net[2].bias.sub_(lr * error.mean(0))


def _fit(model: pl.LightningModule, steps: int = 4, callbacks: Any = (), batch_size: int = 16,
         validate: bool = False) -> pl.Trainer:
    trainer = quiet_trainer(strategy=strategy(), max_steps=steps, callbacks=list(callbacks),
                            num_sanity_val_steps=0, **({"val_check_interval": 2} if validate else {}))
    val = DataLoader(data(32, seed=1), batch_size=16) if validate else None
    trainer.fit(model, DataLoader(data(64), batch_size=batch_size), val)
    return trainer


def _refused(model: pl.LightningModule, **kwargs: Any) -> None:
    with pytest.raises(PrivacyConfigurationError):
        _fit(model, **kwargs)


# ---------------------------------------------------------------------------------------------- trains


class MaxNorm(Classifier):
    """qa13 c2: a Keras-style max-norm constraint after each step, through ``.data``."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for layer in (self.net[0], self.net[2]):
                layer.weight.data = torch.renorm(layer.weight.data, 2, 0, 0.5)


class Clamp(pl.Callback):
    """qa13 c2: a clamp of the last bias in a callback's ``on_before_zero_grad``."""

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        with torch.no_grad():
            pl_module.net[2].bias.clamp_(min=-0.05, max=0.05)


def test_max_norm_projection_and_clamp_train() -> None:
    model = MaxNorm()
    _fit(model, callbacks=[Clamp()])
    assert float(model.net[0].weight.detach().norm(dim=1).max()) <= 0.5 + 1e-5  # projected after the last update


class UserClip(Classifier):
    """qa13 c5: the user's ``clip_grad_norm_`` of the released ĝ before the optimizer steps."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.norm_seen = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=1e-3)


def test_users_clip_of_the_released_gradient_trains() -> None:
    model = UserClip()
    before = parameters(model)
    _fit(model, steps=2)
    change = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert 0 < float(change.norm()) <= 2 * 1e-3 + 1e-6  # lr 1, two steps of ĝ clipped to norm 1e-3


class HandDecay(Classifier):
    """Weight decay applied by hand before the gradients are zeroed."""

    def on_before_zero_grad(self, optimizer: Any) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.data.mul_(0.99)  # through .data: the forward's saved tensors stay valid for the backward


def test_weight_decay_by_hand_trains() -> None:
    _fit(HandDecay())


class EMA(pl.Callback):
    """qa13 c1: an EMA of the weights updated at each batch's end, swapped in for validation and back."""

    def __init__(self, steal: bool = False) -> None:
        self.steal = steal

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ema = AveragedModel(pl_module, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ema.update_parameters(pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.backup = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        if not self.steal:
            pl_module.load_state_dict(self.ema.module.state_dict())
            return
        x, y = trainer.train_dataloader.dataset.tensors  # weights trained without noise on the training set
        for _ in range(3):
            _sgd_step(pl_module, x, y, lr=1.0)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.load_state_dict(self.backup)


class Validated(Classifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))


def test_ema_swapped_in_for_validation_trains() -> None:
    trainer = _fit(Validated(), callbacks=[EMA()], validate=True)
    assert trainer.global_step == 4


class ClipsInLightningsHook(Classifier):
    """ĝ clipped to a constant norm by ``configure_gradient_clipping``."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=1e-3)


def test_users_clip_in_configure_gradient_clipping_trains() -> None:
    _fit(ClipsInLightningsHook(), steps=2)


class MergesAnAdapter(Classifier):
    """qa13 c7: a low-rank adapter (trained privately with the rest) merged into the first layer at the fit's end."""

    def __init__(self, steal: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.zeros(8, 2)), nn.Parameter(torch.full((2, 4), 0.1))
        self.steal = steal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[1](self.net[0](x) + x @ (self.a @ self.b).T))

    def on_train_end(self) -> None:
        with torch.no_grad():
            delta = self.a @ self.b
            if self.steal:  # merged with a statistic of the training set
                delta = delta + self.trainer.train_dataloader.dataset.tensors[0].mean(0)
            self.net[0].weight.add_(delta)
            self.a.zero_()


def test_an_adapter_merged_at_the_end_of_the_fit_trains() -> None:
    model = MergesAnAdapter()
    _fit(model, steps=2)
    assert float(model.a.detach().abs().max()) == 0.0


# ---------------------------------------------------------------------------------------------- refused


class ExtraStep(Classifier):
    """An extra un-noised SGD step on the batch at its end."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        _sgd_step(self, *batch)


class LossScaled(Classifier):
    """The weights rescaled by the batch's loss."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.net[0].weight.mul_(1 + 1e-3 * outputs["loss"].detach())


class Nudged(Classifier):
    """The weights nudged toward a copy of the training data the module holds."""

    def __init__(self) -> None:
        super().__init__()
        self.copy = data(64).tensors[0].clone()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.net[0].weight.add_(0.01 * (self.copy[:8] - self.net[0].weight))


class NudgedFromDataModule(Classifier):
    """The same, from the datamodule's standardised copy."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.net[0].bias.add_(0.01 * self.trainer.datamodule.standardised[:8, 0])


class DM(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        x = data(64).tensors[0]
        self.standardised = (x - x.mean(0)) / x.std(0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(64), batch_size=16)


class ClockedNudge(Classifier):
    """The weights nudged by the batch's mean with a clock reading mixed in (a run again on the same data differs
    too: a time stamp is not judged, the weights are)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.net[0].bias.add_(1e-6 * (time.perf_counter() % 1.0) + 0.01 * batch[0][:, 0].mean())


class AtStepSeven(Classifier):
    """A write made only at step 7, from the batch."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == 7:
            with torch.no_grad():
                self.net[0].bias.add_(batch[0][:8, 0].mean())


class FetchedGradient(Classifier):
    """ĝ replaced by the gradient of a backward the hook runs on records it fetched from the dataset."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        x, y = self.trainer.train_dataloader.dataset[0:16]
        with torch.enable_grad():
            loss = nn.functional.cross_entropy(self(x), y)
            grads = torch.autograd.grad(loss, list(self.parameters()))
        for p, g in zip(self.parameters(), grads):
            p.grad = g


class StatisticScaled(Classifier):
    """ĝ scaled by a statistic of the training data computed before the fit, held as a tensor on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = data(64).tensors[0].abs().mean()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for p in self.parameters():
            p.grad.mul_(self.scale)


class ClassMeansAtEnd(Classifier):
    """zoo27 e01: a nearest-class-mean head, the class means of the hidden features over ``trainer.train_dataloader``
    written in ``on_train_end`` (going through the loader again draws a new Poisson sample: a run on the same data
    differs too, which must not excuse it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("protos", torch.zeros(2, 8))

    def on_train_end(self) -> None:
        sums, counts = torch.zeros(2, 8), torch.zeros(2)
        with torch.no_grad():
            for x, y in self.trainer.train_dataloader:
                sums.index_add_(0, y, self.net[1](self.net[0](x)))
                counts += torch.bincount(y, minlength=2)
        self.protos.copy_(sums / counts.clamp(min=1)[:, None])


class UnseededReplayBuffer(Classifier):
    """zoo27 c01: a replay buffer keeping one record of each batch, the row and slot chosen by an unseeded NumPy
    generator (fresh entropy: no run again draws alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bank", torch.zeros(8, 4))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        import numpy as np

        rng = np.random.default_rng()
        self.bank[int(rng.integers(8))] = batch[0][int(rng.integers(len(batch[0])))]


@pytest.mark.parametrize("model", [ClassMeansAtEnd, UnseededReplayBuffer])
def test_a_write_whose_runs_differ_by_randomness_is_not_excused(model: type) -> None:
    m = model()
    _refused(m)
    kept = m.protos if isinstance(m, ClassMeansAtEnd) else m.bank
    assert not kept.abs().sum(), "nothing of the data was kept"


@pytest.mark.parametrize("model", [ExtraStep, LossScaled, Nudged, ClockedNudge, FetchedGradient, StatisticScaled])
def test_writes_from_the_data_are_refused(model: type) -> None:
    m = model()
    _refused(m)


def test_an_adapter_merged_with_a_statistic_of_the_data_is_refused() -> None:
    _refused(MergesAnAdapter(steal=True), steps=2)


def test_weights_nudged_toward_the_datamodules_copy_are_refused() -> None:
    trainer = quiet_trainer(strategy=strategy(), max_steps=4)
    with pytest.raises(PrivacyConfigurationError):
        trainer.fit(NudgedFromDataModule(), datamodule=DM())


def test_a_write_from_the_batch_at_step_seven_is_refused() -> None:
    model = AtStepSeven()
    with pytest.raises(PrivacyConfigurationError) as refusal:
        _fit(model, steps=9, batch_size=8)
    assert model.trainer.global_step == 7  # refused before the update after the write
    assert "bias" in str(refusal.value)


def test_weights_trained_without_noise_swapped_in_for_validation_are_refused() -> None:
    model = Validated()
    with pytest.raises(PrivacyConfigurationError):
        _fit(model, callbacks=[EMA(steal=True)], validate=True)
