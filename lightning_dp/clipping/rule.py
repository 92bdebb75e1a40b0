"""What an engine is told to do with one physical batch: the clipping policy, and which examples form one unit.

Engines compute squared norms of the units' *summed* gradients S_u = Σ_{i∈u} g_i (per example: S_i = g_i; per
user: the user's records in the batch), whole or per parameter tensor (:attr:`ClipRule.per_parameter`), and
ask :meth:`ClipRule.example_factors` for one factor per example (per parameter): the clipped sum is then
Σ_i f_i g_i, the same contraction every engine already makes for flat clipping.

A unit's gradient is the MEAN of its records' gradients, g_u = S_u / m_u (m_u: its records in this step), so a
user's gradient has the scale of one example's whatever its number of records; the policy clips g_u
(sensitivity C: removing the user removes c_u g_u, of norm ≤ C), and f_i = c_u / m_u for each record i of u.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from lightning_dp.clipping.flat import FlatClipping
from lightning_dp.clipping.policy import ClippingPolicy


@dataclass(frozen=True)
class ClipRule:
    """The policy and the units of one physical batch.

    Attributes:
        policy: the clipping policy.
        groups: ``[n]`` int64, the unit of each example, numbered 0…u−1 (``None``: every example its own unit).
    """

    policy: ClippingPolicy
    groups: Optional[Tensor] = None

    @property
    def per_parameter(self) -> bool:
        """Whether norms and factors are per parameter tensor (``[P, u]``)."""
        return self.policy.per_parameter

    @property
    def grouped(self) -> bool:
        """Whether some unit holds several examples (norms must be of sums across examples)."""
        return self.groups is not None

    @property
    def is_flat_per_example(self) -> bool:
        """Flat clipping of single examples: the engines' original path."""
        return self.groups is None and type(self.policy) is FlatClipping

    def num_units(self) -> int:
        """u, the number of units in the batch."""
        assert self.groups is not None
        return int(self.groups.max()) + 1 if self.groups.numel() else 0

    def counts(self, like: Tensor) -> Tensor:
        """m_u ``[u]``: the examples of each unit, as ``like``'s dtype and device."""
        assert self.groups is not None
        groups = self.groups.to(like.device)
        return torch.bincount(groups, minlength=self.num_units()).to(like.dtype)

    def unit_norms(self, sq_norms: Tensor) -> Tensor:
        """‖g_u‖ ``[u]`` (whole gradient) from the squared norms of the units' sums ``[u]`` or ``[P, u]``."""
        sq = sq_norms.sum(0) if sq_norms.dim() == 2 else sq_norms
        norms = sq.clamp_min(0).sqrt()
        return norms if self.groups is None else norms / self.counts(norms).clamp_min(1)

    def example_factors(self, sq_norms: Tensor) -> Tensor:
        """f_i ``[n]`` (or ``[P, n]``) from the squared norms of the units' sums ``[u]`` (or ``[P, u]``):
        Σ_i f_i g_i = Σ_u c_u g_u with g_u the unit's mean gradient and c_u the policy's factor."""
        norms = sq_norms.clamp_min(0).sqrt()
        if self.groups is not None:
            counts = self.counts(norms).clamp_min(1)
            norms = norms / counts
        factors = finite_only(
            self.policy.parameter_factors(norms) if self.per_parameter else self.policy.factors(norms), norms)
        if self.groups is None:
            return factors
        return (factors / counts)[..., self.groups.to(factors.device)]


def finite_only(factors: Tensor, norms: Tensor) -> Tensor:
    """``factors`` with 0 wherever the unit's norm is not finite (docs/algorithms.md, "Non-finite gradients").

    A record whose gradient holds an inf or a NaN (an inf feature, an overflow in the forward) has a norm of inf or
    NaN; min(1, C/NaN) is NaN and would make the whole release NaN exactly when that record is sampled, which shows
    it was. Its factor is 0 instead: the map g_u ↦ 0 is a per-unit function bounded by C like clipping, so the
    sensitivity and the accounting are unchanged. The engines also keep 0·inf out of their sums
    (:func:`~lightning_dp.grad_sample.base.clip_and_sum_materialised`, the ghost engine's capture)."""
    return torch.where(torch.isfinite(norms), factors, torch.zeros((), dtype=factors.dtype, device=factors.device))


def as_rule(bound: Union[float, ClipRule]) -> ClipRule:
    """``bound`` as a rule: a float C is flat clipping of single examples at C (``math.inf``: unclipped)."""
    if isinstance(bound, ClipRule):
        return bound
    return ClipRule(_Unbounded() if bound == float("inf") else FlatClipping(float(bound)))


class _Unbounded(FlatClipping):
    """Flat clipping at C = ∞ (no clipping: the probe's reference passes, non-private baselines)."""

    def __init__(self) -> None:
        self._bound = float("inf")
