"""Independent moment estimation, per-example form (docs/algorithms.md §3).

The mechanism releases, next to ĝ (noised with √2σ), a separately noised
per-example second moment ``ĝ2 = (Σ_i clip_C(g_i)² + √2σC² z2) / B``
(sensitivity ‖c⊙c‖₂ ≤ C²); ``v`` is the average of ĝ2 instead of ĝ².
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
from torch import Tensor

from lightning_dp.privacy.release import MechanismRequest, Release
from lightning_dp.optim.preconditioner import AverageFn, Preconditioner, lookup

_REQUEST = MechanismRequest(second_moment=True)


class IndependentMoments(Preconditioner):
    """``v`` averages the released second moment; divisor ``sqrt(max(v̂, γ))`` (§3).

    ĝ2 can be negative (it is noised), hence the floor γ. A coupled weight-decay
    term (plain Adam's ``weight_decay``) enters ĝ and m but not ĝ2: the mechanism
    releases the second moment of the clipped loss gradients only.

    Args:
        gamma: floor γ of the second moment inside the root.
    """

    name: ClassVar[str] = "independent_moments"

    def __init__(self, *, gamma: float = 1e-8) -> None:
        if not gamma > 0:
            raise ValueError(f"independent_moments: gamma must be > 0, got {gamma}; try 1e-8.")
        self.gamma = float(gamma)

    def request(self, optimizer: object) -> MechanismRequest:
        """Ask for the second noised statistic (the budget is split: √2σ each)."""
        return _REQUEST

    def statistic(self, p: Tensor, grad: Tensor, release: Optional[Release], decay: Optional[Tensor]) -> Tensor:
        """The released per-example second moment ĝ2 of this parameter (§3)."""
        assert release is not None
        return lookup(release.second_moment, p, "second_moment", self.name)

    def denominator(
        self, p: Tensor, second_moment: Tensor, release: Optional[Release], average: AverageFn, eps: float
    ) -> Tensor:
        """``sqrt(max(v̂, γ))`` — no ε outside the root (§3)."""
        return torch.clamp(second_moment, min=self.gamma).sqrt()
