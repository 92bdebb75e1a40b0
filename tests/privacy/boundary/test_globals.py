"""Kept state in module-level globals (validators/kept_state.py, user_modules): a global of the user's code written
from the batch — a list appended, a counter rebound, a tensor updated in place — is refused before any release (or
before the next one, for a write that starts later), unless declared public; globals of other modules are not read."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cases import Classifier, fit, parameters, unchanged
from pytorch_lightning.callbacks import Callback

from lightning_dp import PrivacyConfigurationError
from lightning_dp.validators.kept_state import user_modules

MEMORY: list[torch.Tensor] = []
POSITIVES = 0
RUNNING = torch.zeros(4)


class AppendsToGlobal(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        MEMORY.append(batch[0].detach())
        return super().training_step(batch, batch_idx)


class CountsInGlobal(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        global POSITIVES
        POSITIVES += int((batch[1] == 1).sum())
        return super().training_step(batch, batch_idx)


class UpdatesGlobalTensor(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        RUNNING.mul_(0.9).add_(batch[0].mean(0), alpha=0.1)
        return super().training_step(batch, batch_idx)


class CallbackKeepsGlobal(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        MEMORY.append(outputs["loss"].detach())


@pytest.fixture(autouse=True)
def _reset():
    global POSITIVES
    MEMORY.clear()
    POSITIVES = 0
    RUNNING.zero_()
    yield


@pytest.mark.parametrize("model, name", [(AppendsToGlobal, "MEMORY"), (CountsInGlobal, "POSITIVES"),
                                         (UpdatesGlobalTensor, "RUNNING")])
def test_a_global_written_from_the_batch_is_refused_before_any_release(model, name):
    m = model()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=f"global {__name__}.{name}"):
        fit(m, steps=3)
    assert unchanged(before, m)


def test_a_callback_handed_the_batch_writing_a_global_is_refused():
    with pytest.raises(PrivacyConfigurationError, match=f"global {__name__}.MEMORY"):
        fit(Classifier(), steps=3, callbacks=[CallbackKeepsGlobal()])


def test_a_public_global_is_allowed():
    fit(CountsInGlobal(), steps=3, public_state=["POSITIVES"])
    assert POSITIVES > 0


def test_only_the_users_modules_are_read():
    modules = {m.__name__ for m in user_modules([AppendsToGlobal, CallbackKeepsGlobal])}
    assert __name__ in modules and "cases" in modules
    assert not any(name.split(".")[0] in ("torch", "pytorch_lightning", "lightning_dp", "builtins")
                   for name in modules)
