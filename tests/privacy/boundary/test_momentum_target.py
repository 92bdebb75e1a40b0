"""A momentum target (BYOL, MoCo, DINO, lightly): a frozen ``copy.deepcopy`` of the online network — its parameters
do not require grad — updated at the start of ``training_step`` from the online network's parameters only. It is a
function of the released weights (post-processing), like the batch-end EMA: its write before the release is judged
like a buffer's by the first step's replays and accepted when every run writes it alike; a frozen parameter set from
the batch (a prototype), the update with the batch mixed in, and a trainable parameter written outside the gradient
stay refused (hook_replays.BatchEndWrites, probe.frozen_parameters)."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import Classifier, fit, parameters, unchanged

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.privacy.boundary import StateWrittenError

F = torch.nn.functional


class Momentum(Classifier):
    """The online net distilled towards a frozen momentum target updated first thing in training_step."""

    online_only = False  # the optimizer on the online net only (else on self.parameters(), the target's too)

    def __init__(self) -> None:
        super().__init__()
        self.target = copy.deepcopy(self.net)
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.updates = 0

    @torch.no_grad()
    def momentum_update(self, batch, m: float = 0.9) -> None:
        for po, pt in zip(self.net.parameters(), self.target.parameters()):
            pt.mul_(m).add_(po, alpha=1 - m)

    def training_step(self, batch, batch_idx):
        self.momentum_update(batch)
        x, y = batch
        with torch.no_grad():
            t = F.softmax(self.target(x), 1)
        out = self(x)
        kl = F.kl_div(F.log_softmax(out, 1), t, reduction="none").sum(1).mean()
        return F.cross_entropy(out, y) + 0.5 * kl

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters() if self.online_only else self.parameters(), lr=1.0)


class OnlineOnly(Momentum):
    online_only = True


class DataMixedIn(Momentum):
    """The momentum update with the batch's features mixed in."""

    @torch.no_grad()
    def momentum_update(self, batch, m: float = 0.9) -> None:
        super().momentum_update(batch, m)
        self.target[0].bias.add_(1e-2 * batch[0].mean())


class Prototype(Momentum):
    """A frozen parameter (class prototypes) set from the batch's features in training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.proto = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)

    @torch.no_grad()
    def momentum_update(self, batch, m: float = 0.9) -> None:
        self.proto.mul_(m).add_((1 - m) * self.net(batch[0]).mean(0))


class TrainableWritten(Classifier):
    """A trainable parameter written outside the gradient in training_step (from the weights only)."""

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.net[0].weight.mul_(0.99)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("verify", ["sampled", "every_step"])
@pytest.mark.parametrize("factory", [Momentum, OnlineOnly])
def test_a_frozen_momentum_target_updated_in_training_step_from_the_weights_trains(factory, verify):
    model = factory()
    start = parameters(model.target)
    dp = fit(model, steps=6, verify=verify)
    assert dp.ledger.steps == 6
    assert not unchanged(start, model.target), "the target followed the released weights"


@pytest.mark.parametrize("factory,error,what", [
    (DataMixedIn, PrivacyConfigurationError, "parameter target.0.bias"),  # its passes set it apart
    (Prototype, StateWrittenError, "before its release.*set it apart.*parameter proto"),
])
def test_a_frozen_parameter_set_from_the_batch_before_the_release_is_refused(factory, error, what):
    model = factory()
    before = parameters(model)
    with pytest.raises(error, match=rf"(?s){what}"):
        fit(model)
    assert unchanged(before, model), "a release happened, or a check left its write"


def test_a_trainable_parameter_written_in_training_step_is_refused_naming_the_ways_out():
    model = TrainableWritten()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)parameter net.0.weight.*on_train_batch_end.*"
                                                        r"from the parameters only.*public_state=\['net.0.weight'\]"):
        fit(model)


def test_frozen_parameters_are_those_without_grad_and_gradient():
    from lightning_dp.validators.probe import frozen_parameters, parameter_entry

    model = Momentum()
    frozen = frozen_parameters(model)
    assert frozen == {f"target.{n}" for n, _ in model.target.named_parameters()}
    assert not parameter_entry("parameter target.0.weight", frozen)
    assert not parameter_entry("contents of parameter target.0.weight", frozen)
    assert parameter_entry("parameter net.0.weight", frozen)
    assert parameter_entry("contents of 12 parameters and buffers on cuda:0", frozen)
    model.target[0].weight.grad = torch.zeros_like(model.target[0].weight)  # a gradient set by hand: stepped
    assert "target.0.weight" not in frozen_parameters(model)
