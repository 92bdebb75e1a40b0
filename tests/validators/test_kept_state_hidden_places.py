"""Kept state hidden beside the state the fingerprint compares (validators/kept_state.py; red team zoo33 L01, L02,
L03, L07, L39): a batch statistic written at a batch's end where the next forward reads it back —

* the bytes of a buffer's or a parameter's storage beyond its view (``as_strided(..., offset)``, ``untyped_storage()``,
  a tensor ``set_`` onto a larger storage): ``fingerprints/checksums.beyond_views``;
* the ``.grad`` slot of a tensor that trains nothing (a buffer, a frozen parameter, a plain tensor attribute):
  ``fingerprints/state_walker.hung_gradient``;
* a user's function's default arguments (``__kwdefaults__``, ``__defaults__``, a method's, a partial's bound
  keywords): ``fingerprints/state_walker.function_defaults``;
* an attribute of a library class in the model's MRO (``pl.LightningModule``, ``nn.Module``):
  ``fingerprints/state_walker.library_class_attributes``

— is refused before any release, naming the place; the ordinary setups beside them train."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit, loader, parameters, strategy, unchanged  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.fingerprints.checksums import Checksums  # noqa: E402
from lightning_dp.validators.kept_state import StateFingerprint  # noqa: E402


def refused(model: pl.LightningModule, match: str, **kwargs: Any) -> None:
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=match):
        fit(model, steps=4, **kwargs)
    assert unchanged(before, model)


# ------------------------------------------------------------------ memory beyond a view (L01)
class StridedBuffer(Classifier):
    """zoo33 L01: a buffer that is a view of 16 floats; the batch mean kept in floats 8-11, outside the view."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.zeros(16)[:4])

    def hidden(self) -> torch.Tensor:
        return self.scale.as_strided((4,), (1,), 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - self.hidden())

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.hidden().copy_(batch[0].mean(0))


class StorageWrite(StridedBuffer):
    """The same bytes written through the untyped storage: no version counter of the buffer's moves."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        whole = torch.empty(0).set_(self.scale.untyped_storage())
        whole[8:12] = batch[0].mean(0)


class ParameterView(Classifier):
    """A trainable parameter that is a view of a larger tensor, its storage's tail holding the batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(12)[:4])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - self.shift - self.shift.detach().as_strided((4,), (1,), 8))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.shift.as_strided((4,), (1,), 8).copy_(batch[0].mean(0))


class SetOntoLarger(Classifier):
    """A plain buffer moved by ``set_`` onto a larger storage whose tail holds the batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale.untyped_storage().nbytes() == 32:
            x = x - self.scale.as_strided((4,), (1,), 4)  # the tail of the larger storage
        return self.net(x)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        larger = torch.cat([torch.zeros(4), batch[0].mean(0)])
        self.scale.set_(larger.untyped_storage(), 0, (4,), (1,))


@pytest.mark.parametrize("model, match", [
    (StridedBuffer, "storage of buffer scale beyond its view"),
    (StorageWrite, "storage of buffer scale beyond its view"),
    (ParameterView, "storage of parameter shift beyond its view"),
    (SetOntoLarger, "storage of buffer scale beyond its view"),
])
def test_a_statistic_kept_beyond_a_view_is_refused(model, match):
    refused(model(), match)


class ReadOnlyView(Classifier):
    """A buffer that is a view of a larger constant, never written: trains."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.arange(16.0)[:4] / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * (1 + self.scale))


class CountingBuffer(Classifier):
    """A plain buffer counting steps (written alike on any data): trains."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps += 1


@pytest.mark.parametrize("model", [ReadOnlyView, CountingBuffer])
def test_views_and_plain_buffers_train(model):
    m = model()
    fit(m, steps=4)
    assert not unchanged(parameters(Classifier()), m)


def test_views_covering_their_storage_together_hold_nothing_beyond():
    from lightning_dp.fingerprints.checksums import beyond_views

    whole = torch.zeros(8)
    named = [("buffer a", whole[:4]), ("buffer b", whole[4:]), ("parameter w", torch.zeros(3, 5).t()),
             ("buffer c", torch.zeros(5))]
    sums = Checksums()
    assert beyond_views(named, sums) == {}
    assert beyond_views(named[:1], sums) == beyond_views(named[:1], sums) != {}  # the half alone: its other half
    before = beyond_views(named[:1], sums)
    whole[6] = 1.0
    assert beyond_views(named[:1], sums) != before


# ------------------------------------------------------------------ tensors hung in a `.grad` slot (L02, L03)
class FrozenGrad(Classifier):
    """zoo33 L02: the batch mean in the `.grad` of a frozen parameter, read by the next forward."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.shift.grad
        return self.net(x - (g if g is not None else 0))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.shift.grad = batch[0].mean(0).detach().clone()


class BufferGrad(Classifier):
    """zoo33 L03: the batch mean in the `.grad` of a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.center.grad
        return self.net(x - (g if g is not None else 0))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.center.grad = batch[0].mean(0).detach().clone()


class AttributeGrad(Classifier):
    """The batch mean in the `.grad` of a plain tensor attribute (no buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.center = torch.zeros(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.center.grad
        return self.net(x - (g if g is not None else 0))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.center.grad = batch[0].mean(0).detach().clone()


@pytest.mark.parametrize("model, match", [
    (FrozenGrad, r"the \.grad of parameter shift"),
    (BufferGrad, r"the \.grad of buffer center"),
    (AttributeGrad, "attribute center"),
])
def test_a_statistic_kept_in_a_grad_slot_is_refused(model, match):
    refused(model(), match)


class FrozenLayer(Classifier):
    """A frozen first layer (no grad ever) and a frozen parameter whose stale gradient zero_grad clears."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)
        self.extra = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.extra

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.extra.requires_grad_(False)  # frozen after its first update: its last (released) gradient stays


def test_frozen_parameters_and_their_cleared_gradients_train():
    m = FrozenLayer()
    first = m.net[0].weight.detach().clone()
    fit(m, steps=4)
    assert torch.equal(m.net[0].weight, first) and m.net[0].weight.grad is None


# ------------------------------------------------------------------ a function's default arguments (L07)
def shift(x: torch.Tensor, *, by: float = 0.0) -> torch.Tensor:
    return x - by


def scale(x: torch.Tensor, by: float = 1.0) -> torch.Tensor:
    return x * by


offset = functools.partial(torch.add, other=0.0)


class KwDefaults(Classifier):
    """zoo33 L07: the batch mean written into a module function's keyword-only default."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(shift(x))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        shift.__kwdefaults__["by"] = float(batch[0][:, 0].mean())


class Defaults(Classifier):
    """The positional defaults rebound to the batch mean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(scale(x))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        scale.__defaults__ = (1.0 + float(batch[0][:, 0].mean()),)


class MethodDefaults(Classifier):
    """A method's keyword-only default, written through the class."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.centred(x))

    def centred(self, x: torch.Tensor, *, by: float = 0.0) -> torch.Tensor:
        return x - by

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        type(self).centred.__kwdefaults__["by"] = float(batch[0][:, 0].mean())


class PartialKeyword(Classifier):
    """A module-level partial's bound keyword (a float) set to the batch mean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(offset(x))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        offset.keywords["other"] = float(batch[0][:, 0].mean())


@pytest.fixture
def defaults_restored():
    saved = (dict(shift.__kwdefaults__), scale.__defaults__, dict(MethodDefaults.centred.__kwdefaults__),
             dict(offset.keywords))
    yield
    shift.__kwdefaults__.update(saved[0])
    scale.__defaults__ = saved[1]
    MethodDefaults.centred.__kwdefaults__.update(saved[2])
    offset.keywords.update(saved[3])


@pytest.mark.parametrize("model, match", [
    (KwDefaults, r"the defaults of function .*\.shift"),
    (Defaults, r"the defaults of function .*\.scale"),
    (MethodDefaults, r"MethodDefaults\.centred\.__defaults__"),
    (PartialKeyword, r"global .*\.offset"),
])
def test_a_statistic_kept_in_a_default_argument_is_refused(model, match, defaults_restored):
    refused(model(), match)


class UsesDefaults(Classifier):
    """Functions and methods with default arguments never changed: trains."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.centred(offset(scale(shift(x)))))

    def centred(self, x: torch.Tensor, *, by: float = 0.0) -> torch.Tensor:
        return x - by


def test_functions_with_unchanged_defaults_train(defaults_restored):
    from lightning_dp.fingerprints.state_walker import function_defaults

    fit(UsesDefaults(), steps=4)
    assert function_defaults(shift) == ((), {"by": 0.0}) and function_defaults(torch.nn.functional.dropout) is None


# ------------------------------------------------------------------ a library class's attributes (L39)
class ClassOffset(Classifier):
    """zoo33 L39: the batch mean kept on ``pl.LightningModule`` itself, read as ``self.zoo_offset``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - self.zoo_offset)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pl.LightningModule.zoo_offset = float(batch[0][:, 0].mean())


class ModuleOffset(ClassOffset):
    """The same on ``nn.Module``, a tensor written in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - nn.Module.zoo_center)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        nn.Module.zoo_center.copy_(batch[0].mean(0))


@pytest.fixture
def library_classes_restored():
    pl.LightningModule.zoo_offset = 0.0
    nn.Module.zoo_center = torch.zeros(4)
    yield
    del pl.LightningModule.zoo_offset
    del nn.Module.zoo_center


@pytest.mark.parametrize("model, match", [
    (ClassOffset, "attribute zoo_offset of library class LightningModule"),
    (ModuleOffset, "attribute zoo_center of library class Module"),
])
def test_a_statistic_kept_on_a_library_class_is_refused(model, match, library_classes_restored):
    refused(model(), match)


def test_a_public_library_class_attribute_trains(library_classes_restored):
    fit(ClassOffset(), steps=4, public_state=["LightningModule.zoo_offset"])


def test_library_class_attributes_skip_methods_and_private_names():
    from lightning_dp.fingerprints.state_walker import library_class_attributes

    names = {(c.__name__, k) for c, k, _ in library_class_attributes([Classifier])}
    assert ("Module", "dump_patches") in names
    assert not any(k.startswith("_") or k in ("forward", "training_step") for _, k in names)
    pl.LightningModule._zoo_private = 1.0  # a private name holding no tensor: the libraries' own kind
    try:
        assert ("LightningModule", "_zoo_private") not in {(c.__name__, k) for c, k, _ in
                                                           library_class_attributes([Classifier])}
    finally:
        del pl.LightningModule._zoo_private


def test_a_fit_with_the_usual_callbacks_a_logger_and_bf16_trains(tmp_path):
    """Lightning's callbacks, a logger and AMP set their own (private) attributes as they run: none is refused."""

    class Validated(Classifier):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    m = Validated()
    quiet_trainer(strategy=strategy(), max_epochs=2, precision="bf16-mixed", default_root_dir=tmp_path,
                  logger=CSVLogger(tmp_path), enable_checkpointing=True,
                  callbacks=[ModelCheckpoint(dirpath=tmp_path, monitor="val_loss"),
                             EarlyStopping(monitor="val_loss", patience=5)]).fit(
        m, loader(), loader(seed=1))
    assert not unchanged(parameters(Classifier()), m)


def test_the_fingerprint_names_each_place():
    model = BufferGrad()
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    model.center.grad = torch.zeros(4)  # zeros, as `zero_grad(set_to_none=False)` leaves them: no data
    assert StateFingerprint.changed(before, fingerprint.take()) == []
    model.center.grad = torch.ones(4)
    assert StateFingerprint.changed(before, fingerprint.take()) == ["the .grad of buffer center"]
