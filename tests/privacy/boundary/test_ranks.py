"""Every rank decides alike (PrivateStep.on_every_rank): a boundary refusal on one rank stops the others too, before
the release's all-reduce that the refusing rank would never join."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_dp import PrivacyConfigurationError
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import Distribution, PrivateStep


class _OtherRankRefuses:
    """A stand-in SUM all-reduce of [refused, final] in which the other rank refused."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, t: Tensor) -> None:
        self.calls += 1
        t[0] += 1.0


def _step(all_reduce) -> PrivateStep:
    model = nn.Linear(3, 2)
    step = PrivateStep(1.0, 1.0, GaussianNoise(seed=0))
    step.attach(model, torch.optim.SGD(model.parameters(), lr=0.1),
                Distribution(rank=0, world_size=2, all_reduce=all_reduce))
    return step


def test_a_check_that_passed_here_raises_when_another_rank_refused():
    ranks = _OtherRankRefuses()
    step = _step(ranks)
    with pytest.raises(PrivacyConfigurationError, match="another rank.*kept state"):
        step.on_every_rank(lambda: None, "found kept state")
    assert ranks.calls == 1


def test_one_process_runs_the_check_alone():
    step = _step(None)
    step.on_every_rank(lambda: None, "found kept state")
    with pytest.raises(PrivacyConfigurationError, match="own"):
        step.on_every_rank(lambda: (_ for _ in ()).throw(PrivacyConfigurationError("own")), "x")
