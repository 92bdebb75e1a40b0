"""Logged names as a channel (lightning_dp/value_copies/logged_names.py, zoo30 m01/m02): a name a training hook
chooses from the batch (``log_dict({f"bucket_{int(loss * 1000)}": 1})``, a name from the batch's labels) is refused
before the release it would steer, naming the hook; names from the step or epoch count train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.value_copies.logged_names import StepNames, names_apart, take_due  # noqa: E402


class RateFromNames(pl.Callback):
    """At each epoch's start from the second, the learning rate from the keys of ``trainer.callback_metrics``."""

    def __init__(self, rule: Any) -> None:
        self.rule = rule

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > 0:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = self.rule(list(trainer.callback_metrics))


class LossInTheKey(Classifier):
    """zoo30 m01: the loss in a key of log_dict."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log_dict({f"bucket_{int(loss.detach() * 1000)}": 1.0}, on_step=False, on_epoch=True)
        return loss


def _bucket(keys: list[str]) -> float:
    found = [int(k.split("_")[1]) for k in keys if k.startswith("bucket_")]
    return 0.1 * max(found) / 1000 if found else 0.05


def _share(x: torch.Tensor, y: torch.Tensor) -> str:
    return "mostly_pos" if y.float().mean() > 0.5 else "mostly_neg"


class LabelsInTheName(Classifier):
    """A name chosen from the batch's labels."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.log(_share(x, y), 1.0, on_step=False, on_epoch=True)
        return nn.functional.cross_entropy(self(x), y)


class LabelsInTheNameLater(Classifier):
    """The same name from the labels from the fifth batch on only (a counter the first step's replays do not move):
    the names change at a later step, whose batch check judges them."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        late = self.trainer.fit_loop.epoch_loop.batch_progress.total.ready > 4
        self.log(_share(x, y) if late else "warming_up", 1.0, on_step=False, on_epoch=True)
        return nn.functional.cross_entropy(self(x), y)


def _presence(keys: list[str]) -> float:
    return 0.5 if "mostly_pos" in keys else 1.0


@pytest.mark.parametrize("model, rule, where", [
    (LossInTheKey, _bucket, "replayed on the probe's examples"),
    (LabelsInTheName, _presence, "replayed on the probe's examples"),
    (LabelsInTheNameLater, _presence, "before the release of step [5-8]"),
])
def test_a_name_chosen_from_the_batch_is_refused_naming_the_hook(model, rule, where):
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)names logged by training_step .*chosen from the "
                       rf"data: {where}.*Log under fixed names") as caught:
        fit(model(), steps=24, callbacks=[RateFromNames(rule)], seed=30)
    assert "bucket_" not in str(caught.value) and "mostly_" not in str(caught.value), "names the hook, not the names"


class CountedNames(Classifier):
    """Names from the loop's counters: one per epoch, one once a warm-up ends, one on even batches; and the lr from
    their presence."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log(f"loss_epoch{self.current_epoch}", loss, on_step=False, on_epoch=True)
        if self.global_step >= 3:
            self.log("warm_done", 1.0)
        if batch_idx % 2 == 0:
            self.log("even_batch", float(batch_idx))
        return loss


def test_names_from_the_step_and_epoch_counts_train():
    dp = fit(CountedNames(), steps=12, callbacks=[RateFromNames(lambda keys: 0.5 if "warm_done" in keys else 1.0)],
             seed=31)
    assert dp.ledger.steps == 12


def test_names_apart_and_step_names():
    a, b = frozenset({("training_step", "x")}), frozenset({("training_step", "y"), ("Cb.on_train_batch_end", "z")})
    assert names_apart([a, a, a, a]) == []
    assert names_apart([a, a, b]) == ["Cb.on_train_batch_end", "training_step"]
    assert names_apart([a, b, b]) == [], "the plain runs apart (a clock's): not the data's"
    take_due()
    names = StepNames()
    names.close(0)  # training starts
    for batch, logged in enumerate([["x"], ["x"], ["x", "y"], ["x"], [], ["x"]], start=1):
        for name in logged:
            names.note("training_step", name, batch)
        names.note("on_validation_epoch_end", "val", batch)  # not a batch hook's
        new = names.close(batch + 1)
        assert new == (batch in (3, 5)), (batch, new)  # the first set is the replays'; a new set, then none
        assert take_due() == new
