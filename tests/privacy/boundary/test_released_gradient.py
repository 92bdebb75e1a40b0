"""Rule 2 after the release (privacy/boundary/__init__.py, check_gradients): the optimizer steps with ĝ_t as
released. A hook that rewrites p.grad between the release and the update with data it reads itself is refused
before the update is made; declaring "p.grad" public allows post-processing of ĝ_t."""

from __future__ import annotations

import pytest
import torch
from cases import Classifier, data, fit, parameters, plain_step
from torch import nn

from lightning_dp import PrivacyConfigurationError

TRAINING = data(64)  # the training set, also reachable as a global


class AddsRawGradient(Classifier):
    """Adds an un-noised statistic of the training data to the released gradient before the update."""

    def on_before_optimizer_step(self, optimizer) -> None:
        with torch.no_grad():
            self.net[2].bias.grad += TRAINING.tensors[0][:, :2].mean(0)


class CentresReleasedGradient(Classifier):
    """Post-processes ĝ_t only (gradient centralisation of the first layer)."""

    def on_before_optimizer_step(self, optimizer) -> None:
        g = self.net[0].weight.grad
        g -= g.mean(1, keepdim=True)


def test_a_gradient_rewritten_after_the_release_is_refused_before_the_update():
    model = AddsRawGradient()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"ĝ_t was changed .*\.grad of net\.2\.bias"):
        fit(model, steps=3)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), "the update was not made"


def test_post_processing_declared_public_trains():
    dp = fit(CentresReleasedGradient(), steps=3, public_state=["p.grad"])
    assert dp.ledger.steps == 3
    with pytest.raises(PrivacyConfigurationError, match=r"\.grad of net\.0\.weight"):
        fit(CentresReleasedGradient(), steps=3)


def test_a_plain_loop_is_checked_at_the_optimizer_step():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    step, opt, batches = plain_step(model)
    try:
        for attempt in range(2):
            opt.zero_grad()
            x, y = next(batches)
            step.begin()
            nn.functional.cross_entropy(model(x), y).backward()
            step.release(optimizer=opt)
            if attempt == 0:
                opt.step()  # ĝ_t as released
            else:
                model.bias.grad = model.bias.grad + y.float().mean()
                weight = model.weight.detach().clone()
                with pytest.raises(PrivacyConfigurationError, match=r"\.grad of bias"):
                    opt.step()
                assert torch.equal(weight, model.weight), "the update was not made"
    finally:
        step.detach()
