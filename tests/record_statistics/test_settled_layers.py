"""The written-statistics watch passes by a layer whose attributes are the very immutable values it compared last
(record_statistics/written_statistics.py, issue 38: a torch layer's ``in_features``/``kernel_size`` walked at every
release cost O(layers) Python) — and still finds a statistic written later into any attribute of such a layer: a
float or a tuple of numbers put in its place (a new object), a list it held grown in place, a full check."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.record_statistics import data_statistics  # noqa: E402
from lightning_dp.record_statistics.training_statistics import TrainingStatistics  # noqa: E402
from lightning_dp.record_statistics.written_statistics import WrittenStatistics  # noqa: E402

torch.set_num_threads(1)


def _watch() -> tuple[WrittenStatistics, nn.Sequential, torch.Tensor]:
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0)) * 2 + 1
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    watch = WrittenStatistics(TrainingStatistics([], [("[0]", x)]), lambda: [("model", model)], model)
    return watch, model, x


def _walked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The attribute prefixes the watch's walk enters, as it enters them."""
    seen: list[str] = []
    walk = data_statistics._attributes

    def spy(prefix: str, owner: Any, *args: Any) -> Any:
        seen.append(prefix)
        return walk(prefix, owner, *args)

    monkeypatch.setattr(data_statistics, "_attributes", spy)
    return seen


def test_layers_holding_only_what_was_compared_are_not_walked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, model, _ = _watch()
    seen = _walked(monkeypatch)
    watch.check("at step 0")
    assert len(seen) == 4  # the container and its three layers, on the first walk
    seen.clear()
    watch.check("at step 1")
    assert seen == []  # nothing but numbers and strings they held before: passed by
    model[1].note = "public"  # a new value: that layer is walked again, once
    watch.check("at step 2")
    assert seen == ["attribute 1."]
    seen.clear()
    watch.check("at step 3", full=True)  # a full check walks every layer
    assert len(seen) == 4


@pytest.mark.parametrize("how", ["float", "tuple", "list grown in place"])
def test_a_statistic_written_into_a_settled_layer_is_refused(how: str) -> None:
    watch, model, x = _watch()
    if how == "list grown in place":
        model[0].history = []
    watch.check("at step 0")
    watch.check("at step 1")  # settled (or, holding a list, walked every time)
    mean = x.mean(0)
    if how == "float":
        model[0].scale = float(x.mean())  # the data's mean
    elif how == "tuple":
        model[2].centre = tuple(mean.tolist())
    else:
        model[0].history.extend(mean.tolist())
    with pytest.raises(PrivacyConfigurationError, match="statistic of the training data"):
        watch.check("before the release of step 2")


def test_an_equal_value_put_in_a_settled_layer_is_compared_again() -> None:
    watch, model, x = _watch()
    model[0].scale = 0.5
    watch.check("at step 0")
    compared = watch.compared
    model[0].scale = float("0.5")  # the same number, a new object: compared (and nothing found)
    watch.check("at step 1")
    assert watch.compared == compared  # an equal float's token did not move: nothing new to compare
    model[0].scale = float(x.std())
    with pytest.raises(PrivacyConfigurationError):
        watch.check("at step 2")


class Temperature(pl.Callback):
    """Sets a torch layer's attribute to a training feature's mean at step 4 (the layer settled by then)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 4:
            pl_module.net[0].temperature = self.value


def test_a_fit_refuses_a_statistic_set_on_a_torch_layer_after_it_settled() -> None:
    dataset = data()
    mean = float(dataset.tensors[0].mean())
    model = Classifier()
    trainer = quiet_trainer(strategy=strategy(), max_steps=8, callbacks=[Temperature(mean)])
    with pytest.raises(PrivacyConfigurationError, match="statistic of the training data"):
        trainer.fit(model, torch.utils.data.DataLoader(dataset, batch_size=16))
    assert trainer.global_step < 8
