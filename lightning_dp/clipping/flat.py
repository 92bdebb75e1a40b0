"""Flat clipping (Abadi et al. 2016, DP-SGD): every unit's whole gradient scaled by min(1, C/‖g‖)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_dp.clipping.policy import ClippingPolicy, positive

EPSILON = 1e-6
"""Added to the norm in the factor: C/(‖g‖ + ε) < C/‖g‖, so ‖c g‖ < C strictly, and a zero gradient gets 1."""


def flat_factors(norms: Tensor, bound: float) -> Tensor:
    """min(1, C / ‖g_u‖) per unit (docs/algorithms.md, clip_C). Zero norms give 1."""
    return (bound / (norms + EPSILON)).clamp(max=1.0)


class FlatClipping(ClippingPolicy):
    """The default policy: g_u ↦ g_u · min(1, C/‖g_u‖); sensitivity C.

    Args:
        max_grad_norm: C.
    """

    def __init__(self, max_grad_norm: float = 1.0) -> None:
        self._bound = positive(max_grad_norm, "max_grad_norm (the clipping norm C)")

    def factors(self, norms: Tensor) -> Tensor:
        """min(1, C/‖g_u‖)."""
        return flat_factors(norms, self._bound)

    def describe(self) -> str:
        """One line for the log."""
        return f"flat clipping at C = {self._bound:g}"

    def refusal(self, **settings: Any) -> None:
        """Flat clipping runs everywhere."""
        return None
