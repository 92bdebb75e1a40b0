"""Read m̂, v̂, Φ̄ and the applied update of one parameter from an optimizer's state.

Post-processing of the optimizer state (docs/algorithms.md §1–§2), no data: supports
:class:`~lightning_dp.optim.DPAdam` / :class:`~lightning_dp.optim.DPAdagrad` (any
variant) and ``torch.optim.Adam`` / ``AdamW`` / ``Adagrad``. For the DP optimizers
the divisor D(v̂) comes from the variant's own
:meth:`~lightning_dp.optim.preconditioner.Preconditioner.denominator`, called with a
read-only ``average`` so the optimizer state is left untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_dp.privacy.release import Release
from lightning_dp.optim.base import DPOptimizerBase
from lightning_dp.optim.preconditioner import noise_variance

Scalar = Union[Tensor, float]


@dataclass(frozen=True)
class ParamMoments:
    """One parameter's moments after step ``step`` (all shaped like the parameter).

    Attributes:
        m: m̂ = m/(1−β1^t) for Adam; the last gradient ĝ for AdaGrad.
        v: v̂ = v/(1−β2^t) for Adam; the running sum for AdaGrad.
        phi: Φ̄, the noise part of ``v`` that bias correction subtracts (§2): the
            variant's tracked average (state ``"phi"``) when it keeps one, else the
            last release's Φ (Adam) or t·Φ (AdaGrad, Φ assumed constant); 0 without
            a release.
        update: the update direction applied, m̂ / D(v̂) (AdaGrad: ĝ / D(G)), without
            the learning rate.
        step: t.
    """

    m: Tensor
    v: Tensor
    phi: Scalar
    update: Tensor
    step: int


def family_of(optimizer: Optimizer) -> Optional[str]:
    """``"adam"``, ``"adagrad"`` or ``None`` (an optimizer without a second moment)."""
    if isinstance(optimizer, DPOptimizerBase):
        return optimizer.family
    if isinstance(optimizer, torch.optim.Adam) or isinstance(optimizer, torch.optim.AdamW):
        return "adam"
    if isinstance(optimizer, torch.optim.Adagrad):
        return "adagrad"
    return None


def release_phi(p: Tensor, release: Optional[Release]) -> Scalar:
    """Φ of the last step for ``p``: ``noise_std²`` (or ``(noise_std/scale)²``), 0 without a release."""
    return 0.0 if release is None else noise_variance(p, release)


def mean_phi(params: Sequence[Tensor], release: Release) -> float:
    """Φ of the release averaged over the coordinates of ``params`` (= ``noise_std²`` without a scale)."""
    if release.scale is None:
        return float(release.noise_std) ** 2
    total, count = 0.0, 0
    for p in params:
        phi = _full(release_phi(p, release))
        total += float(phi.sum()) if isinstance(phi, Tensor) else phi * p.numel()
        count += p.numel()
    return total / count if count else float(release.noise_std) ** 2


def param_moments(
    optimizer: Optimizer, group: dict[str, Any], p: Tensor, release: Optional[Release]
) -> Optional[ParamMoments]:
    """The moments of ``p`` (``None`` before its first step or for an unsupported optimizer)."""
    family = family_of(optimizer)
    state = optimizer.state.get(p, {})
    if family == "adam" and "exp_avg_sq" in state:
        return _gathered(_adam(optimizer, group, p, state, release))
    if family == "adagrad" and "sum" in state and int(_step(state)) > 0 and p.grad is not None:
        return _gathered(_adagrad(optimizer, group, p, state, release))
    return None


def _gathered(moments: ParamMoments) -> ParamMoments:
    """``moments`` with every sharded tensor (a ``DTensor`` of ``DPShardedStrategy``) gathered to its full size:
    a collective every rank joins, one parameter at a time."""
    fields = (moments.m, moments.v, moments.phi, moments.update)
    if not any(_is_sharded(t) for t in fields):
        return moments
    return ParamMoments(*(_full(t) for t in fields), moments.step)


def _is_sharded(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: Any) -> Any:
    """A sharded tensor gathered to its full size (a collective every rank joins); anything else as is."""
    return t.full_tensor() if _is_sharded(t) else t


def _step(state: dict[str, Any]) -> int:
    step = state.get("step", 0)
    return int(step.item() if isinstance(step, Tensor) else step)


def _adam(optimizer: Optimizer, group: dict[str, Any], p: Tensor, state: dict[str, Any],
          release: Optional[Release]) -> ParamMoments:
    t = _step(state)
    beta1, beta2 = group["betas"]
    m_hat = state["exp_avg"] / (1.0 - beta1**t)
    v_hat = state["exp_avg_sq"] / (1.0 - beta2**t)

    def read_average(key: str, value: Scalar) -> Scalar:
        return state[key] / (1.0 - beta2**t) if key in state else value

    phi = read_average("phi", release_phi(p, release))
    if group.get("amsgrad") and "max_exp_avg_sq" in state:
        denom = (state["max_exp_avg_sq"] / (1.0 - beta2**t)).sqrt() + group["eps"]
    else:
        denom = _denominator(optimizer, p, v_hat, release, read_average, group["eps"])
    return ParamMoments(m_hat, v_hat, phi, m_hat / denom, t)


def _adagrad(optimizer: Optimizer, group: dict[str, Any], p: Tensor, state: dict[str, Any],
             release: Optional[Release]) -> ParamMoments:
    t = _step(state)
    grad = p.grad
    if group.get("weight_decay", 0):
        grad = grad + p.detach() * group["weight_decay"]  # θ after the step: an approximation

    def read_average(key: str, value: Scalar) -> Scalar:
        return state[key] if key in state else value * float(t)

    phi = read_average("phi", release_phi(p, release))
    denom = _denominator(optimizer, p, state["sum"], release, read_average, group["eps"])
    return ParamMoments(grad, state["sum"], phi, grad / denom, t)


def _denominator(optimizer: Optimizer, p: Tensor, second_moment: Tensor, release: Optional[Release],
                 read_average: Any, eps: float) -> Tensor:
    """D(v̂): the variant's own rule for DP optimizers, else torch's ``√v̂ + ε``."""
    if isinstance(optimizer, DPOptimizerBase):
        precond = optimizer.preconditioner
        if release is not None or not precond.requires_release:
            return precond.denominator(p, second_moment, release, read_average, eps)
    return second_moment.sqrt() + eps
