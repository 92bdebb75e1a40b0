"""Clipping helpers shared by the engines (the interface itself is :mod:`lightning_dp.engine_api`).

An engine turns one forward + backward of a *mean* loss into the per-example clipped
statistics the mechanism needs (docs/algorithms.md, "The mechanism"):

    S   = Σ_i clip_C(s ⊙ g_i)          (always)
    S2  = Σ_i clip_C(s ⊙ g_i)²         (only when asked, for independent moments)
    ‖s ⊙ g_i‖ for every example         (norms before clipping; diagnostics)

How it gets there is its own business: materialise per-example gradients (Opacus
hooks, torch.func.vmap) or never materialise them (ghost clipping / book-keeping).
Engines are registered by name; ``DPStrategy(per_sample=name)`` picks one.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from lightning_dp.clipping.flat import EPSILON, FlatClipping, flat_factors
from lightning_dp.clipping.rule import ClipRule, _Unbounded, as_rule, finite_only
from lightning_dp.engine_api import (  # noqa: F401  (the interface, re-exported for the engines)
    ClippedBatch,
    GradSampleEngine,
    ParamMap,
    available_engines,
    make_engine,
    merge_clipped,
    register_engine,
    sums_finite,
)


def mean_over_views(grad_samples: Sequence[Tensor], views: int) -> list[Tensor]:
    """Per-row gradients ``[n·K, …]`` → per-example gradients ``[n, …]``: the mean over each example's K
    consecutive rows (its augmented views). Augmentation multiplicity (De et al. 2022, §3.1, eq. 2): the
    example's gradient is the mean of its views' gradients, clipped ONCE, so one example still moves the
    sum by at most C and the accounting is unchanged. ``views = 1`` returns the input."""
    if views == 1:
        return list(grad_samples)
    out = []
    for gs in grad_samples:
        if gs.shape[0] % views:
            raise ValueError(f"{gs.shape[0]} rows are not a multiple of {views} views per example")
        out.append(gs.view(gs.shape[0] // views, views, *gs.shape[1:]).mean(1))
    return out


_FLAT = (FlatClipping, _Unbounded)
"""The flat policies (min(1, C/‖g‖), C = ∞ included) whose factors :func:`clip_from_parts` takes in place."""


def clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """min(1, C / ‖g_i‖) per example (docs/algorithms.md, clip_C). Zero norms give 1."""
    return flat_factors(norms, max_grad_norm)


def clip_from_parts(sq_parts: Sequence[Tensor], max_grad_norm: Union[float, ClipRule],
                    padding: int = 0) -> tuple[Tensor, Tensor]:
    """(norms, clip factors) of n examples from their squared norms per part (layer, parameter), each ``[n]`` (or
    ``[L, n]`` for L stacked layers).

    ``max_grad_norm``: C (flat clipping), or a :class:`~lightning_dp.clipping.rule.ClipRule` whose
    policy takes one factor per example from its whole norm (flat, automatic, adaptive: not per parameter, every
    example its own unit); the factors are the policy's (:meth:`ClipRule.example_factors`).

    The sum over parts and the factor are taken in float64, the only place the norms are wider than the gradients:
    the bound ‖c_i g_i‖ ≤ C is a statement about the whole gradient, and a float32 sum of L parts carries a relative
    error up to L·2⁻²⁴ (10⁻⁵ at a few hundred layers) that would let c_i g_i exceed C by as much. Each part stays in
    its own dtype (a per-layer reduction is accurate to its own rounding); the n-vectors cost nothing. Returned in
    the parts' dtype, ready for the contractions: c_i ‖g_i‖ ≤ C(1 + 2⁻²⁴) in float32.

    ``padding``: the last ``padding`` rows are padding (fixed-shape batches): their factors are exactly 0, so
    Σ_i c_i g_i over the padded batch is the sum over its examples, whatever the padding rows hold."""
    rule = as_rule(max_grad_norm)
    if rule.per_parameter or rule.grouped:
        raise ValueError(f"clip_from_parts takes one whole norm per example; {rule.policy.describe()} with "
                         f"{'units of several examples' if rule.grouped else 'norms per parameter'} is "
                         "clip_and_sum_by_rule's")
    dtype, n = sq_parts[0].dtype, sq_parts[0].shape[-1]
    if all(s.dim() == 1 for s in sq_parts):  # one [L, n] stack (no view of each part)
        parts = torch.stack(list(sq_parts))
    else:
        parts = torch.cat([s if s.dim() == 2 else s[None] for s in sq_parts])
    norms = parts.sum(0, dtype=torch.float64).clamp_min_(0).sqrt_()
    if type(rule.policy) in _FLAT:
        # flat_factors then finite_only, in float64, in place: (C / (‖g‖ + ε)).clamp(max=1) is reciprocal then · C in
        # torch (Tensor.__rtruediv__), the same values; a norm of inf gets C · 0 = 0 (C = ∞: NaN), of NaN NaN: the
        # NaNs then 0, as finite_only makes them (no factor is ±inf after the clamp)
        factors = norms.add(EPSILON).reciprocal_().mul_(rule.policy.max_grad_norm).clamp_(max=1.0).nan_to_num_(0.0)
    else:
        factors = finite_only(rule.policy.factors(norms), norms)  # rule.example_factors(sq), norms taken once
    factors = factors.to(dtype)
    if padding:
        factors[n - padding:] = 0.0
    return norms.to(dtype), factors


def finite_rows(grad_samples: Sequence[Tensor], norms: Tensor) -> list[Tensor]:
    """The per-example gradients with the rows of examples whose norm is not finite set to 0 (their factor is 0,
    :func:`~lightning_dp.clipping.rule.finite_only`, but 0·inf is NaN in the sum): such an example adds exactly
    nothing. One check of the n norms when every one is finite."""
    bad = ~torch.isfinite(norms)
    if not bool(bad.any()):
        return list(grad_samples)
    return [torch.where(bad.view(-1, *[1] * (gs.dim() - 1)), torch.zeros((), dtype=gs.dtype, device=gs.device), gs)
            for gs in grad_samples]


def clip_and_sum_materialised(
    params: Sequence[nn.Parameter],
    grad_samples: Sequence[Tensor],
    max_grad_norm: Union[float, ClipRule],
    scale: Optional[ParamMap] = None,
    with_squares: bool = False,
    padding: int = 0,
) -> ClippedBatch:
    """Shared clipping for engines that materialise per-example gradients (``padding``: rows at the end that are
    padding, :attr:`GradSampleEngine.padding_rows`).

    ``grad_samples[k]`` has shape ``[b, *params[k].shape]``. Low-precision per-example
    gradients (bf16/fp16 autocast) are clipped in float32, so the clipped sum's
    sensitivity is C for the gradients actually computed. A clipping policy other than flat, or
    units of several examples, take :func:`clip_and_sum_by_rule`.
    """
    rule = as_rule(max_grad_norm)
    grad_samples = [gs.float() if gs.dtype in (torch.bfloat16, torch.float16) else gs for gs in grad_samples]
    if scale is not None:
        grad_samples = [gs * scale[p].unsqueeze(0) for p, gs in zip(params, grad_samples)]
    b = grad_samples[0].shape[0] if grad_samples else 0
    if b == 0:
        zeros = {p: torch.zeros_like(p) for p in params}
        squares = {p: torch.zeros_like(p) for p in params} if with_squares else None
        return ClippedBatch(zeros, squares, torch.zeros(0, device=params[0].device), 0)
    if not rule.is_flat_per_example:
        return clip_and_sum_by_rule(params, grad_samples, rule, with_squares, padding)
    norms, factors = clip_from_parts([torch.linalg.vector_norm(gs.reshape(b, -1), dim=1).square()
                                      for gs in grad_samples], rule, padding)  # no g² temporary
    grad_samples = finite_rows(grad_samples, norms)
    sums = {p: torch.einsum("b,b...->...", factors, gs) for p, gs in zip(params, grad_samples)}
    squares = None
    if with_squares:
        squares = {p: torch.einsum("b,b...->...", factors.pow(2), gs.pow(2)) for p, gs in zip(params, grad_samples)}
    return ClippedBatch(sums, squares, norms[:b - padding].detach(), b - padding)


def clip_and_sum_by_rule(params: Sequence[nn.Parameter], grad_samples: Sequence[Tensor], rule: ClipRule,
                         with_squares: bool = False, padding: int = 0) -> ClippedBatch:
    """:func:`clip_and_sum_materialised` for any :class:`~lightning_dp.clipping.rule.ClipRule`: each unit's
    summed gradient is formed (a sum over its examples' rows), its norms taken (per parameter when the policy
    clips per parameter) and the factors applied per example (per parameter). Squares are Σ_i f_i² g_i², the
    per-example second moment: refused for units of several examples (the private step does so).

    ``padding``: the last rows are padding (fixed-shape batches): their factors are exactly 0 and they are left out
    of the norms and the count. Only with every example its own unit (a padding row belongs to no unit)."""
    b = grad_samples[0].shape[0]
    if with_squares and rule.groups is not None:
        raise ValueError("squares of per-example gradients are not a unit's second moment: not with grouped units")
    if padding and rule.groups is not None:
        raise ValueError("padding rows (fixed_batch_size) belong to no unit: not with units of several examples")
    if rule.groups is None:
        units = grad_samples
    else:
        groups = rule.groups.to(grad_samples[0].device)
        count = rule.num_units()
        units = [gs.new_zeros((count, *gs.shape[1:])).index_add_(0, groups, gs) for gs in grad_samples]
    per_param = torch.stack([u.reshape(u.shape[0], -1).pow(2).sum(1) for u in units], dim=0)  # [P, u]
    sq = per_param if rule.per_parameter else per_param.sum(0)
    factors = rule.example_factors(sq)
    unit_sq = sq if rule.groups is None else sq[..., rule.groups.to(sq.device)]  # each row's unit's
    grad_samples = finite_rows(grad_samples, unit_sq if unit_sq.dim() == 1 else unit_sq.sum(0))
    if padding:
        factors = factors.clone()
        factors[..., b - padding:] = 0.0
        sq = sq[..., :b - padding]
    rows = factors if rule.per_parameter else factors.expand(len(params), b)
    sums = {p: torch.einsum("b,b...->...", f, gs) for p, f, gs in zip(params, rows, grad_samples)}
    squares = None
    if with_squares:
        squares = {p: torch.einsum("b,b...->...", f.pow(2), gs.pow(2)) for p, f, gs in zip(params, rows, grad_samples)}
    return ClippedBatch(sums, squares, rule.unit_norms(sq).detach(), b - padding)
