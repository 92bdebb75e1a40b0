"""DP-AdamBC: subtract the DP noise variance from the second moment (docs/algorithms.md §2).

Paper: Tang et al., "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias Correction)", AAAI 2024,
Algorithm 1.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Optional, Union

import torch
from torch import Tensor

from lightning_dp.privacy.release import Release
from lightning_dp.optim.preconditioner import AverageFn, Preconditioner, noise_variance


#: default floor of v̂ − Φ̄ as a fraction of Φ̄. The paper's own settings put γ' at about 0.04 Φ (CIFAR10: γ' = 1e-8,
#: Φ = (1·1/2048)² ≈ 2.4e-7; SNLI: γ' = 1e-9, Φ ≈ 2.4e-8); on the digits CNN and a digits LSTM at ε = 3 (docs/adam.md,
#: "Private Adam") 0.1 was as accurate as 0.04 at lr 3e-3 and better at the common DP-Adam lr 1e-2 (90 vs 86 %,
#: 79 vs 76 %), where 0.01 lost 10–20 points
GAMMA_PHI = 0.1

#: a floor below this fraction of Φ̄ lets a coordinate whose v̂ − Φ̄ is at the floor step ≈ 0.23/√(γ'/Φ̄) times the
#: learning rate (m̂ of pure noise has standard deviation ≈ 0.23 √Φ at β1 = 0.9): 2.3× at 1e-2, 23× at 1e-4; measured,
#: 1e-2 and below lost 10–80 points at lr 1e-2 (docs/adam.md), so such a floor is warned about
EXPLOSIVE_GAMMA_PHI = 1e-2


class BiasCorrected(Preconditioner):
    """Divisor ``sqrt(max(v̂_t − Φ̄_t, γ'))`` — no ε outside the root (§2, Alg. 1).

    Φ_t is the per-coordinate variance of the noise in ĝ_t, read from the step's
    :class:`~lightning_dp.privacy.release.Release` (``noise_std² = (σC/B)²`` from
    the strategy's actual σ, C and global expected B). Φ̄_t is Φ averaged exactly
    like ĝ² is averaged into v: for Adam the bias-corrected EMA
    ``Σ_s (1-β2) β2^{t-s} Φ_s / (1-β2^t)`` (equal to Φ while Φ is constant, as in
    Alg. 1); for AdaGrad the sum ``Σ_s Φ_s``. The running average lives in the
    optimizer state (key ``"phi"``) and is checkpointed with it. When the variant
    is switched on at step t > 1 (e.g. ``AdamVariant(start_step=...)``), the past
    Φ_s are taken equal to the first observed one, since ``v`` already holds their
    noise.

    The floor γ' decides how far a coordinate whose signal is below the noise (v̂ − Φ̄ ≤ γ', about half of them
    early in training) may step: ``lr · m̂ / √γ'``, where m̂ is then mostly noise of size ≈ 0.23 √Φ̄. By default it
    is relative, ``γ' = gamma_phi · Φ̄``: such a coordinate steps ≈ 0.23/√gamma_phi times lr (0.73 lr at 0.1),
    whatever σ, C and B. An absolute ``gamma`` (the paper's form; it tuned 1e-8 and 1e-9 at Φ ≈ 2.4e-7 and 2.4e-8)
    is used as given, with a warning when it is below :data:`EXPLOSIVE_GAMMA_PHI` · Φ̄ at the first step (1e-8 at the
    digits job's Φ ≈ 7e-4 lets such steps be ~2,000× lr: training diverges or stalls at chance).

    Args:
        gamma: an absolute floor γ' inside the root (default: none, the relative floor).
        gamma_phi: the relative floor ``γ' = gamma_phi · Φ̄`` used without ``gamma`` (default :data:`GAMMA_PHI`).
    """

    name: ClassVar[str] = "bias_corrected"

    def __init__(self, *, gamma: Optional[float] = None, gamma_phi: float = GAMMA_PHI) -> None:
        if gamma is not None and not gamma > 0:
            raise ValueError(f"bias_corrected: gamma (γ') must be > 0, got {gamma}; or leave it out for the relative "
                             f"floor gamma_phi · Φ̄ (default gamma_phi = {GAMMA_PHI}).")
        if not gamma_phi > 0:
            raise ValueError(f"bias_corrected: gamma_phi must be > 0, got {gamma_phi}; the default is {GAMMA_PHI}.")
        if gamma is None and gamma_phi < EXPLOSIVE_GAMMA_PHI:
            warnings.warn(_explosive_message(f"gamma_phi = {gamma_phi:g}", gamma_phi), UserWarning, stacklevel=2)
        self.gamma = None if gamma is None else float(gamma)
        self.gamma_phi = float(gamma_phi)
        self._checked = False

    def hparams(self) -> dict[str, Any]:
        """The floor in use: ``{"gamma": γ'}`` (absolute) or ``{"gamma_phi": …}`` (relative)."""
        return {"gamma": self.gamma} if self.gamma is not None else {"gamma_phi": self.gamma_phi}

    def describe(self) -> str:
        """The floor in words, for the log line that announces the variant."""
        if self.gamma is not None:
            return f"γ' = {self.gamma:g} (absolute)"
        return f"γ' = {self.gamma_phi:g}·Φ̄ (relative to the noise variance)"

    def denominator(
        self, p: Tensor, second_moment: Tensor, release: Optional[Release], average: AverageFn, eps: float
    ) -> Tensor:
        """``sqrt(max(v̂ − Φ̄, γ'))`` (Alg. 1 line 8; AdaGrad: ``sqrt(max(Σĝ² − ΣΦ, γ'))``), γ' absolute or
        ``gamma_phi · Φ̄``."""
        assert release is not None
        phi_bar = average("phi", noise_variance(p, release))
        if self.gamma is None:
            return torch.maximum(second_moment - phi_bar, self.gamma_phi * phi_bar).sqrt()
        if not self._checked:
            self._checked = True
            _warn_if_explosive(self.gamma, phi_bar)
        return torch.clamp(second_moment - phi_bar, min=self.gamma).sqrt()


def _warn_if_explosive(gamma: float, phi_bar: Union[Tensor, float]) -> None:
    """One warning when an absolute γ' is far below Φ̄ (:data:`EXPLOSIVE_GAMMA_PHI`)."""
    phi = float(torch.as_tensor(phi_bar).max())
    if phi > 0 and gamma < EXPLOSIVE_GAMMA_PHI * phi:
        what = f"gamma = {gamma:g} is {gamma / phi:.1e} of the noise variance Φ̄ = {phi:.3g}"
        warnings.warn(_explosive_message(what, gamma / phi) + f" (here gamma ≥ {EXPLOSIVE_GAMMA_PHI * phi:.2g}).",
                      UserWarning, stacklevel=2)


def _explosive_message(what: str, ratio: float) -> str:
    """Why a floor of ``ratio`` · Φ̄ makes steps explode, and the fix."""
    return (f"bias_corrected: {what}: a coordinate whose v̂ − Φ̄ falls to the floor (about half of them early on) steps "
            f"≈ {0.23 / ratio ** 0.5:,.0f}× the learning rate, so training can diverge or stall at chance. Leave gamma "
            f"out (the floor is then gamma_phi · Φ̄, {GAMMA_PHI:g} by default), or keep the floor ≥ "
            f"{EXPLOSIVE_GAMMA_PHI:g} · Φ̄")
