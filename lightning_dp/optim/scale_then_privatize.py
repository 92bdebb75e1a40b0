"""Scale-then-privatize (docs/algorithms.md §4; design-principles Alg. 8; DP² for τ > 1).

The variant supplies a per-coordinate scale ``s_t = 1 / (sqrt(v_{t-1}) + ε_s)``
from the optimizer's raw second moment of the previous step; the strategy clips
``s_t ⊙ g_i``, adds the noise in that scaled space and writes the *unscaled* ĝ to
``p.grad``; the optimizer then takes its ordinary step on ĝ. ``s_t`` depends only
on earlier private outputs, so privacy equals DP-SGD's.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from lightning_dp.privacy.release import MechanismRequest
from lightning_dp.optim.preconditioner import Preconditioner, SteppingOptimizer


class ScaleThenPrivatize(Preconditioner):
    """Requests ``s = 1/(sqrt(v_prev) + eps_s)``; the update itself is plain Adam/AdaGrad (§4).

    ``v_prev`` is the raw (not bias-corrected) Adam ``v`` — AdaGrad's running sum —
    after the previous step; at t = 1 it is 0 and ``s`` is uniform ``1/eps_s``.
    With ``refresh_every = τ > 1`` the scale is recomputed only every τ steps and
    held fixed in between (delayed preconditioners, Li et al. 2023). The scale and
    the step it was computed at live in the optimizer state (``"scale"``,
    ``"scale_step"``), so they are checkpointed.

    Note that C now lives in the scaled space (``‖s ⊙ g_i‖`` is clipped) and must be
    tuned for it.

    Args:
        eps_s: ε_s, the stabiliser of the scale (bounds ``s`` by ``1/eps_s``).
        refresh_every: τ, steps between scale refreshes.
    """

    name: ClassVar[str] = "scale_then_privatize"

    def __init__(self, *, eps_s: float = 1e-3, refresh_every: int = 1) -> None:
        if not eps_s > 0:
            raise ValueError(f"scale_then_privatize: eps_s must be > 0 (it bounds the scale by 1/eps_s), got {eps_s}.")
        if int(refresh_every) != refresh_every or refresh_every < 1:
            raise ValueError(f"scale_then_privatize: refresh_every must be an integer >= 1, got {refresh_every}.")
        self.eps_s = float(eps_s)
        self.refresh_every = int(refresh_every)

    def request(self, optimizer: SteppingOptimizer) -> MechanismRequest:
        """``MechanismRequest(scale={p: s_t})`` for every parameter (idempotent within a step)."""
        scale = {p: self._scale(p, optimizer.state[p], optimizer.second_moment_key)
                 for group in optimizer.param_groups for p in group["params"]}
        return MechanismRequest(scale=scale)

    def _scale(self, p: Tensor, state: dict, key: str) -> Tensor:
        step = int(state.get("step", 0))
        if "scale" not in state or step - int(state["scale_step"]) >= self.refresh_every:
            v_prev = state.get(key)
            if v_prev is None:
                state["scale"] = torch.full_like(p, 1.0 / self.eps_s, memory_format=torch.preserve_format)
            else:
                state["scale"] = 1.0 / (v_prev.sqrt() + self.eps_s)
            state["scale_step"] = step
        return state["scale"]
