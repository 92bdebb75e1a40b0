"""State written during a private fit that equals a statistic of the training data, whatever path it came by
(record_statistics/written_statistics.py, zoo32 j01): a per-feature mean the script saved before the fit
(``torch.save``, ``np.save``, ``json.dump``) and a hook reads back into a buffer, a parameter, a callback's attribute
or the optimizer's state — every step or at step 5 only, in ``on_after_backward``, an epoch's end, a callback's hook
or ``on_train_end`` — is refused before anything holding it is released, through real ``Trainer.fit`` with
``DPStrategy``; the replays alone take such a write for a function of the released state (the file does not move with
the exchanged data). Pretrained weights loaded from a file, an EMA of the weights, counters and public constants
train."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402

torch.set_num_threads(1)

Rule = Callable[[int], bool]
EVERY: Rule = lambda step: True  # noqa: E731
FIFTH: Rule = lambda step: step == 5  # noqa: E731  (silent at the first calls: a write at step 5 only)


def _saved(tmp_path: Path, how: str, values: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``values`` saved by the script before the fit (``how``: torch, numpy or json), and a reader of the file."""
    if how == "torch":
        path = tmp_path / "stats.pt"
        torch.save(values, path)
        return lambda: torch.load(path)
    if how == "numpy":
        path = tmp_path / "stats.npy"
        np.save(path, values.numpy())
        return lambda: torch.from_numpy(np.load(path))
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(values.tolist()))
    return lambda: torch.tensor(json.loads(path.read_text()))


class Hinted(Classifier):
    """A buffer ``hint`` (zeros) that ``read()`` is copied into in ``hook`` when ``when(global_step)``."""

    def __init__(self, read: Callable[[], torch.Tensor], hook: str = "", when: Rule = EVERY) -> None:
        super().__init__()
        self.register_buffer("hint", torch.zeros(4))
        self.read, self.hook, self.when = read, hook, when

    def _maybe(self, hook: str) -> None:
        if hook == self.hook and self.when(self.global_step):
            with torch.no_grad():
                self.hint.copy_(self.read())

    def on_after_backward(self) -> None:
        self._maybe("on_after_backward")

    def on_train_batch_end(self, *args: Any) -> None:
        self._maybe("on_train_batch_end")

    def on_train_epoch_end(self) -> None:
        self._maybe("on_train_epoch_end")

    def on_train_end(self) -> None:
        self._maybe("on_train_end")


class Writes(pl.Callback):
    """A callback copying ``read()`` into the module's ``hint`` in its ``on_after_backward`` or ``on_train_batch_end``,
    or (``own``) keeping it as its own attribute at an epoch's end."""

    def __init__(self, read: Callable[[], torch.Tensor], hook: str, when: Rule = EVERY) -> None:
        self.read, self.hook, self.when = read, hook, when
        self.kept = torch.zeros(4)

    def _maybe(self, hook: str, trainer: pl.Trainer, module: Any) -> None:
        if hook == self.hook and self.when(trainer.global_step):
            with torch.no_grad():
                if hook == "on_train_epoch_end":
                    self.kept = self.read()
                else:
                    module.hint.copy_(self.read())

    def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._maybe("on_after_backward", trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self._maybe("on_train_batch_end", trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._maybe("on_train_epoch_end", trainer, pl_module)


def _fit(model: pl.LightningModule, callbacks: tuple = (), steps: int = 6) -> pl.Trainer:
    """``steps`` private steps, four an epoch."""
    trainer = quiet_trainer(strategy=strategy(), max_steps=steps, callbacks=list(callbacks), num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(data(64), batch_size=16))
    return trainer


def _mean() -> torch.Tensor:
    return data(64).tensors[0].mean(0)


@pytest.mark.parametrize("how, owner, hook, when", [
    ("torch", "module", "on_after_backward", EVERY), ("numpy", "module", "on_after_backward", FIFTH),
    ("json", "module", "on_train_epoch_end", EVERY), ("torch", "module", "on_train_batch_end", EVERY),
    ("torch", "callback", "on_after_backward", FIFTH), ("json", "callback", "on_train_batch_end", EVERY),
    ("numpy", "callback", "on_train_epoch_end", EVERY)],
    ids=["torch-backward-every", "numpy-backward-5th", "json-epoch-end", "torch-batch-end",
         "torch-callback-backward-5th", "json-callback-batch-end", "numpy-callback-own-attribute"])
def test_a_statistic_read_back_from_a_file_during_the_fit_is_refused(tmp_path: Path, how: str, owner: str, hook: str,
                                                                     when: Rule) -> None:
    read = _saved(tmp_path, how, _mean())
    model, callbacks = (Hinted(read, hook, when), ()) if owner == "module" else (Hinted(read),
                                                                                 (Writes(read, hook, when),))
    with pytest.raises(PrivacyConfigurationError, match="statistic of the training data") as refusal:
        _fit(model, callbacks)
    message = str(refusal.value)
    assert "per-feature mean of the training tensors[0]" in message
    assert ("Writes.kept" if hook == "on_train_epoch_end" and owner == "callback" else "buffer hint") in message
    assert not model.hint.any()  # put back: the module holds no statistic


def test_a_statistic_written_at_the_fits_end_is_refused_and_put_back(tmp_path: Path) -> None:
    model = Hinted(_saved(tmp_path, "torch", _mean()), "on_train_end")
    with pytest.raises(PrivacyConfigurationError, match="buffer hint equals the per-feature mean"):
        _fit(model, steps=3)
    assert not model.hint.any()


def test_a_parameter_set_to_a_statistic_at_a_batchs_end_is_refused(tmp_path: Path) -> None:
    read = _saved(tmp_path, "torch", _mean())

    class Shifted(Classifier):  # a trainable input shift, set at every batch's end (after the update)
        def __init__(self) -> None:
            super().__init__()
            self.shift = nn.Parameter(torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x - self.shift)

        def on_train_batch_end(self, *args: Any) -> None:
            with torch.no_grad():
                self.shift.copy_(read())

    with pytest.raises(PrivacyConfigurationError, match="parameter shift equals the per-feature mean") as refusal:
        _fit(Shifted())
    assert "before the release of step 1" in str(refusal.value)


def test_a_statistic_kept_in_the_optimizers_state_is_refused_at_the_fits_end(tmp_path: Path) -> None:
    read = _saved(tmp_path, "torch", _mean())

    class Kept(Classifier):
        def on_train_epoch_end(self) -> None:
            optimizer = self.optimizers().optimizer
            optimizer.state[self.net[0].bias]["feature_mean"] = read()

    with pytest.raises(PrivacyConfigurationError, match=r"optimizer 0 state\[0\]\[1\]\['feature_mean'\] equals"):
        _fit(Kept())


@pytest.mark.parametrize("hook", ["setup", "on_train_start", "configure_model"])
def test_a_statistic_read_from_a_file_before_the_first_step_is_refused(tmp_path: Path, hook: str) -> None:
    read = _saved(tmp_path, "torch", _mean())

    class Early(Hinted):
        pass

    setattr(Early, hook, lambda self, *args, **kwargs: self.hint.copy_(read()))
    model = Early(read)
    with pytest.raises(PrivacyConfigurationError, match="buffer hint equals the per-feature mean"):
        _fit(model, steps=2)


# ---------------------------------------------------------------------------------------------------- safe twins
class Pretrained(Classifier):
    """Weights loaded from a file in ``hook`` (another model's: weights, not statistics)."""

    def __init__(self, path: Path, hook: str) -> None:
        super().__init__()
        self.path, self.loaded = path, hook

    def _load(self) -> None:
        self.net.load_state_dict(torch.load(self.path))

    def setup(self, stage: str) -> None:
        if self.loaded == "setup":
            self._load()

    def on_train_start(self) -> None:
        if self.loaded == "on_train_start":
            self._load()


@pytest.mark.parametrize("hook", ["setup", "on_train_start"])
def test_pretrained_weights_loaded_from_a_file_train(tmp_path: Path, hook: str) -> None:
    torch.manual_seed(1)
    path = tmp_path / "pretrained.pt"
    torch.save(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).state_dict(), path)
    assert _fit(Pretrained(path, hook)).global_step == 6


class Averaged(Classifier):
    """An EMA of the first layer's weights and a step counter in buffers, at every batch's end and epoch's end, and a
    public constant read from a file at every ``on_after_backward``."""

    def __init__(self, read: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.read = read
        self.register_buffer("ema", self.net[0].weight.detach().clone())
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("scale", torch.zeros(4))

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(self.net[0].weight, alpha=0.1)
            self.count += 1

    def on_after_backward(self) -> None:
        with torch.no_grad():
            self.scale.copy_(self.read())


class KeepsWatch(pl.Callback):
    """Keeps the fit's watch of written statistics (the strategy lets it go when the fit ends)."""

    watch: Any = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.watch = trainer.strategy.private_step.written_statistics


def test_an_ema_of_the_weights_counters_and_public_constants_from_a_file_train(tmp_path: Path) -> None:
    model = Averaged(_saved(tmp_path, "json", torch.tensor([0.5, 0.25, 2.0, 1.5])))
    kept = KeepsWatch()
    assert _fit(model, (kept,)).global_step == 6
    assert float(model.count) == 6 and float(model.scale[0]) == 0.5
    assert kept.watch.compared > 0  # the changed buffers were compared (the watch is let go after the fit)


def test_a_statistic_of_public_data_read_from_a_file_trains(tmp_path: Path) -> None:
    public = data(64, seed=7).tensors[0].mean(0)  # other records: no statistic of the training set
    model = Hinted(_saved(tmp_path, "torch", public), "on_after_backward")
    assert _fit(model).global_step == 6
    assert torch.equal(model.hint, public)


COUNTS: list[int] = []


class Compared(pl.Callback):
    """The count of values the watch compared, at each batch's end (kept outside: a list of numbers it held would
    be compared as it grows)."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        COUNTS.append(trainer.strategy.private_step.written_statistics.compared)


def test_nothing_is_compared_during_the_fit_when_nothing_changed() -> None:
    model = Classifier()
    model.register_buffer("fixed", torch.arange(4.0))
    COUNTS.clear()
    _fit(model, (Compared(),))
    assert COUNTS == [0] * 6


def test_a_value_written_near_a_statistic_is_not_taken_for_it():
    """A value trained privately may come within a subsample error of a statistic (a decoder's output bias learns the
    features' mean), never equal to it: written values are compared with the exact statistics only; held before the
    fit, the same vector is refused as approximately the mean (record_statistics/near_statistics.py)."""
    from lightning_dp.record_statistics.training_statistics import TrainingStatistics

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g) * 2 + 3
    near = x.mean(0) + 0.3 * x.std(0) / 2048 ** 0.5 * torch.randn(32, generator=g)
    statistics = TrainingStatistics([], [("[0]", x)])
    assert any("approximately the" in f for f in statistics.held_by("buffer ema_bias", near))
    assert statistics.held_by("buffer ema_bias", near, approximate=False) == []
    assert statistics.held_by("buffer ema_bias", x.mean(0), approximate=False) == [
        "buffer ema_bias equals the per-feature mean of the training [0]"]
