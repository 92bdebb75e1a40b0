"""No raw gradient observable (privacy/boundary/hooks.py and the release inside Lightning's backward): every
Lightning hook and callback that reads ``p.grad`` reads the released gradient; hooks on parameters, which autograd
calls with the raw batch gradient, are refused before any release."""

from __future__ import annotations

import pytest
import torch
from cases import Classifier, fit, parameters, unchanged
from pytorch_lightning.callbacks import Callback

from lightning_dp import PrivacyConfigurationError

ENGINES = ["ghost", "vmap", "opacus_hooks"]


class GradientReader(Callback):
    """Keeps what on_after_backward and on_before_optimizer_step see in p.grad, and the update SGD(lr=1) made."""

    def __init__(self) -> None:
        self.after_backward: list[list[torch.Tensor]] = []
        self.before_step: list[list[torch.Tensor]] = []
        self.updates: list[list[torch.Tensor]] = []

    @staticmethod
    def _grads(module):
        return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_after_backward(self, trainer, pl_module):
        self.after_backward.append(self._grads(pl_module))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before_step.append(self._grads(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.updates.append([b - p.detach() for b, p in zip(self._before, pl_module.parameters())])


class ModuleGradientReader(Classifier):
    """The LightningModule's own on_after_backward (an EWC Fisher accumulates p.grad² there)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[torch.Tensor]] = []

    def on_after_backward(self):
        self.seen.append([p.grad.detach().clone() for p in self.parameters()])


@pytest.mark.parametrize("engine", ENGINES)
def test_hooks_after_backward_read_the_released_gradient(engine):
    """SGD(lr=1) moves θ by −ĝ: what the hooks saw must be exactly that (the raw batch gradient, or None, fails)."""
    reader = GradientReader()
    model = ModuleGradientReader()
    fit(model, steps=3, callbacks=[reader], per_sample=engine, public_state=["GradientReader", "seen"])
    assert len(reader.updates) == 3
    for seen, own, before_step, update in zip(reader.after_backward, model.seen, reader.before_step, reader.updates):
        for g, g_own, g_step, u in zip(seen, own, before_step, update):
            assert g is not None
            torch.testing.assert_close(g, u, rtol=1e-5, atol=1e-7)
            assert torch.equal(g, g_own) and torch.equal(g, g_step)


class TensorHooked(Classifier):
    """Gradient statistics by a tensor hook on a parameter (a gradient-norm logger)."""

    def __init__(self, post_accumulate: bool = False) -> None:
        super().__init__()
        self.norms: list[float] = []
        first = self.net[0].weight
        if post_accumulate:
            first.register_post_accumulate_grad_hook(lambda p: self.norms.append(float(p.grad.norm())))
        else:
            first.register_hook(lambda g: self.norms.append(float(g.norm())))


class HookedLater(Classifier):
    """The tensor hook is registered in on_train_start (after the engine attached)."""

    def on_train_start(self):
        self.net[2].bias.register_hook(lambda g: None)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("factory", [TensorHooked, lambda: TensorHooked(post_accumulate=True), HookedLater])
def test_gradient_hooks_on_parameters_are_refused_before_any_release(factory, engine):
    model = factory()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)gradient hook.*raw batch gradient.*on_after_backward"):
        fit(model, per_sample=engine)
    assert unchanged(before, model)
