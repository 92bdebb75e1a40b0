"""A lone number held or written is taken for a single-number statistic of the training data only at float precision
(record_statistics/training_statistics.py, ``_lone_tolerance``): a held-out loss, a best score or a hyper-parameter
kept on the module comes within 1e-4 of a class fraction, a ratio of class counts or a global mean by chance (about
once in 3,900 uniform values against breast cancer's five), so at 1e-4 a fit keeping its validation losses was refused
at random (tests/validators/test_judged_writes_validation.py, once in 50 fits). The statistic as user code computes
it in float32 (``y.float().mean()``, ``x.mean()``, ``x.std()``, the counts' ratio, the log-odds; in NumPy too) is
still refused, before the fit and when written during it, and so are vectors within 1e-4 (a feature-mean vector)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, strategy  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.fingerprints.dataset_tokens import dataset_parts  # noqa: E402
from lightning_dp.record_statistics.training_statistics import TrainingStatistics  # noqa: E402

torch.set_num_threads(1)

_G = torch.Generator().manual_seed(0)
X = torch.randn(569, 6, generator=_G) * 4 + 30  # float32, positive: breast cancer's shape and kind
Y = (torch.rand(569, generator=_G) < 0.63).long()
P = Y.float().mean()

# (what user code computes in float32, the statistic it is)
COMPUTED: list[tuple[str, Callable[[], Any], str]] = [
    ("y.float().mean()", lambda: P, "fraction of class 1"),
    ("1 - y.float().mean()", lambda: 1 - P, "fraction of class 0"),
    ("counts' ratio", lambda: (Y == 0).sum() / (Y == 1).sum(), "ratio of the class counts (0 to 1)"),
    ("log-odds", lambda: torch.log(P / (1 - P)), "log-odds of class 1"),
    ("x.mean()", lambda: X.mean(), "mean of the training tensors[0]"),
    ("x.mean().item()", lambda: X.mean().item(), "mean of the training tensors[0]"),
    ("numpy mean", lambda: float(np.mean(X.numpy())), "mean of the training tensors[0]"),
    ("x.std()", lambda: X.std(), "standard deviation of the training tensors[0]"),
]


def _statistics() -> TrainingStatistics:
    datasets, tensors = dataset_parts(TensorDataset(X, Y))
    return TrainingStatistics(datasets, tensors)


@pytest.mark.parametrize("how, value, statistic", COMPUTED, ids=[c[0] for c in COMPUTED])
def test_a_single_number_computed_from_the_data_in_float32_is_refused(how: str, value: Callable[[], Any],
                                                                        statistic: str) -> None:
    found = _statistics().held_by("attribute kept", value(), approximate=False)
    assert len(found) == 1 and statistic in found[0], found


@pytest.mark.parametrize("how, value, statistic", COMPUTED, ids=[c[0] for c in COMPUTED])
def test_a_single_number_within_1e_4_of_a_statistic_but_not_at_float_precision_is_not_taken_for_it(
        how: str, value: Callable[[], Any], statistic: str) -> None:
    statistics = _statistics()
    exact = float(value())
    for near in (exact * (1 + 3e-5), exact * (1 - 3e-5), torch.tensor(exact * (1 + 3e-5))):
        assert statistics.held_by("attribute best_val", near) == []


def test_a_vector_within_1e_4_of_a_statistic_is_still_refused() -> None:
    found = _statistics().held_by("attribute means", X.mean(0) * (1 + 3e-5), approximate=False)
    assert found == ["attribute means equals the per-feature mean of the training tensors[0]"]


def test_random_held_out_losses_rarely_match_a_single_number_statistic() -> None:
    """2,000 uniform "losses" in [0.05, 3] against the five single-number label statistics in that range, and two
    planted 3e-5 off: at 1e-4 about 0.5 chance matches expected (2.6e-4 each) and the two planted, at float precision
    none (0.01 expected)."""
    statistics = _statistics()
    g = torch.Generator().manual_seed(1)
    losses = (0.05 + 2.95 * torch.rand(2000, generator=g, dtype=torch.float64)).tolist()
    planted = [float(P) * (1 + 3e-5), float((Y == 0).sum() / (Y == 1).sum()) * (1 - 3e-5)]
    assert [v for v in losses + planted if statistics.held_by("attribute best_val", v, approximate=False)] == []


# --- through Trainer.fit: validation losses kept on the module, 13 validations of 16 -----------------------------

TRAIN = data(48)  # 22 of 48 labels 1: a fraction of class 1 no round number
FRACTION = float(TRAIN.tensors[1].float().mean())
_L = torch.Generator().manual_seed(2)
LOSSES = (0.05 + 2.95 * torch.rand(13 * 16, generator=_L, dtype=torch.float64)).tolist()
LOSSES[100] = FRACTION * (1 + 3e-5)  # within 1e-4 of the training labels' fraction of class 1, not at float precision


class KeepsValidationLosses(Classifier):
    """Keeps each validation's held-out losses (0-d tensors, ``self.val_losses``) and the best one (a float): the
    losses stand for a held-out set's, seeded; one sits 3e-5 off the training labels' fraction of class 1."""

    def __init__(self, kept: Callable[[], Any] = lambda: None) -> None:
        super().__init__()
        self.seen, self.best_val, self.kept = 0, float("inf"), kept

    def on_validation_epoch_start(self) -> None:
        self.val_losses: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1]).detach() * 0 + LOSSES[self.seen]
        self.seen += 1
        self.val_losses.append(loss)
        self.best_val = min(self.best_val, float(loss))
        self.log("val_loss", loss)

    def on_validation_epoch_end(self) -> None:
        value = self.kept()
        if value is not None:
            self.statistic = value


def _fit(model: pl.LightningModule) -> pl.Trainer:
    trainer = quiet_trainer(strategy=strategy(), max_steps=13, val_check_interval=1, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(TRAIN, batch_size=16), DataLoader(data(16, seed=1), batch_size=1))
    return trainer


def test_a_fit_keeping_its_validation_losses_trains_though_one_is_within_1e_4_of_a_class_fraction() -> None:
    model = KeepsValidationLosses()
    assert _fit(model).global_step == 13 and model.seen == len(LOSSES)


# computed before the fit (a global: no exchange of the training data moves it), kept at validation's end
POSITIVE_RATE = TRAIN.tensors[1].float().mean()
GLOBAL_MEAN = float(TRAIN.tensors[0].mean())


@pytest.mark.parametrize("kept, statistic", [(lambda: POSITIVE_RATE, "fraction of class 1"),
                                             (lambda: GLOBAL_MEAN, "mean of the training tensors[0]")],
                         ids=["y.float().mean()", "float(x.mean())"])
def test_a_single_number_statistic_kept_during_the_fit_is_still_refused(kept: Callable[[], Any],
                                                                        statistic: str) -> None:
    with pytest.raises(PrivacyConfigurationError, match="statistic of the training data") as refusal:
        _fit(KeepsValidationLosses(kept))
    assert f"attribute statistic equals the {statistic}" in str(refusal.value)
