"""What is library code (fingerprints/state_walker.py: ``library_callable``, ``library_code``, ``library_class``;
docs/release_boundary.md, "Library code"): decided by where the code that runs lies, not by the names
``functools.wraps`` copies — a user's function dressed as torch's (zoo35 R09, R12, R14), torch's method replaced by
a user's (X09b) and a builtin method of a user's dict subclass (R11) are the user's, and the checks that skip library
code judge them; a user's own decorator keeps the user's function the user's, torch's and lightning_dp's own functions
stay a library's."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.fingerprints.state_walker import (library_callable, library_class, library_code,  # noqa: E402
                                                    users_method)
from lightning_dp.validators.judged_schedules import users_schedule_code  # noqa: E402
from lightning_dp.validators.judged_updates import users_update_code  # noqa: E402

UPDATE_READ = "The optimizer's update read the training data"
SCHEDULE_READ = "The learning-rate schedule read the training data|configured scheduler 0"
"""(Or, first, the replays of the hooks that see no batch: configure_optimizers builds the scheduler again on the
exchanged data, and a LambdaLR runs its function as it is built.)"""


def training_mean(module: Any) -> torch.Tensor:
    return module.trainer.train_dataloader.dataset.tensors[0].mean(0)


def label_rate(module: Any, step: int) -> float:
    loader = getattr(module._trainer, "train_dataloader", None)
    labels = torch.ones(64) if loader is None else loader.dataset.tensors[1].float()
    return float(labels[step * 8:step * 8 + 8].mean())


@functools.wraps(torch.optim.SGD.step)
def dressed_as_torch(self: Any, closure: Optional[Callable[[], Any]] = None) -> Any:
    return None


class Table(dict):
    """A user's dict subclass: its ``__missing__`` runs inside the builtin ``__getitem__``."""

    def __missing__(self, key: Any) -> float:
        return 1.0


class ClaimsTorch(dict):
    __module__ = "torch.optim"

    def __missing__(self, key: Any) -> float:
        return 1.0


def _mine(x: float) -> float:
    return x


@functools.wraps(_mine)
def _decorated(x: float) -> float:
    return _mine(x)


def test_a_function_dressed_as_torchs_is_the_users() -> None:
    assert dressed_as_torch.__module__.startswith("torch.")  # what functools.wraps copied
    assert not library_code(dressed_as_torch) and not library_callable(dressed_as_torch)
    assert not library_callable(torch.no_grad()(dressed_as_torch))  # torch's wrapper around it
    assert not library_callable(functools.wraps(torch.optim.SGD.step)(torch.no_grad()(_mine)))  # the user's in a cell
    assert not library_callable(torch.optim.Optimizer.profile_hook_step(dressed_as_torch))
    assert not library_callable(functools.partial(dressed_as_torch))
    assert not library_callable(functools.lru_cache(_mine))


def test_a_builtin_method_is_its_objects_classs() -> None:
    assert not library_callable(Table().__getitem__) and not library_callable(functools.partial(Table().__getitem__))
    assert not library_class(ClaimsTorch) and not library_callable(ClaimsTorch().__getitem__)
    assert library_callable({}.__getitem__) and library_callable([0.1, 0.2].__getitem__)
    assert library_callable([].append) and library_callable(dict.__getitem__) and library_callable(len)


def test_a_users_decorator_keeps_the_users_function_and_torchs_and_lightning_dps_stay_a_librarys() -> None:
    assert not library_callable(_decorated) and not library_callable(_mine)
    assert users_method(torch.no_grad()(_mine)) is _mine
    assert library_callable(torch.optim.SGD.step) and library_callable(torch.optim.lr_scheduler.LambdaLR.get_lr)
    assert library_callable(torch.nn.functional.relu) and library_callable(torch.nn.Linear(2, 2).forward)
    assert library_callable(functools.lru_cache(torch.nn.functional.relu))
    assert library_callable(users_method) and library_callable(users_update_code)
    assert library_callable(functools.partial(torch.add, alpha=2))
    import pytorch_lightning as pl

    assert all(library_class(c) for c in (torch.optim.SGD, torch.nn.Linear, torch.nn.Parameter, pl.LightningModule,
                                          torch.utils.data.ConcatDataset, torch.amp.grad_scaler.OptState))


class ClaimsTorchsModule(torch.optim.SGD):
    """A class of the user's whose body claims torch's module, overriding a method torch's step calls."""

    __module__ = "torch.optim.sgd"

    def _init_group(self, *args: Any) -> Any:
        return super()._init_group(*args)


def test_a_class_claiming_torchs_module_is_the_users() -> None:
    assert not library_class(ClaimsTorchsModule)
    assert users_update_code(ClaimsTorchsModule(Classifier().parameters(), lr=0.1))


class SpoofedStep(torch.optim.SGD):
    """R09: the step of a class of the user's, dressed as torch's, writing the training mean into a bias."""

    def __init__(self, module: Any) -> None:
        super().__init__(module.parameters(), lr=0.1)
        self.module = [module]

    @functools.wraps(torch.optim.SGD.step)
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = super().step(closure)
        self.module[0].net[2].bias.copy_(0.5 * training_mean(self.module[0])[:2] + 0.1)
        return loss


class WithOptimizer(Classifier):
    def __init__(self, make: Callable[[Any], Any]) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make(self)


def _spoofed_post_hook(module: Any) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    @functools.wraps(torch.optim.Optimizer.zero_grad)
    def post(opt: Any, args: Any, kwargs: Any) -> None:  # R14
        with torch.no_grad():
            module.net[2].bias.copy_(0.5 * training_mean(module)[:2] + 0.1)
    optimizer.register_step_post_hook(post)
    return optimizer


def test_a_step_dressed_as_torchs_is_judged_as_the_users() -> None:
    model = WithOptimizer(SpoofedStep)
    assert users_method(vars(SpoofedStep)["step"]).__qualname__ == "SpoofedStep.step"
    assert "SpoofedStep.step" in users_update_code(SpoofedStep(Classifier()))
    with pytest.raises(PrivacyConfigurationError, match=UPDATE_READ):
        fit(model, steps=2)


def test_a_step_hook_dressed_as_torchs_is_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(PrivacyConfigurationError, match=UPDATE_READ) as refused:
        fit(WithOptimizer(_spoofed_post_hook), steps=2)
    assert "_spoofed_post_hook.<locals>.post at test_library_code.py" in str(refused.value)  # not "zero_grad"


def test_torchs_step_replaced_on_its_class_is_refused() -> None:
    original = torch.optim.SGD.step
    model = WithOptimizer(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))

    @functools.wraps(original)
    def patched(self: Any, closure: Optional[Callable[[], Any]] = None) -> Any:  # X09b
        loss = original(self, closure)
        with torch.no_grad():
            model.net[2].bias.copy_(0.5 * training_mean(model)[:2] + 0.1)
        return loss
    torch.optim.SGD.step = patched
    try:
        assert users_update_code(torch.optim.SGD(Classifier().parameters(), lr=0.1))
        with pytest.raises(PrivacyConfigurationError, match=UPDATE_READ):
            fit(model, steps=2)
    finally:
        torch.optim.SGD.step = original
    assert not users_update_code(torch.optim.SGD(Classifier().parameters(), lr=0.1))


class Scheduled(Classifier):
    def __init__(self, rate: Callable[[Any], Callable[[int], float]]) -> None:
        super().__init__()
        self.rate = rate

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": LambdaLR(optimizer, self.rate(self)), "interval": "step"}}


def _dressed_rate(module: Any) -> Callable[[int], float]:
    @functools.wraps(LambdaLR.get_lr)
    def rate(step: int) -> float:  # R12
        return 0.2 + label_rate(module, step)
    return rate


def _table_rate(module: Any) -> Callable[[int], float]:
    class Rates(dict):  # R11: the builtin __getitem__ of the user's dict subclass runs its __missing__
        def __missing__(self, step: int) -> float:
            return 0.2 + label_rate(module, step)
    return functools.partial(Rates().__getitem__)


@pytest.mark.parametrize("rate", [_dressed_rate, _table_rate], ids=["wraps", "dict-subclass-getitem"])
def test_a_rate_function_dressed_as_a_librarys_is_refused(rate: Callable[[Any], Any]) -> None:
    model = Scheduled(rate)
    with pytest.raises(PrivacyConfigurationError, match=SCHEDULE_READ):
        fit(model, steps=3)


def _warm_up(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def _counting(fn: Callable[[int], float]) -> Callable[[int], float]:
    @functools.wraps(fn)
    def counted(step: int) -> float:  # a user's own decorator around a public schedule
        counted.calls += 1  # type: ignore[attr-defined]
        return fn(step)
    counted.calls = 0  # type: ignore[attr-defined]
    return counted


class CountingSGD(torch.optim.SGD):
    @functools.wraps(torch.optim.SGD.step)
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        return super().step(closure)


def test_the_users_own_decorated_schedule_and_step_are_judged_and_train() -> None:
    torch.manual_seed(0)
    model = Scheduled(lambda m: _counting(_warm_up))
    fit(model, steps=3)
    assert users_schedule_code(model.trainer)  # judged as the user's code ...
    assert model.trainer.global_step == 3  # ... and trains
    model = WithOptimizer(lambda m: CountingSGD(m.parameters(), lr=0.1))
    fit(model, steps=3)
    assert model.trainer.global_step == 3
    schedule = LambdaLR(torch.optim.SGD(Classifier().parameters(), lr=0.1), [0.1, 0.5, 1.0].__getitem__)
    assert not [name for name in users_schedule_code_of(schedule) if "function" in name]  # a public table: a library's


def users_schedule_code_of(scheduler: Any) -> list[str]:
    """users_schedule_code's names for one scheduler (through a stand-in of the trainer that holds it)."""
    from types import SimpleNamespace

    config = SimpleNamespace(scheduler=scheduler)
    trainer = SimpleNamespace(lightning_module=Classifier(), lr_scheduler_configs=[config], optimizers=[])
    return users_schedule_code(trainer)  # type: ignore[arg-type]
