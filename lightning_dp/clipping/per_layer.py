"""Per-layer clipping: each parameter tensor's part of a unit's gradient clipped to its own budget C_p.

McMahan et al. 2018 ("A general approach to adding differential privacy to iterative training procedures",
§3, per-layer clipping; Opacus' ``clipping="per_layer"``): with g_{u,p} unit u's gradient of parameter
tensor p,

    ĝ_{u,p} = g_{u,p} · min(1, C_p / ‖g_{u,p}‖),        ‖ĝ_u‖² = Σ_p ‖ĝ_{u,p}‖² ≤ Σ_p C_p² = C²,

so the Gaussian mechanism's sensitivity stays C (noise σC) when √(Σ_p C_p²) = C. By default every one of the
P trainable tensors gets C_p = C/√P; ``budgets`` names each tensor's C_p instead.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.clipping.flat import EPSILON
from lightning_dp.clipping.policy import ClippingPolicy, positive

RELATIVE_TOLERANCE = 1e-6
"""How closely √(Σ_p C_p²) of named budgets must equal C."""


class PerLayerClipping(ClippingPolicy):
    """Clip each parameter tensor p of a unit's gradient to C_p, with √(Σ_p C_p²) = C: sensitivity C.

    Args:
        max_grad_norm: C, the total bound (optional when ``budgets`` are given: then √(Σ_p C_p²)).
        budgets: C_p by parameter name (``model.named_parameters()``), one for every trainable parameter, with
            √(Σ_p C_p²) = C; ``None`` (default): C_p = C/√P for each of the P trainable tensors.

    Example:
        >>> policy = PerLayerClipping(max_grad_norm=1.0)          # C_p = 1/√P
        >>> policy = PerLayerClipping(budgets={"net.0.weight": 0.8, "net.0.bias": 0.6})  # C = 1.0
    """

    per_parameter = True

    def __init__(self, max_grad_norm: Optional[float] = None, budgets: Optional[Mapping[str, float]] = None) -> None:
        if max_grad_norm is None and budgets is None:
            raise ValueError("PerLayerClipping needs max_grad_norm (C, shared as C/√P) or budgets (C_p by name)")
        self.budgets = None if budgets is None else {str(k): positive(v, f"budgets[{k!r}]") for k, v in budgets.items()}
        total = None if self.budgets is None else math.sqrt(sum(c * c for c in self.budgets.values()))
        self._bound = positive(max_grad_norm if max_grad_norm is not None else total, "max_grad_norm (C)")
        if total is not None and not math.isclose(total, self._bound, rel_tol=RELATIVE_TOLERANCE):
            raise PrivacyConfigurationError(
                f"PerLayerClipping: the budgets give √(Σ C_p²) = {total:.6g}, not max_grad_norm = {self._bound:g}: "
                f"the sensitivity would be {total:.6g}. Scale every budget by {self._bound / total:.6g}, or drop "
                "max_grad_norm (C is then √(Σ C_p²)).")
        self._names: Optional[list[str]] = None

    def _set_bound(self, bound: float) -> None:
        scale = float(bound) / self._bound
        if self.budgets is not None:
            self.budgets = {k: v * scale for k, v in self.budgets.items()}
        super()._set_bound(bound)

    def bind(self, names: Sequence[str]) -> None:
        """Check that named budgets cover exactly the trainable parameters ``names``."""
        self._names = list(names)
        if self.budgets is None:
            return
        missing = [n for n in names if n not in self.budgets]
        unknown = [n for n in self.budgets if n not in set(names)]
        if missing or unknown:
            parts = ([f"no budget for {', '.join(missing[:6])}{' …' if len(missing) > 6 else ''}"] if missing else []) \
                + ([f"budgets for parameters that are not trainable: {', '.join(unknown[:6])}"] if unknown else [])
            raise PrivacyConfigurationError(
                "PerLayerClipping(budgets=...) must name every trainable parameter once (model.named_parameters()): "
                + "; ".join(parts) + ". Give every name, or budgets=None for C_p = C/√P.")

    def budget_vector(self, count: int, like: Tensor) -> Tensor:
        """C_p for the ``count`` parameters in the engine's order ``[P]``."""
        if self.budgets is None:
            return torch.full((count,), self._bound / math.sqrt(max(count, 1)), dtype=like.dtype, device=like.device)
        if self._names is None or len(self._names) != count:
            raise RuntimeError("PerLayerClipping with named budgets must be bound to the model's parameters first")
        return torch.tensor([self.budgets[n] for n in self._names], dtype=like.dtype, device=like.device)

    def parameter_factors(self, norms: Tensor) -> Tensor:
        """min(1, C_p / ‖g_{u,p}‖) for norms ``[P, u]``."""
        bounds = self.budget_vector(norms.shape[0], norms)
        return (bounds[:, None] / (norms + EPSILON)).clamp(max=1.0)

    def describe(self) -> str:
        """One line for the log."""
        shared = "C/√P each" if self.budgets is None else "named budgets"
        return f"per-layer clipping at C = {self._bound:g} ({shared})"

    def refusal(self, *, second_moment: bool, **settings: Any) -> Optional[str]:
        """Also refused: an optimizer asking for independent second moments (their clipping is per unit)."""
        if second_moment:
            return ("PerLayerClipping does not serve optimizers that release a second moment (independent_moments): "
                    "use flat clipping with them")
        return super().refusal(second_moment=second_moment, **settings)
