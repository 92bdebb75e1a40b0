"""The schedulers' updates judged when they run the user's code (validators/judged_schedules.py; rule 3 of
docs/release_boundary.md): a schedule that reads the training data is refused at the update it does so (zoo34 L46);
a schedule of the step count trains, advanced once per real update."""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, SequentialLR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.judged_schedules import users_schedule_code  # noqa: E402

READ = "The learning-rate schedule read the training data"
READ_OR_BUILT = READ + "|configured scheduler 0|global test_judged_schedules.STASH"
"""Or, a schedule that reads the labels as configure_optimizers builds it (LambdaLR calls its function once there):
refused by the replays of the hooks that see no batch, which build the optimizers again on the exchanged data."""


def labels(module: Any) -> torch.Tensor:
    """The training labels, as a schedule's code can reach them (through the trainer); none before the fit."""
    loader = getattr(module._trainer, "train_dataloader", None)
    return torch.ones(64) if loader is None else loader.dataset.tensors[1].float()


class FromRecords(LRScheduler):
    """A scheduler class of the user's setting the rate from the label rate of the first training records."""

    def __init__(self, optimizer: Any, module: Any) -> None:
        self.module = [module]
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        factor = 0.2 + float(labels(self.module[0])[:8].mean())
        return [base * factor for base in self.base_lrs]


class Scheduled(Classifier):
    def __init__(self, make: Callable[[Any, Any], Any], interval: str = "step") -> None:
        super().__init__()
        self.make, self.interval = make, interval

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": self.make(optimizer, self), "interval": self.interval}}


def _records_by_step(optimizer: Any, module: Any) -> LambdaLR:
    def rate(step: int) -> float:  # ten records chosen by the step: their labels scale the rate
        return 0.2 + float(labels(module)[step * 10:step * 10 + 10].mean())
    return LambdaLR(optimizer, rate)


@pytest.mark.parametrize("make,interval", [(_records_by_step, "step"), (FromRecords, "step"),
                                           (_records_by_step, "epoch")], ids=["lambda", "class", "epoch-interval"])
def test_a_schedule_reading_the_training_records_is_refused(make: Callable[[Any, Any], Any], interval: str) -> None:
    model = Scheduled(make, interval)
    with pytest.raises(PrivacyConfigurationError, match=READ_OR_BUILT):
        fit(model, steps=12, n=32)  # (two epochs of 16-record batches)
    assert model.trainer.global_step < 12


def _warm_up(optimizer: Any, module: Any) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def _cosine(optimizer: Any, module: Any) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / 10)))


def _sequential(optimizer: Any, module: Any) -> SequentialLR:
    parts = [LambdaLR(optimizer, lambda k: (k + 1) / 3), LambdaLR(optimizer, lambda k: 0.9 ** k)]
    return SequentialLR(optimizer, parts, milestones=[2])


class WarmUp(LRScheduler):
    def get_lr(self) -> list[float]:
        return [base * min(1.0, (self.last_epoch + 1) / 3) for base in self.base_lrs]


@pytest.mark.parametrize("make", [_warm_up, _cosine, _sequential, lambda o, m: WarmUp(o)],
                         ids=["warm-up", "cosine", "sequential", "class"])
def test_a_schedule_of_the_step_count_trains_and_advances_once_per_update(make: Callable[[Any, Any], Any]) -> None:
    model = Scheduled(make)
    fit(model, steps=4)
    scheduler = model.trainer.lr_scheduler_configs[0].scheduler
    assert model.trainer.global_step == 4 and scheduler.last_epoch == 4  # the runs again were put back
    reference = Scheduled(make)
    optimizer = reference.configure_optimizers()["optimizer"]
    plain = make(optimizer, reference)
    for _ in range(4):
        optimizer.step()
        plain.step()
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])


def test_the_users_schedule_code_is_found() -> None:
    class Trainer:
        def __init__(self, scheduler: Any) -> None:
            self.lightning_module = Classifier()
            self.lr_scheduler_configs = [type("Config", (), {"scheduler": scheduler})()]

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    assert users_schedule_code(Trainer(torch.optim.lr_scheduler.StepLR(optimizer, 2))) == []
    assert users_schedule_code(Trainer(WarmUp(optimizer))) == ["WarmUp.get_lr"]
    found = users_schedule_code(Trainer(_sequential(optimizer, None)))
    assert len(found) == 2 and all("LambdaLR's function" in f for f in found)
    warm = functools.partial(math.pow, 0.5)  # a library's function bound to a number (Hugging Face's schedules)
    assert users_schedule_code(Trainer(LambdaLR(optimizer, lambda k: warm(k)))) != []
    assert users_schedule_code(Trainer(LambdaLR(optimizer, functools.partial(pow, 0.5)))) == []
    assert users_schedule_code(Trainer(LambdaLR(optimizer, functools.partial(pow, torch.ones(1))))) != []


def _memoised(optimizer: Any, module: Any) -> LambdaLR:
    """zoo35 R10: each step's rate computed once from ten training labels and kept in the maker's dict."""
    memo: dict[int, float] = {}

    def rate(step: int) -> float:
        if step not in memo:
            memo[step] = 0.2 + float(labels(module)[step * 10:step * 10 + 10].mean())
        return memo[step]
    return LambdaLR(optimizer, rate)


def test_a_schedule_memoising_what_it_read_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match=READ_OR_BUILT):
        fit(Scheduled(_memoised), steps=4)


RATES = [0.2, 0.4, 0.6, 0.8] + [1.0] * 20
"""A public table of rates per step (a piecewise schedule)."""


class LabelTable(dict):
    """A dict subclass whose ``__missing__`` reads ten training records per step: torch's ``dict.__getitem__`` runs it."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = [module]

    def __missing__(self, step: int) -> float:
        return 0.2 + float(labels(self.module[0])[step * 10:step * 10 + 10].mean())


def test_a_lambda_of_a_public_tables_getitem_trains_and_follows_the_table() -> None:
    """``LambdaLR(opt, RATES.__getitem__)``: torch's ``state_dict()`` raises for a callable without ``__dict__``; the
    checks that note and put back the schedule must not fail on it (it was refused as a training_step failure on
    Poisson batch sizes, zoo35 R45)."""
    model = Scheduled(lambda o, m: LambdaLR(o, RATES.__getitem__))
    fit(model, steps=4)
    scheduler = model.trainer.lr_scheduler_configs[0].scheduler
    assert model.trainer.global_step == 4 and scheduler.last_epoch == 4
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * RATES[4])


@pytest.mark.parametrize("wrap", [lambda f: f, functools.partial], ids=["bound-method", "partial"])
def test_a_builtin_method_of_the_users_dict_subclass_reading_records_is_refused(wrap: Callable[[Any], Any]) -> None:
    """``Table().__getitem__`` is ``builtins``' method, yet it runs the user's ``__missing__`` (zoo35 R11)."""
    model = Scheduled(lambda o, m: LambdaLR(o, wrap(LabelTable(m).__getitem__)))
    with pytest.raises(PrivacyConfigurationError, match=READ_OR_BUILT):
        fit(model, steps=12, n=32)


@functools.lru_cache(maxsize=None)
def _cached_rate(step: int) -> float:
    """A warm-up then cosine rate of the step count, memoised (zoo35 R44: its cache is a global the update writes)."""
    return (step + 1) / 3 if step < 3 else 0.5 * (1 + math.cos(math.pi * (step - 3) / 10))


STASH: list[float] = []
"""A global of this module a schedule function writes into."""


def _stashing(optimizer: Any, module: Any) -> LambdaLR:
    def rate(step: int) -> float:  # a public rate; the labels' rate kept in a global on the side
        STASH.append(float(labels(module)[step * 10:step * 10 + 10].mean()))
        return 0.9 ** step
    return LambdaLR(optimizer, rate)


def test_a_memoised_schedule_is_refused_as_written_state_unless_declared_public() -> None:
    """A cache the update writes cannot be put back for the runs again (it would serve them what the real update
    computed, zoo35 R13): refused at the next release as written state; declared public, it trains (zoo35 R44)."""
    _cached_rate.cache_clear()
    with pytest.raises(PrivacyConfigurationError, match="_cached_rate"):
        fit(Scheduled(lambda o, m: LambdaLR(o, _cached_rate)), steps=6)
    _cached_rate.cache_clear()
    model = Scheduled(lambda o, m: LambdaLR(o, _cached_rate))
    fit(model, steps=6, public_state=[f"{__name__}._cached_rate"])
    assert model.trainer.global_step == 6
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * _cached_rate(6))


def test_a_schedule_keeping_what_it_read_beside_a_public_rate_is_refused() -> None:
    """The rates alike on any data, the state the update wrote is judged too before it is accepted: a statistic of
    the labels kept in a global is set apart by the exchanged data."""
    STASH.clear()
    with pytest.raises(PrivacyConfigurationError, match=READ_OR_BUILT):
        fit(Scheduled(_stashing), steps=4)
