"""StateSnapshot (lightning_dp/validators/snapshot.py): what the probe's and the checks' passes write is put back,
whatever the user's objects hold (NumPy arrays written in place, NumPy scalars, read-only arrays)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from lightning_dp.validators.snapshot import StateSnapshot


class Holder:
    """A callback-like object with NumPy state of every kind."""

    def __init__(self) -> None:
        self.running = np.zeros(3)
        self.best = np.float64(0.5)
        self.frozen = np.frombuffer(np.arange(3.0).tobytes())  # read-only
        self.count = 0


def test_numpy_state_is_restored_and_immutable_numpy_values_do_not_break_the_restore():
    holder, model = Holder(), nn.Linear(2, 2)
    running, frozen = holder.running, holder.frozen
    assert not frozen.flags.writeable
    snapshot = StateSnapshot(model, callbacks=[holder])
    holder.running += 7.0  # written in place by a pass
    holder.best = np.float64(0.9)  # rebound
    holder.count = 5
    with torch.no_grad():
        model.weight.add_(0.0)
    snapshot.restore()
    assert holder.running is running and np.array_equal(holder.running, np.zeros(3))
    assert holder.best == np.float64(0.5) and holder.count == 0
    assert holder.frozen is frozen and np.array_equal(frozen, np.arange(3.0))
