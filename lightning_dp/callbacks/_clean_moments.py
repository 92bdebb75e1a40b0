"""NON-PRIVATE: Adam's moments of the clean clipped mean ḡ_t = S_t/B (opt-in diagnostics only).

The seed's Table 1 / Figure 2 compare the private v^p with the v^c Adam would keep
without noise. :class:`CleanMoments` keeps those EMAs from the strategy's
:class:`~lightning_dp.diagnostics.StepDiagnostics` (never from per-example
tensors), with each parameter's own optimizer betas:
``m^c ← β1 m^c + (1−β1) ḡ``, ``v^c ← β2 v^c + (1−β2) ḡ²`` and the bias corrections
``/(1−β^t)``, t counted from the first folded step (docs/algorithms.md §1). For AdaGrad,
``v^c = Σ ḡ²`` and ``m^c = ḡ``. Anything derived from these is NOT covered by the DP
guarantee.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import Tensor


class CleanMoments:
    """EMAs (Adam) or sums (AdaGrad) of the clean clipped mean, per parameter.

    Args:
        settings: per parameter, ``(family, beta1, beta2)``; family ``"adam"`` or
            ``"adagrad"`` (betas unused for AdaGrad).
    """

    def __init__(self, settings: Mapping[Tensor, tuple[str, float, float]]) -> None:
        self._settings = dict(settings)
        self._m: dict[Tensor, Tensor] = {}
        self._v: dict[Tensor, Tensor] = {}
        self.steps = 0

    def fold(self, clean_mean: Mapping[Tensor, Tensor]) -> None:
        """Fold one step's clean clipped mean ḡ_t into m^c and v^c."""
        self.steps += 1
        for p, (family, beta1, beta2) in self._settings.items():
            g = clean_mean.get(p)
            if g is None:
                g = torch.zeros_like(p)
            g = g.detach().to(p.dtype)
            if p not in self._v:
                self._m[p], self._v[p] = torch.zeros_like(g), torch.zeros_like(g)
            if family == "adagrad":
                self._m[p] = g.clone()
                self._v[p].add_(g * g)
            else:
                self._m[p].lerp_(g, 1.0 - beta1)
                self._v[p].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)

    def moments(self, p: Tensor) -> Optional[tuple[Tensor, Tensor]]:
        """``(m̂^c, v̂^c)`` of ``p`` (bias-corrected for Adam), or ``None`` before the first fold."""
        if p not in self._v:
            return None
        family, beta1, beta2 = self._settings[p]
        if family == "adagrad":
            return self._m[p], self._v[p]
        t = self.steps
        return self._m[p] / (1.0 - beta1**t), self._v[p] / (1.0 - beta2**t)

    def state_dict(self, names: Mapping[Tensor, str]) -> dict[str, Any]:
        """m^c, v^c (keyed by parameter name) and the step count, for a checkpoint."""
        return {
            "steps": self.steps,
            "m": {names[p]: m.detach().cpu().clone() for p, m in self._m.items() if p in names},
            "v": {names[p]: v.detach().cpu().clone() for p, v in self._v.items() if p in names},
        }

    def load_state_dict(self, state: Mapping[str, Any], params: Mapping[str, Tensor]) -> None:
        """Restore :meth:`state_dict` onto the parameters of the same names; raises ``ValueError``
        when a saved name is missing or its shape differs (a different model)."""
        for key in ("m", "v"):
            for name, value in state[key].items():
                p = params.get(name)
                if p is None or p not in self._settings or tuple(p.shape) != tuple(value.shape):
                    raise ValueError(f"CleanMoments: saved moment {name!r} does not match this model's parameters.")
        self.steps = int(state["steps"])
        for name, value in state["m"].items():
            p = params[name]
            self._m[p] = value.to(device=p.device, dtype=p.dtype).clone()
            self._v[p] = state["v"][name].to(device=p.device, dtype=p.dtype).clone()

