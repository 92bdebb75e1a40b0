"""Attributes a module fills on its first forward (validators/step_checks.verify_on): a cache computed from shapes only
(Lightning's demo Transformer keeps its causal mask and positional table so) is filled alike by every replay of the
first step and trains; one filled from the first batch's values (a normaliser frozen on first use) is set apart by the
replay on other data and refused before any release."""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit, parameters, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402


class Table(nn.Module):
    """A sinusoid table made on the first forward, from the input's width only (positional encodings)."""

    def __init__(self) -> None:
        super().__init__()
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            angle = torch.arange(x.shape[1], dtype=x.dtype) / x.shape[1] * math.pi
            self.table = torch.sin(angle)
        return x + self.table


class WithTable(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.encode = Table()
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask is None or self.mask.shape[0] != x.shape[1]:
            self.mask = torch.ones(x.shape[1], x.shape[1]).triu()
        return super().forward(self.encode(x) @ self.mask)


class FrozenOnFirstUse(Classifier):
    """The first batch's feature means kept on first use and subtracted ever after."""

    def __init__(self) -> None:
        super().__init__()
        self.centre: torch.Tensor | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.centre is None:
            self.centre = x.mean(0).detach()
        return F.cross_entropy(self(x - self.centre), y)


class Rotary(nn.Module):
    """GPT-NeoX-style rotary tables with the cached length starting at 0, a mask buffer registered as None, masks by
    length in a dict and a scale as a cached_property: all filled on first use, from shapes only."""

    def __init__(self) -> None:
        super().__init__()
        self.seq_len_cached = 0
        self.cos_cached: torch.Tensor | None = None
        self.masks: dict[int, torch.Tensor] = {}
        self.register_buffer("mask", None, persistent=False)

    @functools.cached_property
    def scale(self) -> float:
        return 1 / math.sqrt(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[1]
        if width > self.seq_len_cached:
            self.seq_len_cached = width
            self.cos_cached = torch.cos(torch.arange(width, dtype=x.dtype))
        if width not in self.masks:
            self.masks[width] = torch.ones(width)
        if self.mask is None:
            self.mask = torch.ones(width)
        return x * self.cos_cached[:width] * self.masks[width] * self.mask * self.scale


class WithRotary(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.rope = Rotary()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.rope(x))


@pytest.mark.parametrize("factory", [WithTable, WithRotary], ids=["None attributes", "0, {}, a None buffer, cached"])
def test_a_cache_filled_from_shapes_on_the_first_forward_trains(factory):
    model = factory()
    assert fit(model, steps=3).ledger.steps == 3


def test_a_statistic_kept_on_first_use_is_refused_before_any_release():
    model = FrozenOnFirstUse()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"attribute centre"):
        fit(model, steps=3)
    assert unchanged(before, model), "a release happened"
