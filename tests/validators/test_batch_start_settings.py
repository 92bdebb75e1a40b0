"""σ, C or a learning rate set from the batch in ``on_train_batch_start`` at a later step is refused before that
step's release (validators/batch_start_settings.py): the step's baselines are taken after the batch-start hooks, and
the first step's replays never meet a write gated on ``global_step == 3``. A warm-up or a C schedule by step there,
and a hook that sets nothing, train."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

LATER = 3


def write(module, kind: str, value: float) -> None:
    step = module.trainer.strategy.private_step
    if kind == "C":
        step.max_grad_norm = value
    elif kind == "sigma":
        step.noise_multiplier = 1.0 + value
    else:
        module.optimizers().param_groups[0]["lr"] = value


class FromTheBatch(Classifier):
    """Sets ``kind`` from the batch's mean magnitude at one later step only."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == LATER:
            write(self, self.kind, float(batch[0].abs().mean()) + 0.1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="none").mean()


@pytest.mark.parametrize("verify", ["sampled", "every_step"])
@pytest.mark.parametrize("kind", ["C", "sigma", "lr"])
def test_a_setting_from_the_batch_at_a_later_step_is_refused_before_that_release(kind, verify):
    model = FromTheBatch(kind)
    with pytest.raises(PrivacyConfigurationError, match="in on_train_batch_start, from the batch"):
        fit(model, steps=6, n=256, verify=verify)
    assert model.trainer.strategy.private_step.ledger.steps == LATER  # steps 0-2 released, not step 3


class WarmUp(Classifier):
    def on_train_batch_start(self, batch, batch_idx):
        self.optimizers().param_groups[0]["lr"] = 0.1 * min(1.0, (self.trainer.global_step + 1) / 4)


class ClipSchedule(Classifier):
    def on_train_batch_start(self, batch, batch_idx):
        self.trainer.strategy.private_step.max_grad_norm = 1.0 + 0.5 * self.trainer.global_step


class ReadsOnly(Classifier):
    def on_train_batch_start(self, batch, batch_idx):
        if not batch[0].isfinite().all():  # reads the batch, writes nothing
            raise ValueError("non-finite inputs")


@pytest.mark.parametrize("verify", ["sampled", "every_step"])
def test_settings_by_step_count_and_a_hook_that_sets_nothing_train(verify):
    warm = WarmUp()
    assert fit(warm, steps=6, n=256, verify=verify).ledger.steps == 6
    assert warm.optimizers().param_groups[0]["lr"] == pytest.approx(0.1)  # as the real hook left it, not put back
    clip = ClipSchedule()
    dp = fit(clip, steps=6, n=256, seed=1, verify=verify)  # each fit on records of its own
    assert dp.ledger.steps == 6 and dp.private_step.max_grad_norm == pytest.approx(3.5)
    assert fit(ReadsOnly(), steps=6, n=256, seed=2, verify=verify).ledger.steps == 6
