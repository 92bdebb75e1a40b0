"""Automatic clipping (Bu, Wang, Zha & Karypis 2023, "Automatic Clipping: Differentially Private Deep Learning
Made Easier and Stronger", AUTO-S, eq. (4.1)): every unit's gradient normalised,

    ĝ_u = C · g_u / (‖g_u‖ + γ),        ‖ĝ_u‖ = C ‖g_u‖ / (‖g_u‖ + γ) < C,

so the sensitivity is C for any γ > 0 and no threshold needs tuning (the learning rate absorbs C). γ
(the stability constant, 0.01 in the paper) keeps small gradients from being blown up to norm C.
"""

from __future__ import annotations

from torch import Tensor

from lightning_dp.clipping.policy import ClippingPolicy, positive


class AutomaticClipping(ClippingPolicy):
    """Scale each unit's gradient by C/(‖g_u‖ + γ) (Bu et al. 2023, AUTO-S): sensitivity C.

    Args:
        max_grad_norm: C.
        gamma: γ > 0, the stability constant.
    """

    def __init__(self, max_grad_norm: float = 1.0, gamma: float = 0.01) -> None:
        self._bound = positive(max_grad_norm, "max_grad_norm (C)")
        self.gamma = positive(gamma, "gamma (γ)")

    def factors(self, norms: Tensor) -> Tensor:
        """C / (‖g_u‖ + γ) (Bu et al. 2023, eq. 4.1)."""
        return self._bound / (norms + self.gamma)

    def describe(self) -> str:
        """One line for the log."""
        return f"automatic clipping C·g/(‖g‖ + {self.gamma:g}) at C = {self._bound:g}"
