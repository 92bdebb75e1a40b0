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
    """A stand-in SUM all-reduce of [refused, σ/C agreement terms] in which the other rank refused (its σ and C this
    rank's, or ``other_terms``: validators/rank_agreement.release_agreement)."""

    def __init__(self, refused: bool = True, other_terms: list[int] | None = None) -> None:
        self.calls = 0
        self.refused, self.other_terms = refused, other_terms

    def __call__(self, t: Tensor) -> None:
        self.calls += 1
        other = t.clone()
        other[0] = int(self.refused)
        if self.other_terms is not None:
            other[1:] = torch.tensor(self.other_terms, dtype=t.dtype)
        t += other


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


def test_a_clipping_bound_of_another_rank_is_refused_here():
    """σ and C ride on the same all-reduce (validators/rank_agreement.py): another rank clipping at 100 is refused on
    this one, whose own check passed, naming C."""
    from lightning_dp.validators.rank_agreement import release_agreement

    step = _step(None)
    terms = release_agreement([step.noise_multiplier, 100.0, (type(step.clipping).__name__, step.clipping.settings())])
    ranks = _OtherRankRefuses(refused=False, other_terms=terms)
    step = _step(ranks)
    with pytest.raises(PrivacyConfigurationError, match="do not run the same mechanism.*max_grad_norm C"):
        step.on_every_rank(lambda: None, "found kept state")
    step.distribution.all_reduce.other_terms = None  # the same σ and C, nobody refused: passes
    step.distribution.all_reduce.refused = False
    step.on_every_rank(lambda: None, "found kept state")


def test_one_process_runs_the_check_alone():
    step = _step(None)
    step.on_every_rank(lambda: None, "found kept state")
    with pytest.raises(PrivacyConfigurationError, match="own"):
        step.on_every_rank(lambda: (_ for _ in ()).throw(PrivacyConfigurationError("own")), "x")
