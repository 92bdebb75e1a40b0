"""``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: per-example gradients in closed form, reduced during backward.

With x̂ the call's input normalised as the layer normalises it (without its affine weights) and δ the mean loss's
output gradient (hence the factor n), example i's gradients are per-example reductions

    g_i(weight) = n Σ δ_i ⊙ x̂_i        g_i(bias) = n Σ δ_i

over every dimension but the normalised shape's (LayerNorm, RMSNorm) or the channels' (GroupNorm): ``[n, C]``, far
smaller than the input and output gradient they replace. The ghost engine folds each call into them as the call's
output gradient arrives (:attr:`~.rules.LayerRule.reduces`), releasing both during backward; the vmap engine replays
these layers (``for_vmap`` off; ``nn.RMSNorm``'s torch forward, one multiplication by its weight, takes the
elementwise-scale rule there, :mod:`.elementwise_scale`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.capture.activations import LayerCalls, Record
from lightning_dp.grad_sample.capture.own_tensors import own
from lightning_dp.grad_sample.layer_stats import LayerStats, MaterialisedStats
from lightning_dp.grad_sample.rules import LayerRule, register_rule

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def _as_float(t: Tensor, like: Tensor) -> Tensor:
    return t.to(like.dtype) if t.dtype != like.dtype else t


def norm_layer_record_grads(m: nn.Module, rec: Record) -> dict[str, Tensor]:
    """LayerNorm / GroupNorm / RMSNorm, one call: per-example grads n Σ δ⊙x̂ (weight) and
    n Σ δ (bias) of its trainable parameters, n = dimension 0 of the output gradient.

    The ghost engine reduces these layers during backward (:meth:`LayerCalls.reduce`): the
    grads are [n, C], far smaller than the input and output gradient they replace."""
    weight = own(m, "weight")
    like = weight if weight is not None else rec.grad_out
    x, d = _as_float(rec.args[0], like), _as_float(rec.grad_out, like)
    xhat = normalised(m, x, rec)
    if isinstance(m, nn.GroupNorm):
        # channels in dimension 1 of what the layer saw: [n, C, …], or [n, k, C, …] for a call on flattened rows
        # ([n·k, C, …] recorded per example), normalised row by row
        flat = rec.flattened and x.dim() > 2
        dims = tuple(k for k in range(1, x.dim()) if k != (2 if flat else 1))
    else:
        dims = tuple(range(1, x.dim() - len(m.normalized_shape)))
    n = d.shape[0]
    grads = {}
    for pname, p in m._parameters.items():  # a plain norm layer's own (direct_trainable, without its module walk)
        if p is None or not p.requires_grad:
            continue
        g = d * xhat if pname == "weight" else d
        grads[pname] = (g.sum(dims) if dims else g) * n
    return grads


def normalised(m: nn.Module, x: Tensor, rec: Record) -> Tensor:
    """The call's input ``x`` normalised as the layer normalised it, without its affine weights: (x − μ)·(1/σ) from
    the statistics torch's kernel saved in the forward (:func:`~.capture.activations.norm_stats`; on CPU the same
    values as normalising again, 1.4× (group norm) to 4.7× (layer norm, [64, 64, 128]) faster), or normalised again
    where the call kept none or kept them in another dtype or layout, or x is not float32/float64 (RMSNorm always)."""
    flat = rec.flattened and x.dim() > 2
    stats = rec.norm_stats
    if stats is not None and stats[0].dtype == x.dtype == stats[1].dtype and x.dtype in (torch.float32, torch.float64):
        mean, rstd = stats
        if isinstance(m, nn.GroupNorm):
            if not flat and mean.shape == rstd.shape == (x.shape[0], m.num_groups):
                grouped = x.reshape(x.shape[0], m.num_groups, -1)
                return ((grouped - mean[..., None]) * rstd[..., None]).view(x.shape)
        elif isinstance(m, nn.LayerNorm):
            k = len(m.normalized_shape)
            shape = (*x.shape[:x.dim() - k], *[1] * k)
            if mean.shape == rstd.shape == shape:
                return (x - mean) * rstd
    if isinstance(m, nn.GroupNorm):
        return F.group_norm(x.flatten(0, 1) if flat else x, m.num_groups, eps=m.eps).view(x.shape)
    if isinstance(m, nn.LayerNorm):
        return F.layer_norm(x, m.normalized_shape, eps=m.eps)
    return F.rms_norm(x, m.normalized_shape, eps=m.eps)


def is_plain_norm(m: nn.Module) -> bool:
    """LayerNorm / GroupNorm / RMSNorm with the torch forward (a subclass that permutes inside its
    forward, timm's channels-first LayerNorm2d, normalises another axis: per-layer vmap instead)."""
    return any(isinstance(m, kind) and type(m).forward is kind.forward for kind in _NORMS)


@register_rule
class NormRule(LayerRule):
    """LayerNorm / GroupNorm / RMSNorm with torch's forward (module docstring): the ghost engine's stats are the
    calls reduced during backward plus any still held (:meth:`~.rules.LayerRule.grads`)."""

    name = "norm"
    reduces = True
    for_vmap = False  # the vmap engine replays them

    def serves(self, m: nn.Module) -> bool:
        """:func:`is_plain_norm`."""
        return is_plain_norm(m)

    def closed_form(self, m: nn.Module) -> bool:
        """Served under FSDP2."""
        return True

    def record_grads(self, m: nn.Module, rec: Record) -> dict[str, Tensor]:
        """:func:`norm_layer_record_grads`."""
        return norm_layer_record_grads(m, rec)

    def stats(self, calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
              with_squares: bool) -> LayerStats:
        """The grads reduced during backward, as they are, when every call was reduced and each wanted parameter
        has them (the common case: no copy of the reductions, no gradient mode switched); else the general
        :meth:`~.rules.LayerRule.stats`."""
        reduced = calls.reduced
        if calls.records or any(key not in reduced for key in wanted):
            return super().stats(calls, wanted, n, scale, with_squares)
        return MaterialisedStats({p: reduced[key] for key, p in wanted.items()}, scale)

    def dense(self, calls: LayerCalls, wanted: dict[str, Tensor],
              n: int) -> Optional[list[tuple[Tensor, Tensor, float]]]:
        """The grads reduced during backward (n already in them), when every call was reduced."""
        reduced = calls.reduced
        if calls.records or any(key not in reduced for key in wanted):
            return None
        return [(p, reduced[key], 1.0) for key, p in wanted.items()]
