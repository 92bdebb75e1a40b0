"""A ``contextvars.ContextVar`` kept as a global of the user's code (fingerprints/context_values.py, rule 3 of
docs/release_boundary.md): its value lives in the running context, not in the object; a scale set there from the
batch loss and read by the next forward is refused (zoo16 cv1); a count of batches kept there trains, counted once."""

from __future__ import annotations

import contextvars
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.fingerprints.context_values import UNSET, restore, value_of  # noqa: E402

SCALE = contextvars.ContextVar("scale", default=1.0)
BATCHES = contextvars.ContextVar("batches", default=0)


class ScaledByLastLoss(Classifier):
    """Scales its inputs by a value the batch end sets from the loss, once the first update is made."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x * SCALE.get()), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step == 1:
            SCALE.set(1.0 + float(outputs["loss"]))


class CountsBatches(Classifier):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        BATCHES.set(BATCHES.get() + 1)


def test_a_scale_kept_in_a_context_variable_from_the_loss_is_refused() -> None:
    token = SCALE.set(1.0)
    try:
        with pytest.raises(PrivacyConfigurationError, match="SCALE"):
            fit(ScaledByLastLoss(), steps=3, noise_multiplier=1e-6)
    finally:
        SCALE.reset(token)


def test_a_count_kept_in_a_context_variable_trains_and_counts_once() -> None:
    token = BATCHES.set(0)
    try:
        assert fit(CountsBatches(), steps=4).ledger.steps == 4
        assert BATCHES.get() == 4  # the replays' runs set it back
    finally:
        BATCHES.reset(token)


def test_value_and_restore() -> None:
    variable: contextvars.ContextVar = contextvars.ContextVar("v", default=3)
    bare: contextvars.ContextVar = contextvars.ContextVar("bare")
    assert value_of(variable) == 3 and value_of(bare) is UNSET
    put, put_bare = restore(variable), restore(bare)
    variable.set(5)
    bare.set(1)
    put()
    put_bare()
    assert value_of(variable) == 3 and value_of(bare) == 1
