"""Noiseless preconditioner: NOT differentially private (docs/algorithms.md §5).

A research baseline from design-principles Alg. 9: m from the noisy ĝ, v from the
clean clipped mean ḡ = S/B. The mechanism hands the clean mean over only when
asked (``MechanismRequest(clean_mean=True)``), and the strategy then records the
step as non-private, so no finite ε is ever reported for such a run.
"""

from __future__ import annotations

import warnings
from typing import ClassVar, Optional

from torch import Tensor

from lightning_dp.privacy.release import MechanismRequest, Release
from lightning_dp.optim.preconditioner import Preconditioner, lookup

_REQUEST = MechanismRequest(clean_mean=True)


class NotPrivateWarning(UserWarning):
    """Raised (as a warning) when a configuration gives up differential privacy."""


class Noiseless(Preconditioner):
    """``v`` averages the clean clipped mean squared (§5). Warns loudly once, at creation."""

    name: ClassVar[str] = "noiseless"

    def __init__(self) -> None:
        warnings.warn(
            "variant 'noiseless' reads the UN-NOISED clipped gradient mean: this run is NOT "
            "differentially private (ε = ∞). Use it only as a research baseline.",
            NotPrivateWarning,
            stacklevel=3,
        )

    def request(self, optimizer: object) -> MechanismRequest:
        """Ask for the clean clipped mean (non-private)."""
        return _REQUEST

    def statistic(self, p: Tensor, grad: Tensor, release: Optional[Release], decay: Optional[Tensor]) -> Tensor:
        """``(ḡ + λθ)²`` with ḡ the clean clipped mean (λθ: coupled weight decay, if any)."""
        assert release is not None
        clean = lookup(release.clean_mean, p, "clean_mean", self.name)
        if decay is not None:
            clean = clean + decay
        return clean * clean
