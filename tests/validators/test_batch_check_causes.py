"""The batch check names the cause the step's own calls show (validators/batch_check.py, ``_likely_cause``): a
class-weighted mean loss whose interaction the first probe's examples (all of one label) could not show is refused
at the sampled batch with the fix, not as an engine's bug (qa39 c10: public constant class weights, sorted data)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[1] / "privacy" / "boundary"))
from cases import Classifier, parameters, unchanged  # noqa: E402

from lightning_dp import DPStrategy, PrivacyConfigurationError  # noqa: E402


class ConstantClassWeights(Classifier):
    """Cross-entropy with public constant class weights and torch's default reduction='mean' (÷ Σ w[y_j])."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.register_buffer("class_weights", torch.tensor([2.0, 1.0]))
        self.reduction = reduction

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y, weight=self.class_weights, reduction=self.reduction)
        return loss if self.reduction == "mean" else loss.mean()


def sorted_classes(n: int = 128) -> TensorDataset:
    """Two classes, sorted by label: the probe's first examples all share one, so only a sampled batch mixes them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    order = torch.argsort(y, stable=True)
    return TensorDataset(x[order], y[order])


def fit(model: Classifier) -> None:
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    quiet_trainer(strategy=strategy, max_steps=2).fit(model, DataLoader(sorted_classes(), batch_size=32))


def test_a_class_weighted_mean_the_probe_missed_is_refused_at_the_batch_with_its_fix():
    model = ConstantClassWeights()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 0.*sampled batch.*Nothing was "
                       r"released for this step\. The step calls a class-weighted loss with reduction='mean'.*"
                       r"reduction='none'.*Other typical causes") as err:
        fit(model)
    assert "please report it" not in str(err.value)  # a named cause is not an engine's bug
    assert unchanged(before, model), "a release happened"
    checked, changed = re.search(r"checked on (\d+) examples.*?, (\d+) example gradient\(s\) changed",
                                 str(err.value)).groups()
    assert 0 < int(changed) <= int(checked)  # an example compared in a half and alone is counted once


def test_the_class_weighted_loss_averaged_per_example_trains():
    fit(ConstantClassWeights(reduction="none"))


def test_an_interaction_without_a_named_cause_keeps_the_generic_message():
    """Weights from the batch's own label counts, no weight= call: refused as before, no class-weight hint."""

    class CountWeighted(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            counts = torch.bincount(y, minlength=2).clamp_min(1).to(x.dtype)
            per_example = F.cross_entropy(self(x), y, reduction="none")
            return (per_example * (len(y) / (2 * counts))[y]).mean()

    with pytest.raises(PrivacyConfigurationError, match=r"Examples interact at step 0") as err:
        fit(CountWeighted())
    assert "class-weighted loss with reduction='mean'" not in str(err.value)
    assert "Typical causes the first step cannot show" in str(err.value)
