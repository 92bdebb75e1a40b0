"""The module tree as the kept-state fingerprint reads it (validators/kept_state.py): a submodule replaced in its
container (``model[2] = nn.Linear(...)``) or added is seen at the next step, as a parameter frozen or unfrozen is, so
the engine is re-attached and the probe runs again; not left to the engine, which refused the new layer as "a module
outside the attached one"."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit, plain_step  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.kept_state import StateFingerprint  # noqa: E402


def _ids(fingerprint: StateFingerprint) -> dict[str, int]:
    return {name: id(p) for name, p in fingerprint.trainable()}


def test_a_replaced_or_added_submodule_is_read_at_the_next_call():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fingerprint = StateFingerprint(model)
    fingerprint.take()
    model[2] = nn.Linear(8, 2)  # same names, same counts: only the identities tell
    assert _ids(fingerprint) == {name: id(p) for name, p in model.named_parameters()}
    assert "parameter 2.weight" in fingerprint.take()
    model.add_module("extra", nn.Linear(2, 2))
    assert "extra.weight" in _ids(fingerprint)
    del model.extra
    assert "extra.weight" not in _ids(fingerprint)


def _one_step(step, opt, batches, model) -> None:
    x, y = next(batches)
    opt.zero_grad(set_to_none=True)
    step.begin()
    nn.functional.cross_entropy(model(x), y).backward()
    step.release(optimizer=opt)
    opt.step()


def test_a_replaced_layer_in_a_plain_loop_is_refused_until_verified_and_not_stepped():
    model = Classifier().net
    step, opt, batches = plain_step(model)
    try:
        _one_step(step, opt, batches, model)
        released = step.ledger.steps
        model[2] = nn.Linear(8, 2)  # its parameters in the optimizer: hooked by no engine until re-attached
        opt.param_groups[0]["params"] = list(model.parameters())
        head = model[2].weight.detach().clone()
        with pytest.raises(PrivacyConfigurationError, match=r"parameters changed since verify\(\)"):
            _one_step(step, opt, batches, model)
        assert step.ledger.steps == released
        assert torch.equal(head, model[2].weight.detach()), "the new layer was not stepped"
        assert not step.verified
    finally:
        step.detach()


def test_a_plain_loop_refused_for_a_changed_parameter_set_goes_on_once_verified_again():
    """A layer frozen after verify(): the step is refused; the refused step's batch goes with it: verified again, the next step takes its own batch (it took the
    refused one's, and every later step was refused as layers called without the step's examples)."""
    model = Classifier().net
    step, opt, batches = plain_step(model)
    try:
        _one_step(step, opt, batches, model)
        model[0].weight.requires_grad_(False)
        with pytest.raises(PrivacyConfigurationError, match=r"parameters changed since verify\(\)"):
            _one_step(step, opt, batches, model)
        step.verify(lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))
        for _ in range(3):
            _one_step(step, opt, batches, model)
        assert step.ledger.steps == 4
    finally:
        step.detach()


class ReplaceHead(pl.Callback):
    """At epoch 1 the last layer is replaced by a fresh one, which the optimizer then steps (a new head)."""

    head = None

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1 and self.head is None:
            pl_module.net[2] = nn.Linear(8, 2)
            trainer.optimizers[0].param_groups[0]["params"] = list(pl_module.parameters())
            self.head = pl_module.net[2].weight.detach().clone()


def test_a_layer_replaced_by_a_callback_is_reattached_reverified_and_privatised():
    model, callback = Classifier(), ReplaceHead()
    dp = fit(model, steps=8, n=64, callbacks=[callback])
    assert dp.ledger.steps == 8
    assert dp.private_step.verified
    assert not torch.equal(callback.head, model.net[2].weight.detach())
    assert {id(p) for _, p in dp.private_step.boundary.trainable()} == {id(p) for p in model.parameters()}


def _verify(step, model) -> None:
    step.verify(lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))


def test_a_replaced_layer_verified_again_trains_as_the_refusal_says():
    """The refusal at begin() says: verify again. That verify() takes the new layer's entries as they are (a new
    object, not a write of the step's): the next release is made, its head stepped."""
    model = Classifier().net
    step, opt, batches = plain_step(model)
    try:
        _one_step(step, opt, batches, model)
        model[2] = nn.Linear(8, 2)
        opt.param_groups[0]["params"] = list(model.parameters())
        with pytest.raises(PrivacyConfigurationError, match=r"parameters changed since verify\(\)"):
            _one_step(step, opt, batches, model)
        _verify(step, model)
        head = model[2].weight.detach().clone()
        for _ in range(2):
            _one_step(step, opt, batches, model)
        assert step.ledger.steps == 3
        assert not torch.equal(head, model[2].weight.detach()), "the new head is trained"
    finally:
        step.detach()


class Counting(nn.Module):
    """A layer whose forward keeps a statistic of its batch in a buffer (a running mean the noise does not cover)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(8))
        self.write = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.write:
            self.seen.add_(x.detach().mean(0))
        return x


def test_verify_takes_only_the_new_layer_not_a_buffer_the_step_wrote_from_its_batch():
    """No general re-baseline: a buffer a step wrote from the data is refused before the release, and still refused
    after a verify() that took a replaced layer's entries."""
    model = nn.Sequential(nn.Linear(4, 8), Counting(), nn.Tanh(), nn.Linear(8, 2))
    step, opt, batches = plain_step(model)
    try:
        _one_step(step, opt, batches, model)
        model[1].write = True
        with pytest.raises(PrivacyConfigurationError, match=r"buffer 1\.seen"):
            _one_step(step, opt, batches, model)
        model[3] = nn.Linear(8, 2)
        opt.param_groups[0]["params"] = list(model.parameters())
        model[1].write = False
        _verify(step, model)
        with pytest.raises(PrivacyConfigurationError, match=r"Kept state written") as refused:
            _one_step(step, opt, batches, model)
        named = str(refused.value).partition("\n")[0].partition(". Fix")[0]
        assert "buffer 1.seen" in named and "3." not in named, named
        assert step.ledger.steps == 1
    finally:
        step.detach()


def test_the_trainable_list_kept_between_calls_still_sees_every_change():
    """``trainable()`` gives its last list again when every parameter slot holds the same object with the same
    ``requires_grad`` (read in C loops): a parameter replaced in its slot, one at a freed one's address, one frozen or
    unfrozen, one set to ``None`` and a tied one are each listed as ``named_parameters`` lists them, and
    ``ReleaseBoundary.parameters_changed`` (which compares by identity and name) sees each."""
    from lightning_dp.privacy.boundary import ReleaseBoundary

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    fingerprint = StateFingerprint(model)
    boundary = ReleaseBoundary()
    boundary.attach(model, None, {}, set())

    def rebind_freed() -> None:
        freed = id(model[0].weight)
        model[0].weight = None
        made = [nn.Parameter(torch.zeros(4, 4)) for _ in range(200)]  # CPython hands a freed object's memory on
        model[0].weight = next((p for p in made if id(p) == freed), made[0])

    def expected() -> list[tuple[str, int]]:
        return [(name, id(p)) for name, p in model.named_parameters() if p.requires_grad]

    changes = {"replaced": lambda: setattr(model[2], "bias", nn.Parameter(torch.zeros(4))),
               "freed": rebind_freed, "frozen": lambda: model[0].bias.requires_grad_(False),
               "unfrozen": lambda: model[0].bias.requires_grad_(True),
               "none": lambda: setattr(model[2], "bias", None),
               "tied": lambda: setattr(model[2], "weight", model[0].weight)}
    for name, change in changes.items():
        fingerprint.trainable(), fingerprint.trainable()  # the second from the kept list
        boundary.attach(model, None, {}, set())
        assert not boundary.parameters_changed(), name
        change()
        assert [(n, id(p)) for n, p in fingerprint.trainable()] == expected(), name
        assert boundary.parameters_changed(), name
