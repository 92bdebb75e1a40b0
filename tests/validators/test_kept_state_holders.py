"""Where a step can keep what it read, besides attributes (validators/kept_state.py, rule 3 of
docs/release_boundary.md): a torch layer's configuration, a method's default argument, a generator's frame, a helper
object's class, an lru_cache; and tensors outside the parameters that hold the batch's raw gradient (rule 2)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit, parameters, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class DropoutFromTheLoss(Classifier):
    """Sets its dropout rate from the batch loss (the next step's forward is steered by it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.0), nn.Linear(8, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.net[2].p = min(0.5, float(loss) / 4)
        return loss


class SmoothingFromTheLoss(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.criterion = nn.CrossEntropyLoss()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.criterion(self(x), y)
        self.criterion.label_smoothing = min(0.3, float(loss) / 8)
        return loss


@pytest.mark.parametrize("model,name", [(DropoutFromTheLoss, "configuration net.2.p"),
                                        (SmoothingFromTheLoss, "configuration criterion.label_smoothing")])
def test_a_torch_layers_configuration_set_from_the_batch_is_refused(model: type, name: str) -> None:
    with pytest.raises(PrivacyConfigurationError, match=name.replace(".", r"\.")):
        fit(model(), steps=4)


class DropoutByEpoch(DropoutFromTheLoss):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return Classifier.training_step(self, batch, batch_idx)

    def on_train_epoch_start(self) -> None:
        self.net[2].p = 0.1 * min(self.current_epoch, 3)


def test_a_dropout_schedule_by_epoch_trains() -> None:
    model = DropoutByEpoch()
    assert fit(model, steps=12).ledger.steps == 12
    assert model.net[2].p == pytest.approx(0.2)


class RunningDefault(Classifier):
    """Keeps a running sum of losses in a method's mutable default argument, and scales its loss by it."""

    def _running(self, value: float, _sums: dict = {"sum": 0.0, "n": 0}) -> float:  # noqa: B006
        _sums["sum"] += value
        _sums["n"] += 1
        return _sums["sum"] / _sums["n"]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss / self._running(float(loss))


def _averager():
    total, n = 0.0, 0
    value = yield
    while True:
        total, n = total + value, n + 1
        value = yield total / n


class RunningGenerator(Classifier):
    """A running mean kept in a generator's frame."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = _averager()
        next(self.mean)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss / self.mean.send(float(loss))


class History:
    seen: list = []  # shared by every instance: appended through one


class RunningHelper(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.helper = History()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.helper.seen.append(float(loss))
        return loss / (sum(self.helper.seen) / len(self.helper.seen))


@functools.lru_cache(maxsize=None)
def _class_weight(counts: tuple) -> float:
    return 1.0 / (1 + counts[0])


class CachedCounts(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        counts = tuple(torch.bincount(y, minlength=2).tolist())
        return F.cross_entropy(self(x), y) * _class_weight(counts)


@pytest.mark.parametrize("model,name", [(RunningDefault, "_running.__defaults__"), (RunningGenerator, "mean"),
                                        (RunningHelper, "helper"), (CachedCounts, "_class_weight")])
def test_state_kept_in_defaults_generators_helper_classes_and_caches_is_refused(model: type, name: str) -> None:
    History.seen.clear()
    _class_weight.cache_clear()
    instance = model()
    before = parameters(instance)
    with pytest.raises(PrivacyConfigurationError, match=name.replace(".", r"\.")):
        fit(instance, steps=4)
    assert unchanged(before, instance), "a release happened"


class LearnsATemperature(Classifier):
    """A temperature that requires grad, kept outside the parameters, updated by hand from its raw gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.ones(1, requires_grad=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x) / self.temperature, y)

    def on_after_backward(self) -> None:
        if self.temperature.grad is not None:
            with torch.no_grad():
                self.temperature -= 0.1 * self.temperature.grad
            self.temperature.grad = None


class SecondOptimizer(Classifier):
    """Loss weights stepped by an optimizer of their own (Kendall's uncertainty weighting)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_vars = torch.zeros(2, requires_grad=True)
        self.weights_optimizer = torch.optim.Adam([self.log_vars], lr=0.05)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        s = self.log_vars
        return torch.exp(-s[0]) * F.cross_entropy(out, y) + s[0] + torch.exp(-s[1]) * out.pow(2).mean() + s[1]

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.weights_optimizer.step()
        self.weights_optimizer.zero_grad()


@pytest.mark.parametrize("model,name", [(LearnsATemperature, "temperature"), (SecondOptimizer, "log_vars")])
def test_a_tensor_outside_the_parameters_holding_a_raw_gradient_is_refused_before_any_release(model: type,
                                                                                              name: str) -> None:
    instance = model()
    before = parameters(instance)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)hold a gradient.*{name}"):
        fit(instance, steps=3)
    assert unchanged(before, instance), "a release happened"


class ParameterTemperature(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x) / self.temperature, y)


def test_the_same_temperature_as_a_parameter_is_privatised_and_trains() -> None:
    model = ParameterTemperature()
    assert fit(model, steps=3).ledger.steps == 3
    assert model.temperature.item() != 1.0


class CompiledNet(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net, backend="eager")


def test_compiled_models_train():
    """torch.compile marks the parameters it saw (``_dynamo_static_input_type``): torch's own, not kept state; a
    compiled LightningModule (as Lightning's docs show) runs its backward graph again in the checks, which buffer
    donation (aot_autograd's default) would forbid."""
    torch._dynamo.reset()
    assert fit(CompiledNet(), steps=2).ledger.steps == 2
    torch._dynamo.reset()
    assert fit(torch.compile(Classifier(), backend="aot_eager"), steps=2, seed=1).ledger.steps == 2  # other records
