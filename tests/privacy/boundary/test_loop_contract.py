"""The contract checked where it can change, every step: accumulation (a GradientAccumulationScheduler raises it at an
epoch's start), the parameter set and its names (ModelPruning renames weight to weight_orig; a finetuning callback
unfreezes layers), never only at setup."""

from __future__ import annotations

import pytest
import torch
from cases import Classifier, fit
from pytorch_lightning.callbacks import BaseFinetuning, GradientAccumulationScheduler, ModelPruning

from lightning_dp import PrivacyConfigurationError


def test_accumulation_switched_on_mid_run_is_refused_before_that_epochs_first_release():
    model = Classifier()
    with pytest.raises(PrivacyConfigurationError, match=r"accumulate_grad_batches=2"):
        fit(model, steps=12, n=64, callbacks=[GradientAccumulationScheduler({1: 2})])
    assert model.trainer.strategy.ledger.steps == 4, "epoch 0 (4 steps) released, nothing of epoch 1"


def test_pruning_mid_run_is_reattached_reverified_and_trains_on():
    """ModelPruning renames weight to weight_orig at epoch 0's end (post-processing of the released weights,
    validators/model_pruning.py): the engine is re-attached, the probe runs again, and the later epochs release."""
    model = Classifier()
    dp = fit(model, steps=12, n=64, callbacks=[ModelPruning("l1_unstructured", amount=0.5, verbose=0)])
    assert dp.ledger.steps == 12
    assert dp.private_step.verified


class UnfreezeHead(BaseFinetuning):
    """The first layer frozen in epoch 0, unfrozen (and added to the optimizer) at epoch 1."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer, lr=1.0)


def test_unfrozen_layers_are_reattached_reverified_and_privatised():
    """After the unfreeze the engine is re-attached and the probe runs again; the first layer's updates are then
    releases of the mechanism (noised: σ = 1 makes them nonzero even where the gradient vanishes)."""
    model = Classifier()
    first = model.net[0].weight.detach().clone()
    dp = fit(model, steps=8, n=64, callbacks=[UnfreezeHead()])
    assert dp.ledger.steps == 8
    assert not torch.equal(model.net[0].weight.detach(), first)
    assert dp.private_step.verified
