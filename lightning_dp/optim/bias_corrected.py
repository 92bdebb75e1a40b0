"""DP-AdamBC: subtract the DP noise variance from the second moment (ALGORITHMS.md §2).

Paper: "DP-Adam with corrected DP bias in second moment estimation", Alg. 1
(../shared/papers/dp-adam-bias-correction.txt).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
from torch import Tensor

from lightning_dp.mechanism.release import Release
from lightning_dp.optim.preconditioner import AverageFn, Preconditioner, noise_variance


class BiasCorrected(Preconditioner):
    """Divisor ``sqrt(max(v̂_t − Φ̄_t, γ'))`` — no ε outside the root (§2, Alg. 1).

    Φ_t is the per-coordinate variance of the noise in ĝ_t, read from the step's
    :class:`~lightning_dp.mechanism.release.Release` (``noise_std² = (σC/B)²`` from
    the strategy's actual σ, C and global expected B). Φ̄_t is Φ averaged exactly
    like ĝ² is averaged into v: for Adam the bias-corrected EMA
    ``Σ_s (1-β2) β2^{t-s} Φ_s / (1-β2^t)`` (equal to Φ while Φ is constant, as in
    Alg. 1); for AdaGrad the sum ``Σ_s Φ_s``. The running average lives in the
    optimizer state (key ``"phi"``) and is checkpointed with it. When the variant
    is switched on at step t > 1 (e.g. ``AdamVariant(start_step=...)``), the past
    Φ_s are taken equal to the first observed one, since ``v`` already holds their
    noise.

    Args:
        gamma: the floor γ' inside the root (paper's official default 1e-8).
    """

    name: ClassVar[str] = "bias_corrected"

    def __init__(self, *, gamma: float = 1e-8) -> None:
        if not gamma > 0:
            raise ValueError(f"bias_corrected: gamma (γ') must be > 0, got {gamma}; the paper uses 1e-8 or 1e-9.")
        self.gamma = float(gamma)

    def denominator(
        self, p: Tensor, second_moment: Tensor, release: Optional[Release], average: AverageFn, eps: float
    ) -> Tensor:
        """``sqrt(max(v̂ − Φ̄, γ'))`` (Alg. 1 line 8; AdaGrad: ``sqrt(max(Σĝ² − ΣΦ, γ'))``)."""
        assert release is not None
        phi_bar = average("phi", noise_variance(p, release))
        return torch.clamp(second_moment - phi_bar, min=self.gamma).sqrt()
