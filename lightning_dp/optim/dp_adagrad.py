"""DPAdagrad: AdaGrad whose accumulator follows a DP variant (docs/algorithms.md §1–§5, AdaGrad forms)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_dp.privacy.release import Release
from lightning_dp.optim.base import DPOptimizerBase, Params, as_tensor_like


def sum_average(state: dict[str, Any], key: str, value: Tensor, step: int) -> Tensor:
    """Fold ``value`` into the running sum ``state[key]`` like AdaGrad's accumulator.

    A key first seen at step t > 1 is back-filled with ``(t−1)·value``.
    """
    if key not in state:
        state[key] = value * float(step - 1)
    state[key] = state[key] + value
    return state[key]


class DPAdagrad(DPOptimizerBase):
    """AdaGrad with a DP variant of its accumulator (§1–§5, AdaGrad analogues).

    Step t (as ``torch.optim.Adagrad``): ``G ← G + x`` with ``x`` the variant's
    statistic; ``θ ← θ − η/(1 + (t−1)·lr_decay) · ĝ / D(G)``.

    ===========================  ===============================  ===============================
    variant                      x (summed into G)                D(G)
    ===========================  ===============================  ===============================
    ``post_processing``          ĝ²                               √G + ε
    ``bias_corrected``           ĝ²                               sqrt(max(G − Σ_s Φ_s, gamma))
    ``independent_moments``      released second moment ĝ2        sqrt(max(G, gamma))
    ``scale_then_privatize``     ĝ² (noised in scaled space;       √G + ε
                                 scale 1/(√G_{t−1} + eps_s))
    ``noiseless`` (NOT DP)       (clean clipped mean)²            √G + ε
    ===========================  ===============================  ===============================

    Weight decay is coupled (λθ added to ĝ), as in torch. ``G`` starts at
    ``initial_accumulator_value``. State keys are torch's (``sum``, ``step``) plus
    the variant's. Release handling and the plain-loop recipe are as in
    :class:`~lightning_dp.optim.dp_adam.DPAdam`.
    """

    family = "adagrad"
    second_moment_key = "sum"

    def __init__(
        self,
        params: Params,
        lr: Union[float, Tensor] = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        variant: str = "post_processing",
        **variant_hparams: Any,
    ) -> None:
        for name, value in (("lr", float(lr)), ("lr_decay", lr_decay), ("weight_decay", weight_decay),
                            ("initial_accumulator_value", initial_accumulator_value), ("eps", eps)):
            if not value >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {value}.")
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps)
        super().__init__(params, defaults, variant, variant_hparams)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if "sum" not in state:
            state["step"] = 0
            state["sum"] = torch.full_like(p, float(group["initial_accumulator_value"]),
                                           memory_format=torch.preserve_format)
        return state

    def _update(self, p: Tensor, group: dict[str, Any], release: Optional[Release]) -> None:
        state = self._init_state(p, group)
        step = state["step"] = int(state["step"]) + 1
        grad, decay = p.grad, None
        if group["weight_decay"] != 0:
            decay = p.detach() * group["weight_decay"]
            grad = grad + decay
        precond = self.preconditioner
        state["sum"].add_(precond.statistic(p, grad, release, decay))

        def average(key: str, value: Union[Tensor, float]) -> Tensor:
            return sum_average(state, key, as_tensor_like(value, p), step)

        denom = precond.denominator(p, state["sum"], release, average, group["eps"])
        clr = float(group["lr"]) / (1.0 + (step - 1) * group["lr_decay"])
        p.addcdiv_(grad, denom, value=-clr)
