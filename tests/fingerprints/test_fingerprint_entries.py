"""What a replay on other data set apart (fingerprints/fingerprint_entries.py, ``moved_by_data``): an entry the second
replay on the data also set apart is excused only when it is no Python scalar (an object compared by identity, made
anew by each run); a number or a string is judged by value (zoo30 k03: the clocks are replayed, so the runs on the data
no longer differ by a time stamp, and a difference they still show is no excuse for one the data makes); a tensor
whose numbers the other data moved far beyond what the runs on the data differ by is the data's too (an unseeded
draw of 1e-9 beside a training-set mean)."""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Callable

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from conftest import quiet_trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, loader, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.fingerprints.fingerprint_entries import changed_entries, moved_by_data  # noqa: E402
from lightning_dp.validators.kept_state import StateFingerprint  # noqa: E402


def test_a_number_the_runs_on_the_data_set_apart_is_still_judged() -> None:
    plain = {"attribute t": ("float", "1.5"), "attribute name": ("str", "a")}
    again = {"attribute t": ("float", "1.75"), "attribute name": ("str", "b")}
    other = {"attribute t": ("float", "9.5"), "attribute name": ("str", "c")}
    assert moved_by_data(plain, again, other) == ["attribute t", "attribute name"]


def test_an_object_made_anew_by_each_run_is_excused() -> None:
    plain = {"attribute loss_fn": ("object", "partial", 1), "attribute t": ("float", "1.5")}
    again = {"attribute loss_fn": ("object", "partial", 2), "attribute t": ("float", "1.5")}
    other = {"attribute loss_fn": ("object", "partial", 3), "attribute t": ("float", "1.5")}
    assert moved_by_data(plain, again, other) == []
    assert moved_by_data(plain, plain, other) == ["attribute loss_fn"]  # alike on the data: the other data's


def test_numbers_the_other_data_moved_far_beyond_the_draw_are_the_datas() -> None:
    """A small tensor's values (by ``repr``) and a tensor's content sums: an unseeded draw of 1e-9 beside a mean sets
    the runs on the data 1e-9 apart, the other data's run 0.3 apart: the data's (the lead's e01/e04)."""
    sums = struct.pack("=3d", 1.0, 2.0, 3.0)
    plain = {"buffer hint": ("tensor", ((8,), "float32", sums)), "callback C.hint": ("tensor", ("0.5", "0.25"))}
    again = {"buffer hint": ("tensor", ((8,), "float32", struct.pack("=3d", 1.0 + 1e-9, 2.0, 3.0))),
             "callback C.hint": ("tensor", ("0.5000000001", "0.25"))}
    other = {"buffer hint": ("tensor", ((8,), "float32", struct.pack("=3d", 1.3, 2.4, 3.0))),
             "callback C.hint": ("tensor", ("0.8", "0.25"))}
    assert moved_by_data(plain, again, other) == ["buffer hint", "callback C.hint"]


def test_a_draw_as_large_as_the_datas_move_stays_excused() -> None:
    """A fresh unseeded draw kept (an augmentation's last noise) moves every run alike: no more the data's than the
    draw's; tokens whose numbers do not line up (a list grown apart) or hold none stay excused too."""
    plain = {"attribute noise": ("tensor", ("0.5", "-1.2")), "attribute hist": ("list", ("0.5",), 1),
             "attribute fn": ("object", "partial", 1)}
    again = {"attribute noise": ("tensor", ("-0.7", "0.3")), "attribute hist": ("list", ("0.5", "0.1"), 2),
             "attribute fn": ("object", "partial", 2)}
    other = {"attribute noise": ("tensor", ("1.1", "0.9")), "attribute hist": ("list", ("9.5",), 1),
             "attribute fn": ("object", "partial", 3)}
    assert moved_by_data(plain, again, other) == []


class _TrainMeanPlusDraw(Classifier):
    """A buffer set at each epoch's end to the training set's mean plus an unseeded draw of 1e-5 (a generator seeded
    from the OS, which no replay repeats; large enough that float32 never rounds it away)."""

    def __init__(self, scale: float = 1e-5, data_term: bool = True) -> None:
        super().__init__()
        self.scale, self.data_term = scale, data_term
        self.register_buffer("hint", torch.zeros(4))

    def on_train_epoch_end(self) -> None:
        generator = torch.Generator()
        generator.seed()
        x = self.trainer.train_dataloader.dataset.tensors[0]
        with torch.no_grad():
            self.hint.copy_((x.mean(0) if self.data_term else 0) + self.scale * torch.randn(4, generator=generator))


class _CallbackKeepingTheMeanPlusDraw(pl.Callback):
    def __init__(self) -> None:
        self.hint = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        generator = torch.Generator()
        generator.seed()
        self.hint = trainer.train_dataloader.dataset.tensors[0].mean(0) + 1e-5 * torch.randn(4, generator=generator)


def _two_epochs(model: pl.LightningModule, callbacks: list | None = None) -> None:
    quiet_trainer(strategy=strategy(), max_epochs=2, callbacks=callbacks or []).fit(model, loader(64, seed=11))


def test_a_training_set_mean_hidden_behind_an_unseeded_draw_is_refused_at_the_epochs_end() -> None:
    with pytest.raises(PrivacyConfigurationError, match=r"buffer hint"):
        _two_epochs(_TrainMeanPlusDraw())
    with pytest.raises(PrivacyConfigurationError, match=r"callback _CallbackKeepingTheMeanPlusDraw\.hint"):
        _two_epochs(Classifier(), [_CallbackKeepingTheMeanPlusDraw()])


def test_an_unseeded_draw_kept_at_the_epochs_end_trains() -> None:
    model = _TrainMeanPlusDraw(scale=1.0, data_term=False)
    _two_epochs(model)
    assert float(model.hint.abs().sum()) > 0


def test_equal_fingerprints_are_compared_whole_first() -> None:
    """perf31: two equal dicts (compared in C, an entry holding the very same token in both equal, as Python's
    containers compare) have no changed entry; one entry per name was compared with ``!=`` before, which charged a
    token that is not equal to itself (a NaN a layer holds as its configuration, the same object both times) as a
    write."""
    nan = float("nan")
    assert changed_entries({"configuration 0.p": nan, "parameter w": (1, 2)},
                           {"configuration 0.p": nan, "parameter w": (1, 2)}) == []
    assert changed_entries({"a": 1, "b": 2}, {"b": 2, "a": 1}) == []  # the order of the entries is no change
    assert changed_entries({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 0}) == ["b", "c"]
    assert changed_entries({"a": 1, "b": 2}, {"a": 1}) == ["b"]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.seen = 0


def _data_write(m: _Net) -> None:
    m.fc.weight.data[0, 0] += 1.0  # no version counter moves


def _attribute(m: _Net) -> None:
    m.seen = 1


def _buffer(m: _Net) -> None:
    m.norm.running_mean.add_(1.0)


def _mode(m: _Net) -> None:
    m.fc.eval()


def _hook(m: _Net) -> None:
    kept: list = []
    m.fc.register_forward_hook(lambda *args: kept.append(args))


def _layer_setting(m: _Net) -> None:
    m.norm.momentum = 0.5


MODEL_WRITES: dict[str, Callable[[_Net], None]] = {
    "through .data": _data_write, "an attribute": _attribute, "a buffer in place": _buffer, "a mode": _mode,
    "a hook": _hook, "a layer's setting": _layer_setting}


@pytest.mark.parametrize("write", list(MODEL_WRITES), ids=list(MODEL_WRITES))
def test_a_write_into_the_model_between_two_fingerprints_is_still_named(write: str) -> None:
    """What the whole-dict comparison must still let through to the entry-by-entry one (the late-write watch compares
    the fingerprints before and after a silent callback's call this way: a write it makes into the model's state)."""
    model = _Net()
    fingerprint = StateFingerprint(model)
    before = fingerprint.take()
    assert StateFingerprint.changed(before, fingerprint.take()) == []
    with torch.no_grad():
        MODEL_WRITES[write](model)
    assert StateFingerprint.changed(before, fingerprint.take())


def test_one_number_needs_the_squared_ratio() -> None:
    """Three draws of one number set apart 100-fold by chance in about 0.5 % of runs: one number needs 10,000-fold."""
    plain, again = {"attribute x": ("tensor", ("0.5",))}, {"attribute x": ("tensor", ("0.501",))}
    assert moved_by_data(plain, again, {"attribute x": ("tensor", ("0.7",))}) == []  # 200-fold: excused
    assert moved_by_data(plain, again, {"attribute x": ("tensor", ("20.5",))}) == ["attribute x"]  # 20,000-fold
