"""Per-example gradients of a layer whose output is elementwise-affine in its parameters: w ⊙ y + b.

The capture verifies the form from autograd's record at every call
(:func:`~lightning_dp.validators.elementwise_scale.scaled_operand`: RMSNorm-style layers of model
libraries, ``return self.weight * y``; global layer norms, ``self.weight * (x - mean) / std + self.bias`` with weight
and bias [C, 1] on [B, C, T]) and keeps y's factors; example i's gradients are then

    g_i(w) = n · Σ_{positions w is broadcast over} δ_i ⊙ y_i        g_i(b) = n · Σ_{positions b is broadcast over} δ_i

summed over the layer's calls (δ: the mean loss's output gradient, hence the factor n; the positions: every dimension
of the output but the examples' along which the parameter's operand has size 1). A few products and one reduction
per call, where the per-example vmap ran the layer's forward and backward again for every example.

Both engines take them (:class:`ElementwiseScaleRule`, last in the registry's precedence: a layer is of this family
only by its calls, verified at each): the ghost engine materialised, the vmap engine under the calls' autocast, as
its replay would run.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from lightning_dp.grad_sample.capture.activations import LayerCalls
from lightning_dp.grad_sample.rules import LayerRule, register_rule
from lightning_dp.validators.elementwise_scale import ScaledOperand


def scale_served(calls: LayerCalls) -> bool:
    """Whether every call of the layer was verified as ``w ⊙ y + b`` on the step's examples in dimension 0."""
    return bool(calls.records) and all(rec.scaled is not None and not rec.flattened for rec in calls.records)


def per_example_sum(t: Tensor, shape: torch.Size) -> Tensor:
    """``t`` ``[n, *out]`` summed, example by example, over the dimensions along which an operand of ``shape``
    (padded on the left to t's rank) is broadcast: ``[n, shape.numel()]``."""
    padded = (1,) * (t.dim() - len(shape)) + tuple(shape)
    dims = [j for j in range(1, t.dim()) if padded[j] == 1 and t.shape[j] != 1]
    return (t.sum(dims, keepdim=True) if dims else t).reshape(t.shape[0], -1)


def call_grads(op: ScaledOperand, d: Tensor) -> dict[Tensor, Tensor]:
    """One call's per-example gradients ``{parameter: [n, numel]}`` (without the factor n), for output gradient d,
    in the product's promoted dtype (as autograd's)."""
    out: dict[Tensor, Tensor] = {}
    if op.weight is not None:
        t = d
        for u in op.operands:
            t = t * u
        for s in op.divisors:
            t = t / s
        out[op.weight] = per_example_sum(t, op.weight_shape)
    if op.bias is not None:
        out[op.bias] = per_example_sum(d, op.bias_shape)
    return out


def scale_layer_grads(calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
    """Per-example grads ``[n, *p.shape]`` of the layer's ``wanted`` parameters (module docstring); zeros for a call no
    gradient reached and for a parameter no verified call used."""
    total = {p: p.new_zeros(n, p.numel()) for _, p in wanted}
    with torch.no_grad():
        for rec in calls.records:
            if rec.grad_out is None:
                continue
            for p, g in call_grads(rec.scaled, rec.grad_out).items():
                if p in total:
                    total[p] += g.to(p.dtype)
    return {name: (total[p] * n).view(n, *p.shape) for name, p in wanted}


@register_rule
class ElementwiseScaleRule(LayerRule):
    """Any layer whose every call was verified as ``w ⊙ y + b`` (module docstring)."""

    name = "elementwise_scale"
    vmap_autocast = True  # as the vmap engine took these grads before the registry

    def serves(self, m: nn.Module) -> bool:
        """No layer by its class alone: :meth:`serves_calls` reads the calls' verification."""
        return False

    def serves_calls(self, calls: LayerCalls) -> bool:
        """:func:`scale_served`."""
        return scale_served(calls)

    def grads(self, calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
        """:func:`scale_layer_grads` (the ghost engine's stats: these, materialised)."""
        return scale_layer_grads(calls, wanted, n)
