"""Kept state on the tensors themselves (validators/kept_state.py): a Python attribute set on a parameter or a buffer
from the batch (``self.fc.weight.cache = x``) is kept state like a module attribute: refused before any release,
unless declared public; the engine's own tensor attributes (Opacus' ``grad_sample``) are not the user's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit, parameters, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.kept_state import StateFingerprint  # noqa: E402


class CachesOnWeight(Classifier):
    """Keeps the batch's mean feature vector on the first layer's weight tensor."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.net[0].weight.cache = batch[0].mean(0).detach()
        return super().training_step(batch, batch_idx)


class CountsOnBuffer(Classifier):
    """Keeps a Python count of positive labels as an attribute of a buffer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.seen.positives = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.positives += int((batch[1] == 1).sum())
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("model, entry", [(CachesOnWeight, "net.0.weight.cache"), (CountsOnBuffer, "seen.positives")])
def test_an_attribute_written_on_a_tensor_is_refused_before_any_release(model, entry):
    m = model()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=entry.replace(".", r"\.")):
        fit(m, steps=3)
    assert unchanged(before, m)


def test_a_public_tensor_attribute_is_allowed():
    fit(CachesOnWeight(), steps=3, public_state=["net.0.weight.cache"])


def test_the_fingerprint_reads_tensor_attributes_and_skips_the_engines():
    model = Classifier()
    fingerprint = StateFingerprint(model, skip_keys={"grad_sample"})
    model.net[0].weight.grad_sample = torch.ones(3)  # the engine's
    model.net[2].bias.note = [1, 2]
    before = fingerprint.take()
    model.net[0].weight.grad_sample = torch.zeros(3)
    assert StateFingerprint.changed(before, fingerprint.take()) == []
    model.net[2].bias.note.append(3)
    assert StateFingerprint.changed(before, fingerprint.take()) == ["attribute net.2.bias.note"]


def test_the_opacus_engine_runs_with_its_tensor_attributes():
    pytest.importorskip("opacus")
    fit(Classifier(), steps=3, per_sample="opacus_hooks")


def test_a_float_buffer_written_through_data_shows_between_full_passes():
    model = Classifier()
    model.register_buffer("mean", torch.zeros(4))
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    model.mean.data.copy_(torch.ones(4))  # neither storage nor version counter moves
    assert StateFingerprint.changed(before, fingerprint.take()) == ["contents of buffer mean"]


def test_norms_kept_on_a_device_compare_by_value_when_compared():
    from lightning_dp.validators.kept_state import _DeviceNorms

    before = {"contents of 2 parameters and buffers on cuda:0": _DeviceNorms(torch.tensor([1.0, 2.0]))}
    same = {"contents of 2 parameters and buffers on cuda:0": _DeviceNorms(torch.tensor([1.0, 2.0]))}
    moved = {"contents of 2 parameters and buffers on cuda:0": _DeviceNorms(torch.tensor([1.0, 2.5]))}
    assert StateFingerprint.changed(before, same) == []
    assert StateFingerprint.changed(before, moved) == list(moved)
