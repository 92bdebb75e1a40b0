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


def test_post_processing_declared_public_or_judged_trains():
    """Declared public, or undeclared: run again from ĝ_t on other data (validators/judged_writes.py), the
    centralised gradient is the same, a function of ĝ_t alone."""
    dp = fit(CentresReleasedGradient(), steps=3, public_state=["p.grad"])
    assert dp.ledger.steps == 3
    # a fresh model on the same records: the data ledger continues the first fit's releases (3 + 3)
    assert fit(CentresReleasedGradient(), steps=3).ledger.steps == 6


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


class SpareHeadOutsideTheOptimizer(Classifier):
    """A trainable head for prediction only: no training step uses it and no optimizer group holds it, so no
    ``zero_grad`` clears the ĝ the release writes into its ``.grad``. From ``read_from`` on, a step also reads it in a
    way the engine does not capture (a matmul with the batch on the right)."""

    def __init__(self, read_from: int = -1) -> None:
        super().__init__()
        self.aux, self.read_from = nn.Linear(4, 2), read_from

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if 0 <= self.read_from <= self.global_step:
            loss = loss + 0.01 * (self.aux.weight @ x.t()).square().mean()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=1.0)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_parameter_no_step_uses_and_no_optimizer_holds_trains(engine):
    """The previous release left in its ``.grad`` is the library's own output, not a gradient from a use the engine
    misses (it was refused at the second step)."""
    model = SpareHeadOutsideTheOptimizer()
    dp = fit(model, steps=3, per_sample=engine)
    assert dp.ledger.steps == 3
    assert model.aux.weight.grad is not None and model.aux.weight.grad.any(), "ĝ (noise only) is still written"


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_an_uncaptured_use_after_a_release_is_still_refused(engine):
    """Unused at the first step, then read outside any captured use: autograd adds its gradient to the release
    left in ``.grad``, which is then no longer the release as written."""
    with pytest.raises(PrivacyConfigurationError, match="aux.weight .*received a gradient, but from no use"):
        fit(SpareHeadOutsideTheOptimizer(read_from=1), steps=3, per_sample=engine)


class ReplacesReleasedGradient(Classifier):
    """Puts a gradient of its own in place of ĝ_t, a new tensor at the released one's address with its version (the
    released tensor is freed first: CPython hands its memory to the next tensor made)."""

    def on_before_optimizer_step(self, optimizer) -> None:
        p = self.net[2].bias
        version, freed = p.grad._version, id(p.grad)
        p.grad = None
        stat = TRAINING.tensors[0][:, :2].mean(0)
        made = [torch.empty(2) for _ in range(200)]
        grad = next((t for t in made if id(t) == freed), made[0])
        with torch.no_grad():
            grad.copy_(stat)
            while grad._version < version:
                grad.add_(0.0)
        p.grad = grad


def test_a_gradient_put_at_the_released_ones_address_is_refused():
    """The release holds ĝ_t: a new tensor never takes its id, whatever its version."""
    with pytest.raises(PrivacyConfigurationError, match=r"ĝ_t was changed .*\.grad of net\.2\.bias"):
        fit(ReplacesReleasedGradient(), steps=1)
