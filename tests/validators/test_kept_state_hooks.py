"""Kept state in the user's module hooks (validators/kept_state.py): a forward or backward hook that keeps what it
sees — in a closure, a mutable default argument, a partial's arguments or its object — is refused before any
release; the engine's own hooks (lightning_dp's, Opacus') are not the user's."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit, parameters, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.kept_state import StateFingerprint  # noqa: E402


class ClosureCache(Classifier):
    def __init__(self) -> None:
        super().__init__()
        seen: list[torch.Tensor] = []
        self.net[0].register_forward_hook(lambda m, i, o: seen.append(o.detach()))


def _keep(m, i, o, store=[]):  # noqa: B006  (the habit under test)
    store.append(float(o.sum()))


class DefaultArgumentCache(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net[2].register_forward_hook(_keep)


def _into(store: dict, m, grad_in, grad_out) -> None:
    store["last"] = grad_out[0].detach()


class PartialBackwardCache(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net[2].register_full_backward_hook(functools.partial(_into, {}))


@pytest.mark.parametrize("model", [ClosureCache, DefaultArgumentCache, PartialBackwardCache])
def test_a_hook_keeping_what_it_sees_is_refused_before_any_release(model):
    m = model()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match="hook net"):
        fit(m, steps=3)
    assert unchanged(before, m)


def test_a_stateless_user_hook_trains():
    m = Classifier()
    m.net[1].register_forward_hook(lambda mod, i, o: o.clamp(-5, 5))
    dp = fit(m, steps=3)
    assert dp.ledger.steps == 3


def test_a_hook_registered_later_is_read_when_it_fills():
    m = Classifier()
    fingerprint = StateFingerprint(m)
    assert not [k for k in fingerprint.take() if k.startswith("hook ")]
    seen: list[Any] = []
    m.net[0].register_forward_pre_hook(lambda mod, args: seen.append(1))
    before = fingerprint.take()
    m(torch.zeros(2, 4))
    assert [k for k in StateFingerprint.changed(before, fingerprint.take()) if k.startswith("hook ")]


def _recorder():
    kept: list[float] = []

    def record(value: float) -> None:
        kept.append(value)

    return record


class KeepsThroughAClosureAttribute(Classifier):
    """Keeps the batch's losses through a closure held as an attribute (not a hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.record = _recorder()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.record(float(loss))
        return loss


def test_a_closure_held_as_an_attribute_is_read():
    with pytest.raises(PrivacyConfigurationError, match="attribute record"):
        fit(KeepsThroughAClosureAttribute(), steps=3)


def test_library_functions_held_as_attributes_are_not_walked():
    m = Classifier()
    m.loss_fn = torch.nn.functional.cross_entropy
    m.act = functools.partial(torch.clamp, min=-1.0)
    fit(m, steps=2)
