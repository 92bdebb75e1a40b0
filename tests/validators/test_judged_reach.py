"""The judges' reach (validators/judged_updates.py, judged_schedules.py; zoo36 T01, T02, T05, T06, T08, T58, T59,
T60): an update or a schedule run again from the step's start must find every copy of the training data its code
reads exchanged — one the optimizer holds as an attribute, one in the closure of its class's method or of a rate
function, one behind a second DataLoader kept as a global — and every memo it keeps put back — in a ``__slots__``
object, in a function's own attributes. Each is refused; the safe twins (a fixed mask on the optimizer, a counter in
slots or in a function attribute, a rate memo of the step, a held-out loader read in the step) train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, fit, parameters, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

UPDATE = "The optimizer's update read the training data"
SCHEDULE = "The learning-rate schedule read the training data|configured scheduler 0"
"""(Or, first, the replays of the hooks that see no batch: configure_optimizers builds the scheduler again on the
exchanged data, and a LambdaLR runs its function as it is built.)"""


class Writes(torch.optim.SGD):
    """SGD whose step then writes ``value()`` (two numbers) into the output bias."""

    def __init__(self, module: Any, value: Callable[["Writes"], torch.Tensor]) -> None:
        super().__init__(module.parameters(), lr=0.1)
        self.bias, self.value = module.net[2].bias, value

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = super().step(closure)
        self.bias.copy_(self.value(self))
        return loss


class WithOptimizer(Classifier):
    def __init__(self, make: Callable[[Any], Any]) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make(self)


def training_features(module: Any) -> torch.Tensor:
    return module.trainer.train_dataloader.dataset.tensors[0]


def refused(make: Callable[[Any], Any], match: str) -> None:
    model = WithOptimizer(make)
    with pytest.raises(PrivacyConfigurationError, match=match):
        fit(model, steps=3)


def trains(make: Callable[[Any], Any]) -> None:
    model = WithOptimizer(make)
    before = parameters(model)
    fit(model, steps=3)
    assert not unchanged(before, model)


# ---------------------------------------------------------------------- copies the exchange must reach
class HoldsCopy(Writes):
    """T01: a clone of the training features kept as the optimizer's own attribute."""

    def __init__(self, module: Any, src: torch.Tensor) -> None:
        super().__init__(module, lambda o: 0.5 * o.src.mean(0)[:2] + 0.1)
        self.src = src


def test_a_training_copy_held_by_the_optimizer_is_exchanged() -> None:
    refused(lambda m: HoldsCopy(m, data().tensors[0].clone()), UPDATE)


def test_a_training_statistic_held_by_the_optimizer_is_refused() -> None:
    """Not a copy (the exchange finds copies by content): the training mean computed as the optimizer is made, held
    as its attribute, is a statistic of the training data held before training (rule 11)."""
    refused(lambda m: HoldsCopy(m, data().tensors[0].mean(0, keepdim=True)), "Statistics of the training data")


def _closure_class(xn: Any) -> type:
    class ClosureCopy(torch.optim.SGD):  # T02: a NumPy copy in the closure of the class's step (made in a factory)
        def __init__(self, module: Any) -> None:
            super().__init__(module.parameters(), lr=0.1)
            self.bias = module.net[2].bias

        @torch.no_grad()
        def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
            loss = super().step(closure)
            self.bias.copy_(torch.from_numpy(0.5 * xn.mean(0)[:2] + 0.1))
            return loss
    return ClosureCopy


def test_a_training_copy_in_the_closure_of_the_optimizers_method_is_exchanged() -> None:
    cls = _closure_class(data().tensors[0].numpy().copy())
    refused(lambda m: cls(m), UPDATE)


AUX = DataLoader(data(), batch_size=64)  # T08: a second loader over a copy of the training set, kept as a global
HELD_OUT = DataLoader(data(seed=1), batch_size=64)  # its safe twin: a held-out set


def test_a_second_loader_over_a_training_copy_is_exchanged() -> None:
    refused(lambda m: Writes(m, lambda o: 0.5 * next(iter(AUX))[0].mean(0)[:2] + 0.1), UPDATE)


def test_a_held_out_loader_read_in_the_step_trains() -> None:
    trains(lambda m: Writes(m, lambda o: 0.5 * next(iter(HELD_OUT))[0].mean(0)[:2] + 0.1))


def _rate_reading(labels: Any) -> Callable[[int], float]:
    def rate(s: int) -> float:  # T59: ten labels a step from a float64 NumPy copy held in the closure
        return 0.2 + float(labels[(s % 6) * 10:(s % 6) * 10 + 10].mean())
    return rate


def scheduled(rate: Callable[[int], float]) -> Callable[[Any], Any]:
    def make(module: Any) -> Any:
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, rate),
                                                   "interval": "step"}}
    return make


def test_a_label_copy_in_a_rate_functions_closure_is_exchanged() -> None:
    refused(scheduled(_rate_reading(data().tensors[1].numpy().astype("float64"))), SCHEDULE)


# ---------------------------------------------------------------------- state the run again must put back
class Box:
    __slots__ = ("v",)

    def __init__(self) -> None:
        self.v: Any = None


def _slot_memo(o: Any) -> torch.Tensor:
    """T05: a training statistic cached at the first step in a __slots__ object the optimizer holds."""
    if o.box.v is None:
        o.box.v = tuple((0.5 * training_features(o.module[0]).mean(0)[:2] + 0.1).tolist())
    return torch.tensor(o.box.v)


def _slot_counter(o: Any) -> torch.Tensor:
    """Its safe twin: a step counter in the slots."""
    o.box.v = (o.box.v or 0) + 1
    return o.bias * (1.0 - 0.01 * o.box.v)


def with_box(value: Callable[[Any], torch.Tensor]) -> Callable[[Any], Any]:
    def make(module: Any) -> Any:
        opt = Writes(module, value)
        opt.box, opt.module = Box(), [module]
        return opt
    return make


def test_a_memo_in_slots_is_put_back() -> None:
    refused(with_box(_slot_memo), UPDATE)


def test_a_counter_in_slots_trains() -> None:
    trains(with_box(_slot_counter))


def stat(module: Any) -> tuple:
    """T06: a training statistic cached in the function's own attribute."""
    if getattr(stat, "v", None) is None:
        stat.v = tuple((0.5 * training_features(module).mean(0)[:2] + 0.1).tolist())  # type: ignore[attr-defined]
    return stat.v  # type: ignore[attr-defined]


def count() -> int:
    """Its safe twin: a call counter in the function's own attribute."""
    count.calls = getattr(count, "calls", 0) + 1  # type: ignore[attr-defined]
    return count.calls  # type: ignore[attr-defined]


def test_a_memo_in_a_functions_attribute_is_put_back() -> None:
    def make(module: Any) -> Any:
        return Writes(module, lambda o: torch.tensor(stat(module)))
    try:
        refused(make, UPDATE)
    finally:
        vars(stat).pop("v", None)


def test_a_counter_in_a_functions_attribute_trains() -> None:
    try:
        trains(lambda m: Writes(m, lambda o: o.bias * (1.0 - 0.01 * count())))
    finally:
        vars(count).pop("calls", None)


def _slot_rate(read: Callable[[int], float]) -> Callable[[int], float]:
    memo = Box()
    memo.v = {}

    def rate(s: int) -> float:  # T58: each step's rate memoised in a __slots__ object of the closure
        if s not in memo.v:
            memo.v[s] = read(s)
        return memo.v[s]
    return rate


LABELS: list = []  # the model, through which a rate function reaches the training labels (set below)


def label_rate(s: int) -> float:
    loader = LABELS[0].trainer.train_dataloader
    if loader is None:  # (the scheduler's first call, in configure_optimizers)
        return 1.0
    y = loader.dataset.tensors[1]
    return 0.2 + float(y[(s % 6) * 10:(s % 6) * 10 + 10].float().mean())


def labelled(rate: Callable[[int], float]) -> Callable[[Any], Any]:
    inner = scheduled(rate)

    def make(module: Any) -> Any:
        LABELS[:] = [module]
        return inner(module)
    return make


def test_a_rate_memo_in_slots_is_put_back() -> None:
    try:
        refused(labelled(_slot_rate(label_rate)), SCHEDULE)
    finally:
        LABELS.clear()


def test_a_rate_memo_of_the_step_in_slots_trains() -> None:
    trains(scheduled(_slot_rate(lambda s: 0.9 ** s)))


def memo_rate(s: int) -> float:
    """T60: each step's rate memoised in the function's own attribute (the training labels)."""
    memo = memo_rate.__dict__.setdefault("memo", {})
    if s not in memo:
        memo[s] = label_rate(s)
    return memo[s]


def step_rate(s: int) -> float:
    """Its safe twin: a memo of a rate of the step alone."""
    memo = step_rate.__dict__.setdefault("memo", {})
    if s not in memo:
        memo[s] = 0.9 ** s
    return memo[s]


def test_a_rate_memo_in_a_functions_attribute_is_put_back() -> None:
    try:
        refused(labelled(memo_rate), SCHEDULE)
    finally:
        LABELS.clear()
        vars(memo_rate).pop("memo", None)


def test_a_rate_memo_of_the_step_in_a_functions_attribute_trains() -> None:
    try:
        trains(scheduled(step_rate))
    finally:
        vars(step_rate).pop("memo", None)


class Masked(torch.optim.SGD):
    """A public tensor attribute of the optimizer: a fixed mask on the output bias's update."""

    def __init__(self, module: Any) -> None:
        super().__init__(module.parameters(), lr=0.1)
        self.bias, self.mask = module.net[2].bias, torch.tensor([1.0, 0.0])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        before = self.bias.detach().clone()
        loss = super().step(closure)
        self.bias.copy_(before + self.mask * (self.bias - before))
        return loss


def test_an_optimizer_holding_a_fixed_mask_trains() -> None:
    trains(lambda m: Masked(m))
