"""A counter ``training_step`` increments and reads (a warm-up factor from a step-counter buffer): every pass of the
first step's probe and of the batch check starts from the user's state as the step found it
(validators/probe.py ``start_state``, validators/snapshot.py ``restore_users``), so the passes read one count, as the
step does, instead of one more each — which the comparisons took for examples interacting. What the step writes is
judged by the replays on other data: a counter trains, a buffer counting the batch's labels is refused."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit, parameters, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class WarmsUp(Classifier):
    """Scales the loss by min(1, n/5), n a persistent buffer (or a Python number) incremented by each step."""

    def __init__(self, kind: str = "long") -> None:
        super().__init__()
        self.kind = kind
        if kind == "int":
            self.n_steps = 0
        else:
            self.register_buffer("n_steps", torch.zeros((), dtype=torch.long if kind == "long" else torch.float32))

    def count(self, batch: Any) -> Any:
        return 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.n_steps += self.count(batch)
        return super().training_step(batch, batch_idx) * min(1.0, float(self.n_steps) / 5)


class CountsPositives(WarmsUp):
    def count(self, batch: Any) -> Any:
        return (batch[1] == 1).sum()


@pytest.mark.parametrize("kind", ["long", "float", "int"])
def test_a_step_counter_read_by_the_loss_trains(kind):
    model = WarmsUp(kind)
    before = parameters(model)
    fit(model, steps=3)
    assert int(model.n_steps) == 3  # the probe's and the checks' passes put back: the real steps only
    assert not unchanged(before, model)


def test_a_buffer_counting_the_batchs_labels_is_refused_before_any_release():
    model = CountsPositives("long")
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match="n_steps"):
        fit(model, steps=3)
    assert unchanged(before, model)
