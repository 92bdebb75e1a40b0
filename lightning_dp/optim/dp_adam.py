"""DPAdam: Adam / AdamW whose second moment follows a DP variant (docs/algorithms.md §1–§5)."""

from __future__ import annotations

from typing import Any, Optional, Union

from torch import Tensor

from lightning_dp.privacy.release import Release
from lightning_dp.optim.base import DPOptimizerBase, Params, as_tensor_like


def ema_average(state: dict[str, Any], key: str, value: Tensor, beta2: float, step: int) -> Tensor:
    """Fold ``value`` into the EMA ``state[key]`` like Adam's v; return it bias-corrected.

    ``state[key] ← β2·state[key] + (1−β2)·value`` and the result is
    ``state[key] / (1 − β2^t)``, i.e. ``Σ_s (1-β2) β2^{t-s} x_s / (1-β2^t)``
    (docs/algorithms.md §2). A key first seen at step t > 1 is back-filled as if
    ``value`` had been observed at steps 1..t-1.
    """
    if key not in state:
        state[key] = value * (1.0 - beta2 ** (step - 1))
    state[key] = state[key] * beta2 + value * (1.0 - beta2)
    return state[key] / (1.0 - beta2**step)


class DPAdam(DPOptimizerBase):
    """Adam (``decoupled_weight_decay=True``: AdamW) with a DP second-moment variant.

    Update for parameter θ at step t with gradient ĝ (``p.grad``) — §1:
    ``m ← β1 m + (1−β1) ĝ``; ``v ← β2 v + (1−β2) x`` with ``x`` the variant's
    statistic (ĝ² unless stated); ``θ ← θ − η · (m/(1−β1^t)) / D(v/(1−β2^t))``.

    ==========================  ==================================  ===============================
    variant                     x (averaged into v)                 D(v̂)
    ==========================  ==================================  ===============================
    ``post_processing`` §1      ĝ²                                  √v̂ + ε
    ``bias_corrected`` §2       ĝ²                                  sqrt(max(v̂ − Φ̄, γ')), γ' = 0.1·Φ̄
    ``independent_moments`` §3  released second moment ĝ2          sqrt(max(v̂, gamma))
    ``scale_then_privatize`` §4 ĝ² (ĝ noised in scaled space)       √v̂ + ε
    ``noiseless`` §5 (NOT DP)   (clean clipped mean)²               √v̂ + ε
    ==========================  ==================================  ===============================

    Weight decay λ: coupled (λθ added to ĝ, as ``torch.optim.Adam``) or decoupled
    (θ ← θ(1 − ηλ) first, as ``torch.optim.AdamW``). State per parameter
    (``exp_avg``, ``exp_avg_sq``, ``step`` — the keys torch uses — plus the
    variant's ``phi``/``scale``) lives in ``self.state`` and is checkpointed by
    ``state_dict()``. ``eps`` is unused by the variants with a ``gamma``.

    Every variant but ``post_processing`` needs the mechanism's
    :class:`~lightning_dp.privacy.release.Release` before each step: under
    ``DPStrategy`` that is automatic; in a plain loop call
    :meth:`mechanism_request` before the forward pass, privatise, then
    :meth:`observe_release` before :meth:`step`::

        import torch
        from lightning_dp.privacy.release import Release
        from lightning_dp.optim import DPAdam

        model = torch.nn.Linear(4, 1)
        opt = DPAdam(model.parameters(), lr=1e-3, variant="bias_corrected")   # floor γ' = 0.1·Φ̄
        sigma, C, B = 1.0, 1.0, 64                        # B: the EXPECTED batch size
        for x, y in batches:                              # Poisson-sampled batches
            opt.zero_grad()
            request = opt.mechanism_request()             # here: nothing extra
            per_example = [torch.autograd.grad(torch.nn.functional.mse_loss(model(xi[None]), yi[None]),
                                               list(model.parameters())) for xi, yi in zip(x, y)]
            norms = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in per_example])
            factors = (C / (norms + 1e-6)).clamp(max=1.0)
            for k, p in enumerate(model.parameters()):
                s = sum(f * gs[k] for f, gs in zip(factors, per_example))
                p.grad = (s + sigma * C * torch.randn_like(p)) / B
            opt.observe_release(Release(noise_std=sigma * C / B, expected_batch_size=B,
                                        noise_multiplier=sigma, max_grad_norm=C))
            opt.step()

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay, decoupled_weight_decay: as ``torch.optim.Adam``.
        variant: a name from :func:`~lightning_dp.optim.variants.variant_names`.
        **variant_hparams: the variant's hyperparameters (e.g. ``gamma``, ``eps_s``).
    """

    family = "adam"
    second_moment_key = "exp_avg_sq"

    def __init__(
        self,
        params: Params,
        lr: Union[float, Tensor] = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        variant: str = "post_processing",
        **variant_hparams: Any,
    ) -> None:
        if not float(lr) >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}.")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}.")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}.")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults, variant, variant_hparams)

    def _update(self, p: Tensor, group: dict[str, Any], release: Optional[Release]) -> None:
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = p.new_zeros(p.shape)
            state["exp_avg_sq"] = p.new_zeros(p.shape)
        step = state["step"] = int(state["step"]) + 1
        lr, (beta1, beta2), wd = float(group["lr"]), group["betas"], group["weight_decay"]
        grad, decay = p.grad, None
        if wd != 0:
            if group.get("decoupled_weight_decay", False):
                p.mul_(1.0 - lr * wd)
            else:
                decay = p.detach() * wd
                grad = grad + decay
        precond = self.preconditioner
        state["exp_avg"].lerp_(grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).add_(precond.statistic(p, grad, release, decay), alpha=1.0 - beta2)
        v_hat = state["exp_avg_sq"] / (1.0 - beta2**step)

        def average(key: str, value: Union[Tensor, float]) -> Tensor:
            return ema_average(state, key, as_tensor_like(value, p), beta2, step)

        denom = precond.denominator(p, v_hat, release, average, group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1.0 - beta1**step))
