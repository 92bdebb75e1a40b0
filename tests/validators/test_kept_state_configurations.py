"""A library's configuration object used as a namespace is state (validators/kept_state.py,
``configuration_object``): Hugging Face's ``model.config`` given a temperature from the batch loss at batch end, or
``generation_config.max_length`` from the training batches (saved by ``save_pretrained``), steers later steps or
leaves with the model un-noised and is refused; fields set from public values train."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.fingerprints.state_walker import configuration_object  # noqa: E402

transformers = pytest.importorskip("transformers")


class WithConfig(Classifier):
    """A classifier carrying a Hugging Face configuration object, as an HF model does."""

    def __init__(self) -> None:
        super().__init__()
        self.config = transformers.PretrainedConfig(distill_temp=1.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x) / self.config.distill_temp, y)


class TemperatureFromLoss(WithConfig):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.config.distill_temp = 1.0 + float(outputs["loss"])


class LengthFromBatches(WithConfig):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.config.max_seen = max(getattr(self.config, "max_seen", 0.0), float(batch[0].abs().max()))


@pytest.mark.parametrize("model", [TemperatureFromLoss, LengthFromBatches])
def test_a_configuration_object_written_from_the_batch_is_refused(model):
    with pytest.raises(PrivacyConfigurationError, match="config"):
        fit(model(), steps=6)


class TemperatureAtStart(WithConfig):
    def on_train_start(self) -> None:
        self.config.distill_temp = 2.0


@pytest.mark.parametrize("model", [WithConfig, TemperatureAtStart])
def test_a_configuration_object_of_public_values_trains(model):
    assert fit(model(), steps=5).ledger.steps == 5


@dataclasses.dataclass
class _Settings:
    rate: float = 0.1


def test_what_counts_as_a_configuration_object():
    assert configuration_object(transformers.PretrainedConfig())
    assert configuration_object(transformers.GenerationConfig())
    assert configuration_object(_Settings())
    assert not configuration_object(nn.Linear(2, 2)) and not configuration_object(torch.zeros(2))
    assert not configuration_object(object())
