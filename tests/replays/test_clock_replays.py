"""The clocks the replays of the user's hooks read (replays/clock.py in validators/step_replays.py): the first-step
replays of the batch hooks and of the epoch hooks, and the later checks of the hooks before the release, run from the
same clock values as their first run, so a time stamp kept by ``training_step``, ``on_train_batch_start``,
``on_before_backward`` or an epoch hook (a float, a tensor, a list of them; read in the hook's module or through a
name another module binds) is written alike and accepted, and the same stamp with the data mixed in — however small
the clock's share, ``time.time() * 1e-12 + mean`` or however large, ``time.time() + mean * 1e-3`` — is refused: the
run on the data again no longer differs, so nothing excuses what the other data set apart (zoo30 k03)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import Classifier, data, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402
from timing_helpers import stamp  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

Kept = Callable[[Any, float], Any]  # (the value read from the data, the clock) → what the hook keeps

CLOCK_ONLY: dict[str, Kept] = {
    "float": lambda value, now: now,
    "tensor": lambda value, now: torch.tensor(now, dtype=torch.float64),
    "list": lambda value, now: [now],
}
"""What a hook keeps from the clock alone: accepted."""

CLOCK_AND_DATA: dict[str, Kept] = {
    "float": lambda value, now: now + value * 1e-3,  # k03: time.time() + mean * 1e-3
    "tiny clock": lambda value, now: now * 1e-12 + value,  # the mean carried almost exactly
    "tensor": lambda value, now: torch.tensor(now, dtype=torch.float64) + value,
    "list": lambda value, now: [now + value],
}
"""What a hook keeps from the clock and the data: refused."""

CLOCKS: dict[str, Callable[[], float]] = {"time.time": lambda: time.time(), "utils module": stamp}


class Stamped(Classifier):
    """Keeps ``kept(a value of the data, the clock)`` in ``self.stamp`` from one hook (``where``); in a list, appends
    to it."""

    def __init__(self, where: str, kept: Kept, clock: Callable[[], float] = lambda: time.time()) -> None:
        super().__init__()
        self.where, self.kept, self.clock = where, kept, clock
        self.dataset = data()  # what the epoch hook reads of the training set (its copy in memory is exchanged)
        self.stamp: Any = None
        self.stamps: list[Any] = []

    def keep(self, value: torch.Tensor) -> None:
        kept = self.kept(float(value.detach()), self.clock())
        if isinstance(kept, list):
            self.stamps.extend(kept)
        else:
            self.stamp = kept

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.where == "training_step":
            self.keep(batch[0].mean())
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.where == "on_train_batch_start":
            self.keep(batch[0].mean())

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.where == "on_before_backward":
            self.keep(loss)

    def on_train_epoch_start(self) -> None:
        if self.where == "on_train_epoch_start":
            self.keep(self.dataset.tensors[0].mean())


HOOKS = ("training_step", "on_train_batch_start", "on_before_backward", "on_train_epoch_start")


def _fit(model: Stamped) -> None:
    quiet_trainer(strategy=strategy(), max_epochs=2).fit(model, DataLoader(model.dataset, batch_size=16))


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("kind", sorted(CLOCK_ONLY))
def test_a_time_stamp_alone_is_accepted(hook: str, kind: str) -> None:
    model = Stamped(hook, CLOCK_ONLY[kind])
    _fit(model)
    assert model.stamp is not None or model.stamps  # kept: the fit ran through


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("kind", sorted(CLOCK_AND_DATA))
def test_a_time_stamp_with_the_data_mixed_in_is_refused(hook: str, kind: str) -> None:
    model = Stamped(hook, CLOCK_AND_DATA[kind])
    with pytest.raises(PrivacyConfigurationError):
        _fit(model)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_clock_bound_in_another_module_is_replayed(mixed: bool) -> None:
    """``from time import perf_counter`` in the user's utils module, read from ``training_step``: replayed as the
    hook module's own names are."""
    model = Stamped("training_step", CLOCK_AND_DATA["float"] if mixed else CLOCK_ONLY["float"], CLOCKS["utils module"])
    if mixed:
        with pytest.raises(PrivacyConfigurationError):
            _fit(model)
    else:
        _fit(model)
        assert model.stamp is not None


def test_an_unseeded_draw_beside_the_data_is_no_excuse() -> None:
    """A number the runs on the data still set apart (a generator nobody seeds, made in the hook) with the data mixed
    in: judged by value, refused (it was excused as a time stamp)."""
    import numpy as np

    model = Stamped("training_step", lambda value, now: float(np.random.default_rng().random()) * 1e-6 + value)
    with pytest.raises(PrivacyConfigurationError):
        _fit(model)
