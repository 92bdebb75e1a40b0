"""The clipped sum a policy prescribes, computed the plain way from each example's own gradient: what the first
step's probe compares an engine's clipped sum with (:mod:`~lightning_dp.validators.probe`).

    Σ_u c_u g_u,   g_u = (1/m_u) Σ_{i∈u} g_i   (a unit per example unless ``groups``),
    c_u = the policy's factors of ‖g_u‖ (or of each ‖g_{u,p}‖ for a per-parameter policy).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.clipping.policy import ClippingPolicy


def pseudo_units(count: int) -> Tensor:
    """Units of two consecutive examples (the last alone when ``count`` is odd): [0, 0, 1, 1, …]."""
    return torch.arange(count, dtype=torch.long) // 2


def reference_sums(policy: ClippingPolicy, gradients: Sequence[Sequence[Tensor]],
                   groups: Optional[Tensor] = None) -> list[Tensor]:
    """Σ_u c_u g_u per parameter, in float64, from ``gradients[i][k]``: example i's gradient of parameter k."""
    labels = list(range(len(gradients))) if groups is None else groups.tolist()
    units: dict[int, list[int]] = {}
    for i, unit in enumerate(labels):
        units.setdefault(unit, []).append(i)
    count = len(gradients[0]) if gradients else 0
    means = [[sum(gradients[i][k].double() for i in members) / len(members) for k in range(count)]
             for members in units.values()]
    per_param = torch.tensor([[float(g[k].norm()) for g in means] for k in range(count)], dtype=torch.float64)
    if policy.per_parameter:
        factors = policy.parameter_factors(per_param)  # [P, u]
    else:
        factors = policy.factors(per_param.pow(2).sum(0).sqrt()).expand(count, len(means))
    return [sum(float(factors[k, u]) * g[k] for u, g in enumerate(means)) for k in range(count)]
