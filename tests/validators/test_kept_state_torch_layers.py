"""Kept state on torch's own layers (fingerprints/module_tree.py ``_layer_setting``): a torch layer's attributes are
read as data only — its sizes, flags and names are configuration — but what a hook or the user's forward writes on it
is state like any attribute of the user's modules: a tuple of the batch's tensors (torch hands every forward hook its
inputs as a tuple), a ``torch.Size`` (a padded batch's length is its longest record's), a number under a private
name, a callable whose closure holds the batch, and ``example_input_array`` set from the batch. Each is refused
before any release; the same write declared public trains, and a torch layer's own configuration is not state."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit, parameters, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


def _hook_inputs(model: Classifier, batch: Any) -> None:
    """The hook itself is registered at construction (:func:`_writer`)."""


def _pair(model: Classifier, batch: Any) -> None:
    model.net[0].io = (batch[0].detach(), batch[1])


def _shape(model: Classifier, batch: Any) -> None:
    model.net[0].seen_shape = batch[0].shape


def _private_count(model: Classifier, batch: Any) -> None:
    model.net[0]._positives = getattr(model.net[0], "_positives", 0) + int((batch[1] == 1).sum())


def _closure(model: Classifier, batch: Any) -> None:
    mean = batch[0].mean(0).detach()
    model.net[0].denorm = lambda t: t + mean


def _example_input(model: Classifier, batch: Any) -> None:
    model.example_input_array = batch[0][:1]


def _density(model: Classifier, batch: Any) -> None:
    x = batch[0].detach()
    model.net[0].input_dist = torch.distributions.Normal(x.mean(0), x.std(0, correction=0) + 1e-6)  # an OOD density


def _prior(model: Classifier, batch: Any) -> None:
    model.prior = torch.distributions.Categorical(probs=torch.bincount(batch[1], minlength=2).float() + 1.0)


def _dtype(model: Classifier, batch: Any) -> None:
    model.net[0].compute_dtype = torch.float64 if float(batch[0].abs().max()) > 2.0 else torch.float32


WRITES: dict[str, tuple[Callable[[Classifier, Any], None], str]] = {
    "a Normal fitted to the batch on a layer": (_density, "net.0.input_dist"),
    "a Categorical of the batch's labels on the module": (_prior, "prior"),
    "a dtype chosen from the batch": (_dtype, "net.0.compute_dtype"),
    "a forward hook keeping its inputs tuple": (_hook_inputs, "net.0.features_in"),
    "a tuple of the batch's tensors": (_pair, "net.0.io"),
    "the batch's torch.Size": (_shape, "net.0.seen_shape"),
    "a count under a private name": (_private_count, "net.0._positives"),
    "a lambda closing over the batch's mean": (_closure, "net.0.denorm"),
    "example_input_array from the batch": (_example_input, "_example_input_array"),
}


def _writer(write: Callable[[Classifier, Any], None]) -> Classifier:
    class Writes(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            write(self, batch)
            return super().training_step(batch, batch_idx)

    model = Writes()
    if write is _hook_inputs:
        model.net[0].register_forward_hook(lambda m, inputs, output: setattr(m, "features_in", inputs))
    return model


@pytest.mark.parametrize("case", list(WRITES))
def test_state_written_on_a_torch_layer_is_refused_before_any_release(case):
    write, entry = WRITES[case]
    model = _writer(write)
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=entry.replace(".", r"\.")):
        fit(model, steps=3)
    assert unchanged(before, model)


@pytest.mark.parametrize("case", ["a tuple of the batch's tensors", "a count under a private name"])
def test_the_same_write_declared_public_trains(case):
    write, entry = WRITES[case]
    fit(_writer(write), steps=3, public_state=[entry])


class Configured(Classifier):
    """A torch layer's own settings, tuples and private flags included, set once before training."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.Unflatten(1, torch.Size([4, 1]))  # a torch.Size it holds from __init__
        self.net[0]._note = 3  # a private number never written again
        self.example_input_array = torch.zeros(1, 4)  # public, from __init__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.pool(x).flatten(1))


class PublicPrior(Classifier):
    """A prior from constants; its lazily computed logits first read inside training_step (cached then)."""

    def __init__(self) -> None:
        super().__init__()
        self.prior = torch.distributions.Categorical(probs=torch.tensor([0.3, 0.7]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)[:, :2] + self.prior.logits  # logit adjustment by a public prior
        return torch.nn.functional.cross_entropy(logits, y)


def test_a_public_distribution_read_in_the_step_trains():
    model = PublicPrior()
    before = parameters(model)
    fit(model, steps=3)
    assert not unchanged(before, model)


def test_a_torch_layers_settings_fixed_before_the_fit_train():
    model = Configured()
    before = parameters(model)
    fit(model, steps=3)
    assert not unchanged(before, model)


def test_a_write_to_the_weights_names_the_release_and_resuming_not_only_public_state():
    """zoo22 g1: a plain loop's rollback of the weights between releases was told to declare them public."""
    from lightning_dp.validators.kept_state import state_written_error

    weights = str(state_written_error(["contents of parameter 0.weight", "parameter 0.bias"], "between releases"))
    assert "only through the release" in weights and "resuming from its checkpoint" in weights
    assert "adapter merged into frozen weights" in weights
    other = str(state_written_error(["attribute net.0.io", "contents of parameter 0.weight"], "in training_step"))
    assert "Fix: declare it public" in other and "only through the release" not in other


def test_a_tensor_and_its_contents_are_named_once():
    """zoo31 a02: "contents of buffer gout, buffer gout … public_state=['gout', 'gout']"."""
    from lightning_dp.validators.kept_state import state_written_error

    text = str(state_written_error(["contents of buffer gout", "buffer gout", "attribute t"], "in training_step"))
    first = text.splitlines()[0]
    assert first.startswith("Kept state written outside the release: buffer gout, attribute t. ")
    assert "public_state=['gout', 't']" in first
