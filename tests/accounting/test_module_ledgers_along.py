"""Weights moved the way a private fit moved them carry its releases (accounting/module_ledgers.along, zoo17 l1):
an EMA or ``AveragedModel`` of the weights along the fit, a point between its start and its end, a snapshot from
the middle of it — loaded into a fresh module and trained again on the same data, the ledger continues the fit's
record instead of restarting at zero. A fresh module, seeded alike or otherwise, starts its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit  # noqa: E402

from lightning_dp.accounting import module_ledgers  # noqa: E402


class Averaging(pl.Callback):
    """An ``AveragedModel`` of the weights, updated at every batch's end (an EMA when ``decay`` is given)."""

    def __init__(self, decay=None) -> None:
        self.decay = decay
        self.average = None

    def on_fit_start(self, trainer, module) -> None:
        avg = get_ema_multi_avg_fn(self.decay) if self.decay else None
        self.average = AveragedModel(module, multi_avg_fn=avg)

    def on_train_batch_end(self, trainer, module, *args) -> None:
        self.average.update_parameters(module)


def _averaged(decay):
    """A fresh module given the average an ``Averaging`` kept over a fit of three steps (σ small: the moves are the
    gradient's, so the average follows the fit's move at the sketch's 32 positions of the first layer's weight)."""
    keeper = Averaging(decay)
    assert fit(Classifier(), steps=3, callbacks=[keeper], noise_multiplier=0.01).ledger.steps == 3
    fresh = Classifier()
    fresh.load_state_dict(keeper.average.module.state_dict())
    return fresh


def test_an_ema_of_the_weights_continues_the_record():
    assert fit(_averaged(0.9), steps=2).ledger.steps == 5


def test_an_averaged_model_of_the_weights_continues_the_record():
    assert fit(_averaged(None), steps=2).ledger.steps == 5


def test_a_point_between_the_start_and_the_end_continues_the_record():
    trained = Classifier()
    assert fit(trained, steps=3).ledger.steps == 3
    start = Classifier().state_dict()
    halfway = Classifier()
    halfway.load_state_dict({k: (v + start[k]) / 2 for k, v in trained.state_dict().items()})
    assert fit(halfway, steps=2).ledger.steps >= 5  # conservative: along other fits of this start on these data too


def test_a_fresh_module_seeded_alike_starts_its_own_record():
    assert fit(Classifier(), steps=3).ledger.steps == 3
    assert fit(Classifier(), steps=2).ledger.steps == 2


def test_along_takes_the_fit_s_direction_only():
    start = torch.zeros(64, dtype=torch.float64)
    end = torch.linspace(-1, 1, 64, dtype=torch.float64)
    assert module_ledgers.along(0.3 * end, start, end)  # an average along the way
    assert not module_ledgers.along(start, start, end)  # not moved: a fresh module seeded alike
    assert not module_ledgers.along(-0.3 * end, start, end)  # against the fit's move
    assert not module_ledgers.along(3 * end, start, end)  # moved far beyond the fit
    generator = torch.Generator().manual_seed(0)
    assert not module_ledgers.along(0.5 * torch.randn(64, generator=generator, dtype=torch.float64), start, end)
