"""The training dataset's settings as kept state (validators/kept_state.py ``dataset_entries``, fingerprints/
dataset_tokens.py ``dataset_settings``): a plain attribute or a small dict of named settings that a hook writes between
steps and ``__getitem__`` reads carries the batch into every later input. Written from the loss it is refused by the
replays, naming the attribute and its type, never its value; written from the epoch number, a seeded random draw or a
constant (``set_epoch``, an augmentation strength by epoch, a batch counter) it trains: the replays find it alike, and
put it back after each (validators/snapshot.py)."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import TinyClassifier, quiet_trainer
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_dp import DPStrategy
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep
from lightning_dp.errors import PrivacyConfigurationError

X = torch.randn(96, 4, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


class ScaledDS(Dataset):
    """Reads a scale from a plain attribute or from a dict of settings at every fetch."""

    def __init__(self) -> None:
        self.scale, self.settings, self.steps = 1.0, {"scale": 1.0, "epoch": 0}, 0
        self.order, self.history, self.strength = list(range(len(X))), [], 0.0
        self.x, self.y = X.clone(), Y.clone()

    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, i: int):
        j = self.order[i]
        return self.x[j] * self.scale * self.settings["scale"] + self.strength, self.y[j]

    def set_epoch(self, epoch: int) -> None:  # the epoch, an order shuffled by an epoch-seeded RNG, a log of epochs
        self.settings["epoch"] = epoch
        random.Random(epoch).shuffle(self.order)
        self.history.append(epoch)


def _write(ds: ScaledDS, where: str, value: float) -> None:
    if where == "attribute":
        ds.scale = value
    else:
        ds.settings["scale"] = value


class LossScale(pl.Callback):
    def __init__(self, where: str, after: int = 0) -> None:
        self.where, self.after = where, after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.after:
            _write(trainer.train_dataloader.dataset, self.where, 1.0 + float(outputs["loss"]))


class LossScaleModule(TinyClassifier):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        _write(self.trainer.train_dataloader.dataset, "attribute", 1.0 + float(outputs["loss"]))


def _fit(module, callbacks=(), epochs=2, **strategy):
    ds = ScaledDS()
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, **strategy),
                            max_epochs=epochs, callbacks=list(callbacks), num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(ds, batch_size=16))
    return ds, trainer


@pytest.mark.parametrize("where,named", [("attribute", "ScaledDS.scale (float)"),
                                         ("settings", "ScaledDS.settings (dict of settings)")])
def test_a_setting_a_callback_writes_from_the_loss_is_refused_by_name_and_type(where, named):
    with pytest.raises(PrivacyConfigurationError, match="the hooks set it apart") as err:
        _fit(TinyClassifier(), [LossScale(where)])
    first = str(err.value).splitlines()[0]
    assert f"dataset setting {named}" in first and "public_state" in first and "public data" in first
    assert "1." not in first.split("Fix:")[0]  # the value (1 + loss) is never quoted


def test_a_setting_the_modules_hook_writes_from_the_loss_is_refused():
    with pytest.raises(PrivacyConfigurationError, match=r"dataset setting ScaledDS\.scale \(float\)"):
        _fit(LossScaleModule())


def test_a_setting_written_from_the_loss_after_a_warm_up_is_refused():
    with pytest.raises(PrivacyConfigurationError, match=r"dataset setting ScaledDS\.scale"):
        _fit(TinyClassifier(), [LossScale("attribute", after=3)])


def test_a_setting_declared_public_trains():
    ds, trainer = _fit(TinyClassifier(), [LossScale("attribute")], public_state=["ScaledDS.scale"])
    assert trainer.strategy.ledger.steps >= 6 and ds.scale != 1.0


class TrainingMeanShift(pl.Callback):
    def on_train_epoch_start(self, trainer, pl_module):  # a statistic of the training set, read by every fetch
        ds = trainer.train_dataloader.dataset
        ds.strength = -float(ds.x[:, 0].mean())


def test_a_setting_an_epoch_hook_computes_from_the_training_set_is_refused():
    with pytest.raises(PrivacyConfigurationError, match=r"dataset setting ScaledDS\.strength \(float\)"):
        _fit(TinyClassifier(), [TrainingMeanShift()])


class SetEpoch(pl.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        trainer.train_dataloader.dataset.set_epoch(trainer.current_epoch)

    def on_train_epoch_end(self, trainer, pl_module):  # an augmentation strength by epoch
        trainer.train_dataloader.dataset.strength = 0.1 * 0.5 ** trainer.current_epoch


class CountBatches(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.train_dataloader.dataset.steps += 1


def test_set_epoch_a_seeded_shuffle_and_a_strength_by_epoch_train():
    """qa9 e2: refused before (the replays of the epoch hook shuffled the order again and appended the epoch again,
    and the exchange of the training data's lists put the order back as it was before the hook)."""
    ds, trainer = _fit(TinyClassifier(), [SetEpoch()], epochs=3)
    expected = list(range(len(X)))
    for epoch in range(3):
        random.Random(epoch).shuffle(expected)
    assert ds.history == [0, 1, 2] and ds.order == expected and ds.settings["epoch"] == 2
    assert ds.strength == pytest.approx(0.1 * 0.5 ** 2) and trainer.strategy.ledger.steps >= 3


def test_a_batch_counter_on_the_dataset_trains():
    ds, trainer = _fit(TinyClassifier(), [CountBatches()])
    assert ds.steps == trainer.global_step >= 6


class ScaledCollate:
    """A collate object of the user's that scales the batch by a setting of its own."""

    def __init__(self) -> None:
        self.scale = 1.0

    def __call__(self, rows):
        x, y = default_collate(rows)
        return x * self.scale, y


def _users_collate(trainer) -> ScaledCollate:
    """The user's collate object, reached only through the loader's wrappers (no hook of the user's holds it)."""
    found, seen = [trainer.train_dataloader], set()
    while found:
        obj = found.pop()
        if isinstance(obj, ScaledCollate):
            return obj
        if id(obj) not in seen and hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
            seen.add(id(obj))
            found.extend(v for v in vars(obj).values() if callable(v) or hasattr(v, "collate_fn"))
    raise AssertionError("no collate object found")


class CollateScale(pl.Callback):
    def __init__(self, from_loss: bool) -> None:
        self.from_loss = from_loss

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        value = 1.0 + float(outputs["loss"]) if self.from_loss else 1.0 + 0.1 * trainer.current_epoch
        _users_collate(trainer).scale = value


@pytest.mark.parametrize("from_loss", [True, False], ids=["from the loss", "from the epoch"])
def test_a_setting_of_the_users_collate_object_is_judged_as_the_datasets(from_loss):
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=2,
                            callbacks=[CollateScale(from_loss)], num_sanity_val_steps=0)
    collate = ScaledCollate()
    fit = lambda: trainer.fit(TinyClassifier(), DataLoader(ScaledDS(), batch_size=16, collate_fn=collate))  # noqa
    if from_loss:
        with pytest.raises(PrivacyConfigurationError, match=r"collate setting ScaledCollate\.scale \(float\)"):
            fit()
    else:
        fit()
        assert collate.scale == pytest.approx(1.1) and trainer.strategy.ledger.steps >= 6


def test_a_plain_loops_set_epoch_trains():
    """A loop of one's own: the dataset's settings are not compared (docs/release_boundary.md, not seen; its lists
    are, so an order shuffled in place between releases is refused there as before)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = ScaledDS()
    step = PrivateStep(1.0, 1.0, GaussianNoise(0), sampler_seed=0)
    step.attach(model, opt)
    loader = step.poisson_loader(DataLoader(ds, batch_size=16))
    step.verify(lambda b: F.cross_entropy(model(b[0]), b[1]))
    for epoch in range(2):
        ds.settings["epoch"], ds.strength = epoch, 0.1 * epoch
        for x, y in loader:
            step.begin()
            F.cross_entropy(model(x), y).backward()
            step.release(optimizer=opt)
            opt.step()
            opt.zero_grad()
    assert ds.settings["epoch"] == 1 and step.ledger.steps >= 2


class Scale:
    """A transform object of the user's: multiplies by a setting of its own."""

    def __init__(self) -> None:
        self.factor = 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Compose:
    """A torchvision-style list of transforms."""

    def __init__(self, transforms: list) -> None:
        self.transforms = transforms

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for t in self.transforms:
            x = t(x)
        return x


class TransformedDS(ScaledDS):
    def __init__(self, transform) -> None:
        super().__init__()
        self.transform = transform

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return self.transform(x), y


def _scale_of(trainer) -> Scale:
    transform = trainer.train_dataloader.dataset.transform
    return transform.transforms[-1] if isinstance(transform, Compose) else transform


class TransformScale(pl.Callback):
    def __init__(self, from_loss: bool) -> None:
        self.from_loss = from_loss

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _scale_of(trainer).factor = 1.0 + float(outputs["loss"]) if self.from_loss \
            else 1.0 + 0.1 * trainer.current_epoch


@pytest.mark.parametrize("in_compose", [True, False], ids=["in a Compose list", "held directly"])
@pytest.mark.parametrize("from_loss", [True, False], ids=["from the loss", "from the epoch"])
def test_a_setting_of_a_transform_the_dataset_holds_is_judged_as_the_datasets(from_loss, in_compose):
    """zoo23 c1: a "curriculum" setting the loss — ``ds.transform.transforms[0].factor = 1 + loss`` — carried the
    batch into every later input silently (only the dataset's and the collate object's own attributes were read)."""
    scale = Scale()
    ds = TransformedDS(Compose([lambda x: x, scale]) if in_compose else scale)
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=2,
                            callbacks=[TransformScale(from_loss)], num_sanity_val_steps=0)
    fit = lambda: trainer.fit(TinyClassifier(), DataLoader(ds, batch_size=16))  # noqa: E731
    if from_loss:
        with pytest.raises(PrivacyConfigurationError, match=r"transform setting Scale\.factor \(float\)"):
            fit()
    else:
        fit()
        assert scale.factor == pytest.approx(1.1) and trainer.strategy.ledger.steps >= 6


class TensorScale:
    """A transform whose factor is a tensor or a NumPy array (zoo25 t2)."""

    def __init__(self, kind: str) -> None:
        self.factor = np.ones(1) if kind == "ndarray" else torch.ones(())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(self.factor.reshape(-1)[0])


class ModuleScale(torch.nn.Module):
    """An ``nn.Module`` transform whose factor is a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _set_tensor(transform, how: str, value: float) -> None:
    if how == "rebind":
        transform.factor = torch.tensor(value)
    elif how == "ndarray":
        transform.factor[0] = value
    else:  # "fill_" on a plain transform's tensor or on a module's buffer
        transform.factor.fill_(value)


class SetFrom(pl.Callback):
    """Sets a transform's setting (``setter(value)``) at batch end, from the loss or from the epoch."""

    def __init__(self, setter, from_loss: bool) -> None:
        self.setter, self.from_loss = setter, from_loss

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.setter(1.0 + float(outputs["loss"]) if self.from_loss else 1.0 + 0.1 * trainer.current_epoch)


def _fit_transform(transform, setter, from_loss: bool, named: str) -> pl.Trainer:
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=2,
                            callbacks=[SetFrom(setter, from_loss)], num_sanity_val_steps=0)
    fit = lambda: trainer.fit(TinyClassifier(), DataLoader(TransformedDS(transform), batch_size=16))  # noqa: E731
    if from_loss:
        with pytest.raises(PrivacyConfigurationError, match=named) as err:
            fit()
        assert "1." not in str(err.value).splitlines()[0].split("Fix:")[0]  # the value is never quoted
    else:
        fit()
        assert trainer.strategy.ledger.steps >= 6
    return trainer


@pytest.mark.parametrize("how", ["fill_", "rebind", "ndarray", "module buffer"])
@pytest.mark.parametrize("from_loss", [True, False], ids=["from the loss", "from the epoch"])
def test_a_tensor_or_array_setting_of_a_transform_is_judged_as_a_plain_one(from_loss, how):
    """zoo25 t2: a transform's factor kept as a tensor (rebound or filled in place), a NumPy array written in place,
    an ``nn.Module`` transform's buffer — set from the loss, each carried the batch into every later input silently
    (only plain attributes were read)."""
    transform = ModuleScale() if how == "module buffer" else TensorScale(how)
    kind = "ndarray" if how == "ndarray" else "Tensor"
    _fit_transform(transform, lambda v: _set_tensor(transform, how, v), from_loss,
                   rf"transform setting {type(transform).__name__}\.factor \({kind}\)")
    if not from_loss:
        assert float(transform.factor.reshape(-1)[0]) == pytest.approx(1.1)


class Wrap:
    """A wrapper transform (three of them: ``Wrap(Wrap(scale))``)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _scale_by(x: torch.Tensor, st: Scale) -> torch.Tensor:
    return x * st.factor


def _closure_over(cell: list):
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * cell[0]
    return scaled


@pytest.mark.parametrize("how", ["partial", "closure", "bound method", "three wrappers"])
@pytest.mark.parametrize("from_loss", [True, False], ids=["from the loss", "from the epoch"])
def test_a_transform_reached_through_a_callable_or_three_wrappers_is_judged(from_loss, how):
    """zoo25 t1: the transform reached through ``functools.partial(fn, st=obj)``, a closure over a list, a bound
    method ``obj.__call__`` or ``Wrap(Wrap(obj))``: its setting set from the loss trained silently."""
    scale, cell = Scale(), [1.0]
    transform = {"partial": functools.partial(_scale_by, st=scale), "closure": _closure_over(cell),
                 "bound method": scale.__call__, "three wrappers": Wrap(Wrap(scale))}[how]

    def setter(value: float) -> None:
        if how == "closure":
            cell[0] = value
        else:
            scale.factor = value

    named = r"transform setting scaled\.cell \(list of settings\)" if how == "closure" \
        else r"transform setting Scale\.factor \(float\)"
    _fit_transform(transform, setter, from_loss, named)
    if not from_loss:
        assert (cell[0] if how == "closure" else scale.factor) == pytest.approx(1.1)
