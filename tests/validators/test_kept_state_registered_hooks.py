"""Module hooks registered by the user's hooks during the fit (validators/kept_state.py, hook_replays.users_hooks_kept):
a forward (pre-)hook or a backward hook registered at a hook's *first* call and chosen by the batch's labels is a
decision the next forwards run; every run again starts from the hooks as they were and is compared by what it
registers (by place and code, not by the handle's number), so the batch's choice is refused, while a hook registered
alike on any data (a logging hook added lazily, one added by an epoch schedule, one added and removed within a step)
trains."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.kept_state import StateFingerprint  # noqa: E402


def _double(m: Any, inp: Any) -> Any:
    return (inp[0] * 2,)


def _halve(m: Any, inp: Any) -> Any:
    return (inp[0] * 0.5,)


def _double_out(m: Any, inp: Any, out: Any) -> Any:
    return out * 2


def _halve_out(m: Any, inp: Any, out: Any) -> Any:
    return out * 0.5


def _note(m: Any, grad_in: Any, grad_out: Any) -> None:
    return None


def _other_note(m: Any, grad_in: Any, grad_out: Any) -> None:
    return None


_KINDS = {"pre": ("register_forward_pre_hook", _double, _halve),
          "forward": ("register_forward_hook", _double_out, _halve_out),
          "backward": ("register_full_backward_hook", _note, _other_note)}


class ChosenByLabels(Classifier):
    """At the first call of ``where`` (by the step count), a hook on the first layer chosen by the batch's share of
    positives: one bit of the batch kept in the model for every later forward."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__()
        self.where = where
        self.register, self.many, self.few = _KINDS[kind]

    def _choose(self, batch: Any, first: bool) -> None:
        layer = self.net[0]
        tables = (layer._forward_pre_hooks, layer._forward_hooks, layer._backward_hooks)
        if first and not any(fn in (self.many, self.few) for t in tables for fn in t.values()):
            getattr(layer, self.register)(self.many if batch[1].float().mean() > 0.5 else self.few)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._choose(batch, self.where == "training_step" and self.global_step == 0)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # "first step": also in the first step's replays (global_step 0); "first call": only the loop's first call
        self._choose(batch, self.where == "first step" and self.global_step <= 1
                     or self.where == "first call" and self.global_step == 1)


@pytest.mark.parametrize("kind", ["pre", "forward", "backward"])
@pytest.mark.parametrize("where", ["first step", "first call"])
def test_a_hook_chosen_by_the_labels_at_the_first_batch_end_is_refused(where, kind):
    with pytest.raises(PrivacyConfigurationError, match=r"hook net\.0\._(forward_pre|forward|backward)_hooks\[0\]"):
        fit(ChosenByLabels(where, kind), steps=4)


def test_a_hook_chosen_by_the_labels_in_the_first_training_step_is_refused():
    with pytest.raises(PrivacyConfigurationError, match=r"hook net\.0\._backward_hooks\[0\]"):
        fit(ChosenByLabels("training_step", "backward"), steps=4)


def _log(m: Any, inp: Any, out: Any) -> None:
    return None


class LazyLoggingHook(Classifier):
    """A logging hook added at the first batch's end, on any data (its handle kept to remove it later)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if getattr(self, "handle", None) is None:
            self.handle = self.net[2].register_forward_hook(lambda m, i, o: None)
        if _log not in self.net[0]._forward_hooks.values():
            self.net[0].register_forward_hook(_log)


class ScheduledHook(Classifier):
    """A scaling pre-hook added when the second epoch starts (a schedule: the epoch number, not the data)."""

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            self.net[0].register_forward_pre_hook(lambda m, inp: (inp[0] * 0.5,))


class TransientHook(Classifier):
    """A pre-hook added and removed around every step's forward."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        handle = self.net[0].register_forward_pre_hook(lambda m, inp: None)
        try:
            return super().training_step(batch, batch_idx)
        finally:
            handle.remove()


@pytest.mark.parametrize("model", [LazyLoggingHook, ScheduledHook, TransientHook])
def test_hooks_registered_alike_on_any_data_train(model):
    m = model()
    fit(m, steps=6)  # 64 records in batches of 16: the second epoch starts at step 4
    if model is LazyLoggingHook:
        assert _log in m.net[0]._forward_hooks.values() and m.handle.id in m.net[2]._forward_hooks
    if model is ScheduledHook:
        assert len(m.net[0]._forward_pre_hooks) >= 1


def test_the_fingerprint_names_a_hook_by_its_place_and_compares_its_code():
    model = Classifier()
    fingerprint = StateFingerprint(model)
    handle = model.net[0].register_forward_hook(_double_out)
    before = fingerprint.take()
    assert "hook net.0._forward_hooks[0]" in before
    handle.remove()
    model.net[0].register_forward_hook(_double_out)  # the same code again: another handle's number
    assert StateFingerprint.changed(before, fingerprint.take()) == []
    model.net[0]._forward_hooks.clear()
    model.net[0].register_forward_hook(_halve_out)  # another function in its place
    assert StateFingerprint.changed(before, fingerprint.take()) == ["hook net.0._forward_hooks[0]"]
