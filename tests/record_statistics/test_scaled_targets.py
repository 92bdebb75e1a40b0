"""A regression target scaled by its own statistics up front (record_statistics/scaled_targets.py, rule 11):
standardised, centred, min-max scaled (also of its log) is refused before any release; a target in its natural
units, clipped to a public range, or standardised by PrivateStandardizer trains."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, refused_before_any_release, strategy  # noqa: E402

from lightning_dp.data import PrivateStandardizer  # noqa: E402
from lightning_dp.record_statistics.scaled_targets import scaled_target  # noqa: E402

G = torch.Generator().manual_seed(0)
X = torch.randn(256, 4, generator=G)
Y = X @ torch.tensor([1.0, 1.5, 2.0, 0.5]) + 5.0 + 0.1 * torch.randn(256, generator=G)  # a target in its own units
PRICE = (Y / 4).exp() * 1000  # a positive target, modelled on a log scale


class Regressor(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).reshape(y.shape), y)


SCALED = {
    "standardised": ((Y - Y.mean()) / Y.std(), "standardised with its own mean and standard deviation"),
    "standardised (population std)": ((Y - Y.mean()) / Y.std(correction=0), "standardised"),
    "log, standardised": (((PRICE.log() - PRICE.log().mean()) / PRICE.log().std()), "standardised"),
    "centred": (Y - Y.mean(), "centred on its own mean"),
    "centred, [N, 1]": ((Y - Y.mean()).unsqueeze(1), "centred on its own mean"),
    "centred float64": (Y.double() - Y.double().mean(), "centred on its own mean"),
    "min-max": ((Y - Y.min()) / (Y.max() - Y.min()), r"scaled to \[0, 1\] by its own minimum and maximum"),
    "min-max to [-1, 1]": (2 * (Y - Y.min()) / (Y.max() - Y.min()) - 1, r"scaled to \[-1, 1\]"),
}


@pytest.mark.parametrize("how", list(SCALED))
def test_targets_scaled_by_their_own_statistics_are_found(how):
    y, what = SCALED[how]
    assert re.search(what, scaled_target(y))


@pytest.mark.parametrize("how", ["standardised", "centred", "min-max", "log, standardised"])
def test_a_target_scaled_up_front_is_refused_before_any_release(how):
    y, what = SCALED[how]
    refused_before_any_release(Regressor(), TensorDataset(X, y), r"(?s)the training tensors\[1\] is " + what
                               + ".*PrivateStandardizer")


def test_targets_in_natural_units_or_scaled_by_public_constants_are_not_found():
    rng = torch.Generator().manual_seed(1)
    for y in (Y, PRICE, PRICE.log(), (Y - 5.0) / 2.0, Y.clamp(4.0, 6.0), (Y - 5.0).clamp(-1.0, 1.0),
              torch.randn(10_000, generator=rng),  # a target of true mean 0: its sample mean is not 0 to 1e-5 σ
              torch.rand(1000, generator=rng),  # a proportion: never exactly 0 and 1
              torch.randint(0, 5, (256,), generator=rng).float(),  # a rating: integers
              ((Y - Y.mean()) / Y.std()).round()):  # few values
        assert scaled_target(y) == ""
    assert scaled_target(torch.randn(256, 2, generator=rng)) == ""  # features: _scaled_by_itself's


def test_a_target_in_its_units_or_privately_standardised_trains():
    quiet_trainer(strategy=strategy(), max_steps=2).fit(Regressor(), DataLoader(TensorDataset(X, Y), batch_size=16))
    quiet_trainer(strategy=strategy(), max_steps=2).fit(
        Regressor(), DataLoader(TensorDataset(X, Y.clamp(4.0, 6.0)), batch_size=16))  # clipped to a public range
    dp = strategy()
    scaler = PrivateStandardizer(-10.0, 20.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    ys = scaler.fit_transform(Y.unsqueeze(1), dp).float()
    assert scaled_target(ys) == ""  # off by the noise
    quiet_trainer(strategy=dp, max_steps=2).fit(Regressor(), DataLoader(TensorDataset(X, ys), batch_size=16))


def test_a_probability_like_target_near_but_not_at_its_ends_is_not_taken_for_min_max_scaled() -> None:
    """Scores from a sigmoid come within 1e-5 of 0 and 1 without reaching them: no min-max scaling made them."""
    g = torch.Generator().manual_seed(3)
    y = torch.sigmoid(torch.randn(500, generator=g) * 4)
    y[0], y[1] = 3e-6, 1 - 3e-6
    assert scaled_target(y) == ""
    assert scaled_target((y - y.min()) / (y.max() - y.min())) != ""


def _votes(n: int = 400, seed: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Votes won of votes cast per record (5 to 100 cast), one record with none won and one with all won."""
    g = torch.Generator().manual_seed(seed)
    cast = torch.randint(5, 101, (n,), generator=g)
    won = (torch.rand(n, generator=g) * (cast - 1)).floor() + 1  # 1 .. cast - 1
    won[0], won[1] = 0, cast[1]
    return won.to(dtype) / cast.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_natural_proportion_reaching_both_ends_is_not_taken_for_min_max_scaled(dtype) -> None:
    """k / n with a count n of each record's own: fractions of many denominators, no common one."""
    y = _votes(dtype=dtype)
    assert scaled_target(y) == ""
    quiet_trainer(strategy=strategy(), max_steps=2).fit(
        Regressor(), DataLoader(TensorDataset(X.repeat(2, 1)[:400], y.float()), batch_size=16))


def test_a_continuous_or_integer_target_min_max_scaled_is_still_found() -> None:
    g = torch.Generator().manual_seed(5)
    counts = torch.randint(3, 48, (400,), generator=g).float()
    counts[0], counts[1] = 3.0, 47.0
    counts[2:][counts[2:] == 3.0] = 4.0
    counts[2:][counts[2:] == 47.0] = 46.0
    on_one_grid = (counts - counts.min()) / (counts.max() - counts.min())  # k / 44 for every record
    assert "scaled to [0, 1]" in scaled_target(on_one_grid)
    for dtype in (torch.float32, torch.float64):
        y = Y.to(dtype)
        assert "scaled to [0, 1]" in scaled_target((y - y.min()) / (y.max() - y.min()))
