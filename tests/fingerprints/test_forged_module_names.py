"""No trust decision rests on a class's ``__module__`` (lightning_dp/records/library_code.py, ``library_type``,
``library_named``; docs/release_boundary.md, "Library code"): a user's class claiming ``"lightning_dp.x"``,
``"torch.nn"`` or ``"pytorch_lightning.callbacks"`` is the user's — its mode is taken off the stack while the noise is
drawn, its objects are walked, its callback is judged, its class body is read — while torch's, Lightning's and
lightning_dp's own classes and the user's ordinary subclasses of them still train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.mode_free import user_modes, without_user_modes  # noqa: E402
from lightning_dp.privacy.noise import GaussianNoise  # noqa: E402
from lightning_dp.privacy.private_step import PrivateStep  # noqa: E402
from lightning_dp.records.library_code import library_type  # noqa: E402
from lightning_dp.records.library_objects import is_library, library_callback  # noqa: E402


class ForgedZeroNormal(TorchDispatchMode):
    """A mode of the user's claiming to be lightning_dp's: zeroes ``aten.normal_`` drawn with a generator."""

    __module__ = "lightning_dp.grad_sample.capture.broadcast_sites"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.normal_.default and kwargs.get("generator") is not None:
            return args[0].zero_()
        return func(*args, **kwargs)


class CountingFlops(FlopCounterMode):
    """A user's ordinary subclass of torch's FLOP counter (pass-through)."""


SIGMA, C, N, BATCH = 4.0, 1.0, 64, 8


def test_a_users_mode_claiming_lightning_dps_module_does_not_remove_the_noise() -> None:
    """ĝ = (S + σCz)/B: over 10,100 coordinates the released gradient's variance is (σC/B)² within 6 %; the forged
    mode left on the stack made it 0 (the draw zeroed while the ledger charged for it)."""
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = PrivateStep(SIGMA, C, GaussianNoise(seed=3), engine="ghost", sampler_seed=0)
    step.attach(model, optimizer)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 100, generator=g), torch.randint(0, 100, (N,), generator=g))
    loader = step.poisson_loader(DataLoader(data, batch_size=BATCH))
    step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))
    batch = next(iter(loader))
    user = ForgedZeroNormal()
    with user:
        step.begin()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        step.release(optimizer=optimizer)
    step.detach()
    released = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    expected = (SIGMA * C / step.plan.expected_batch_size) ** 2
    assert released.var().item() == pytest.approx(expected, rel=0.06)


def test_lightning_dps_own_mode_stays_and_a_users_flop_counter_subclass_trains() -> None:
    from lightning_dp.grad_sample.capture.broadcast_sites import BroadcastSites
    from lightning_dp.grad_sample.functorch_vmap import _TransformedRequiresGrad
    from lightning_dp.validators.probe import LowestFloat, NoDropout
    from lightning_dp.wide_replay import Float64

    from lightning_dp.mode_free import _library_mode

    for cls in (BroadcastSites, _TransformedRequiresGrad, LowestFloat, NoDropout, Float64):
        assert _library_mode(cls.__new__(cls))  # the library's own modes stay on the stack
    assert not _library_mode(ForgedZeroNormal())
    counter, model = CountingFlops(display=False), Classifier()
    with counter:
        with without_user_modes():
            assert user_modes() == []
        fit(model, steps=2)
    assert model.trainer.global_step == 2 and counter.get_total_flops() > 0


class ForgedStore:
    """A data-only holder claiming torch's module (was compared by identity, never walked into)."""

    __module__ = "torch.nn.modules.container"


class ScaledByLastBatch(Classifier):
    """Each step's loss scaled by the previous batch's mean, kept in a forged "torch" object: batch t-1's records
    reach release t."""

    def __init__(self) -> None:
        super().__init__()
        self.store = ForgedStore()
        self.store.last = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * (1.0 + self.store.last)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.store.last = float(batch[0].mean())


def test_an_object_of_a_class_claiming_torchs_module_is_walked_and_its_batch_value_refused() -> None:
    assert not is_library(ForgedStore())
    with pytest.raises(PrivacyConfigurationError, match="store"):
        fit(ScaledByLastBatch(), steps=3)


class ForgedCallback(pl.Callback):
    """A callback of the user's claiming to be Lightning's: keeps the batch's mean, which the next step reads."""

    __module__ = "pytorch_lightning.callbacks.forged"

    def __init__(self) -> None:
        self.last = 0.0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.last = float(batch[0].mean())


class ReadsTheCallback(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        kept = next(cb for cb in self.trainer.callbacks if isinstance(cb, ForgedCallback))
        return super().training_step(batch, batch_idx) * (1.0 + kept.last)


def test_a_callback_claiming_lightnings_module_is_judged_and_its_batch_value_refused() -> None:
    assert not library_callback(ForgedCallback())
    with pytest.raises(PrivacyConfigurationError, match="last"):
        fit(ReadsTheCallback(), steps=3, callbacks=[ForgedCallback()])


class ForgedNamespace:
    """Class-body data of the user's claiming torch's module (was skipped as a library's class)."""

    __module__ = "torch.utils"
    last = 0.0


class ScaledByClassData(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * (1.0 + ForgedNamespace.last)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        ForgedNamespace.last = float(batch[0].mean())


def test_class_body_data_of_a_class_claiming_torchs_module_is_read_and_refused() -> None:
    ForgedNamespace.last = 0.0
    with pytest.raises(PrivacyConfigurationError, match="last"):
        fit(ScaledByClassData(), steps=3)


MEMORY: list = [0.0]


class GlobalModel(Classifier):
    """A model claiming torch's module: its file's globals were not read as the user's module."""

    __module__ = "torch.nn.modules.module"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * (1.0 + MEMORY[-1])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        MEMORY.append(float(batch[0].mean()))


def test_a_global_of_a_model_claiming_torchs_module_is_read() -> None:
    MEMORY[:] = [0.0]
    with pytest.raises(PrivacyConfigurationError, match="MEMORY"):
        fit(GlobalModel(), steps=3)


class UsersLinear(nn.Linear):
    """An ordinary user subclass of a torch layer, keeping a public constant."""

    def __init__(self) -> None:
        super().__init__(8, 2)
        self.temperature = 1.0


class UsersCallback(pl.Callback):
    def __init__(self) -> None:
        self.epochs = 0

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.epochs += 1


class OrdinaryModel(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net[2] = UsersLinear()


def test_the_real_library_classes_and_ordinary_user_subclasses_still_train() -> None:
    assert all(library_type(c) for c in (nn.Linear, nn.Sequential, pl.Callback, torch.optim.SGD, TensorDataset))
    assert not any(library_type(c) for c in (UsersLinear, UsersCallback, OrdinaryModel, ForgedStore,
                                             ForgedCallback, ForgedZeroNormal, ForgedNamespace))
    model = OrdinaryModel()
    fit(model, steps=3, callbacks=[UsersCallback(), pl.callbacks.Timer()])
    assert model.trainer.global_step == 3
