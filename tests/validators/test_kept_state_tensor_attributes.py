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
    from lightning_dp.fingerprints.checksums import _DeviceNorms

    before = {"contents of 2 parameters and buffers on cuda:0": _DeviceNorms(torch.tensor([1.0, 2.0]))}
    same = {"contents of 2 parameters and buffers on cuda:0": _DeviceNorms(torch.tensor([1.0, 2.0]))}
    moved = {"contents of 2 parameters and buffers on cuda:0": _DeviceNorms(torch.tensor([1.0, 2.5]))}
    assert StateFingerprint.changed(before, same) == []
    assert StateFingerprint.changed(before, moved) == list(moved)


# --------------------------------------------------------------------------- beyond parameters and buffers
# A forward hook keeping a statistic of the batch where only a parameter's or a buffer's `__dict__` used to be read:
# on a plain (unregistered) tensor attribute, on a tensor held in a list, on the hook function object itself. The
# next step's forward reads it back: un-noised, it would reach every later release (red team ta1).


class KeepsOnPlainTensor(Classifier):
    """``self.temp`` is a plain tensor attribute; a forward hook keeps the batch's mean activation on it."""

    def __init__(self) -> None:
        super().__init__()
        self.temp = torch.ones(1)

        def hook(mod, inp, out):
            stats = getattr(self.temp, "stats", None)
            self.temp.stats = out.detach().abs().mean()
            return out if stats is None else out * float(stats)
        self.net[0].register_forward_hook(hook)


class KeepsOnListedTensor(Classifier):
    """The same statistic kept on a tensor held in a Python list attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.bank = [torch.ones(1)]

        def hook(mod, inp, out):
            self.bank[0].stats = float(out.detach().abs().mean())
        self.net[0].register_forward_hook(hook)


def _remember(mod, inp, out):  # keeps the statistic on itself: no closure, no default argument
    stats = getattr(_remember, "stats", None)
    _remember.stats = float(out.detach().abs().mean())
    return out if stats is None else out * stats


class KeepsOnHookFunction(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net[0].register_forward_hook(_remember)

    def on_fit_start(self) -> None:
        _remember.__dict__.pop("stats", None)


class KeepsOnNestedHookFunction(Classifier):
    """The hook keeps the statistic on its own function object, committed at the batch's end, and a lambda on the
    module reads it back in the next step's forward (the red team's ta1-funcattr)."""

    def __init__(self) -> None:
        super().__init__()

        def hook(mod, inp, out):
            if mod.training:
                hook.pending = out.detach().abs().mean()
        hook.stats = None
        self.net[0].register_forward_hook(hook)
        self.read = lambda: hook.stats
        self.commit = lambda: setattr(hook, "stats", hook.pending)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.commit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.read()
        return self.net(x) * (1.0 if s is None else float(s))


@pytest.mark.parametrize("model, entry", [(KeepsOnPlainTensor, "attribute temp"), (KeepsOnListedTensor, "attribute bank"),
                                          (KeepsOnHookFunction, "hook net.0._forward_hooks"),
                                          (KeepsOnNestedHookFunction, "attribute read")])
def test_a_statistic_kept_on_a_plain_tensor_or_a_hook_function_is_refused_before_any_release(model, entry):
    m = model()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=entry.replace(".", r"\.").replace("[", r"\[")):
        fit(m, steps=3)
    assert unchanged(before, m)


def _scaled(mod, inp, out):
    return out * _scaled.scale


_scaled.scale = 0.5


class ConstantAttributes(Classifier):
    """Attributes set once, not from the data: a tag on a plain tensor attribute, a scale on the hook function, a
    constant on a nested hook read back through a lambda."""

    def __init__(self) -> None:
        super().__init__()
        self.temp = torch.ones(1)
        self.temp.tag = "fixed"
        self.bank = [torch.ones(1)]
        self.bank[0].scale = 2.0
        self.net[0].register_forward_hook(_scaled)

        def hook(mod, inp, out):
            return out * hook.factor
        hook.factor = 1.5
        self.net[2].register_forward_hook(hook)
        self.read = lambda: hook.factor


def test_constant_attributes_on_plain_tensors_and_hook_functions_train():
    m = ConstantAttributes()
    before = parameters(m)
    fit(m, steps=3)
    assert not unchanged(before, m)


def test_the_fingerprint_reads_plain_tensor_and_function_attributes():
    model = Classifier()
    model.temp = torch.zeros(2)
    model.temp.grad_sample = torch.ones(3)  # the engine's name: skipped wherever it is

    def hook(mod, inp, out):
        return None
    model.net[0].register_forward_hook(hook)
    fingerprint = StateFingerprint(model, skip_keys={"grad_sample"})
    before = fingerprint.take()
    model.temp.grad_sample = torch.zeros(3)
    assert StateFingerprint.changed(before, fingerprint.take()) == []
    model.temp.stats = torch.ones(1)
    assert StateFingerprint.changed(before, fingerprint.take()) == ["attribute temp"]
    del model.temp.stats
    hook.stats = 1.0
    assert [n.partition("[")[0] for n in StateFingerprint.changed(before, fingerprint.take())] \
        == ["hook net.0._forward_hooks"]
