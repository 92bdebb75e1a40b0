"""Data stashed on the loop's own objects (validators/kept_state.py, library_objects): an attribute a step adds to
the trainer, its strategy, an optimizer or the training loader — the batch kept as next step's negatives — is kept
state, refused before any release unless declared public."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cases import Classifier, fit, parameters, unchanged
from conftest import at_freed_address

from lightning_dp import PrivacyConfigurationError


class StashesOnTrainer(Classifier):
    """Keeps the batch on the trainer and uses the last one as extra (un-clipped) negatives."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        previous = getattr(self.trainer, "memory", None)
        if previous is not None:
            loss = loss + 0.0 * self(previous).sum()
        self.trainer.memory = batch[0].detach()
        return loss


class StashesOnOptimizer(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.optimizers().optimizer.seen = int((batch[1] == 1).sum())
        return super().training_step(batch, batch_idx)


class StashesOnWrapper(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.optimizers().seen = int((batch[1] == 1).sum())
        return super().training_step(batch, batch_idx)


class StashesOnLoader(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trainer.train_dataloader.last_labels = batch[1].tolist()
        return super().training_step(batch, batch_idx)


def _stashes_on(path: str) -> type:
    """A model keeping the last loss at batch end on ``self.trainer.<path>`` and scaling the next loss by it."""

    def owner(module: Classifier) -> Any:
        obj = module.trainer
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    class StashesOnLoopPart(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch, batch_idx) * getattr(owner(self), "memory", 1.0)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            owner(self).memory = float(outputs["loss"])

    return StashesOnLoopPart


@pytest.mark.parametrize("path", ["fit_loop", "fit_loop.epoch_loop", "precision_plugin", "accelerator", "profiler"])
def test_data_stashed_on_the_loops_other_parts_is_refused_before_any_release(path):
    m = _stashes_on(path)()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=rf"attribute trainer\.{path.replace('.', '[.]')}\.memory"):
        fit(m, steps=3)
    assert unchanged(before, m)


@pytest.mark.parametrize("model, entry", [(StashesOnTrainer, "trainer.memory"),
                                          (StashesOnOptimizer, r"trainer.optimizers\[0\].seen"),
                                          (StashesOnWrapper, r"self.optimizers\(\)\[0\].seen"),
                                          (StashesOnLoader, "trainer.train_dataloader.last_labels")])
def test_data_stashed_on_the_loop_is_refused_before_any_release(model, entry):
    m = model()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=entry):
        fit(m, steps=3)
    assert unchanged(before, m)


def test_a_public_stash_is_allowed():
    fit(StashesOnOptimizer(), steps=3, public_state=["trainer.optimizers[0].seen"])


def test_a_loop_object_taking_a_freed_ones_id_is_judged_by_its_own_fields():
    """A second fit's optimizer can take the id of an object freed since the first (CI saw it: the new optimizer's
    own ``param_groups`` refused as added state): the first fields are remembered per object, not per id."""
    from lightning_dp.validators.kept_state import StateFingerprint

    class LoopObject:
        pass

    first = LoopObject()
    first.settings = 1
    current = [first]
    fingerprint = StateFingerprint(torch.nn.Linear(2, 2))
    fingerprint.library_objects = lambda: [("trainer.optimizers[0]", current[0])]
    baseline = fingerprint.take()
    freed = id(first)
    del first, current[0]
    second, reused = at_freed_address(freed, LoopObject)
    if not reused:
        pytest.skip("this interpreter did not reuse the freed object's id")
    second.param_groups = [{"lr": 0.1}]  # set at construction: the object's own
    current.append(second)
    assert StateFingerprint.changed(baseline, fingerprint.take()) == []
    second.memory = [1.0]  # added after its first fingerprint: kept state
    assert StateFingerprint.changed(baseline, fingerprint.take()) == ["attribute trainer.optimizers[0].memory"]


def test_a_callback_taking_a_freed_readers_id_is_not_taken_for_a_reader():
    """The callbacks that read a logged value (their state kept state from then on) are remembered per callback, not
    per id: a trusted callback of the next fit at a freed reader's address is not fingerprinted as one."""
    import pytorch_lightning as pl

    from lightning_dp.validators.kept_state import StateFingerprint

    class Reader(pl.Callback):  # overrides no hook handed the batch: trusted unless it reads a logged value
        def __init__(self):
            self.best = 0.5

    fingerprint = StateFingerprint(torch.nn.Linear(2, 2))

    def watched_and_freed() -> int:
        first = Reader()
        fingerprint.watch(first, fingerprint.take([first]), [first])
        assert any("Reader" in key for key in fingerprint.take([first]))
        return id(first)  # freed on return

    second, _ = at_freed_address(watched_and_freed, Reader, tries=30, count=100)
    assert not any("Reader" in key for key in fingerprint.take([second]))
