"""Per-example gradients of a layer whose output is its weight times an operand the weight does not touch.

The capture verifies the form from autograd's record at every call
(:func:`~lightning_dp.mechanism.validators.elementwise_scale.scaled_operand`: RMSNorm-style layers of model
libraries, ``return self.weight * y``) and keeps ``y``; example i's weight gradient is then

    g_i = n · Σ_t δ_{i,t} ⊙ y_{i,t}        ``[n, d]``, summed over the layer's calls

(δ: the mean loss's output gradient, hence the factor n; Σ_t over every position of example i). One product and one
reduction per call, where the per-example vmap ran the layer's forward and backward again for every example.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from lightning_dp.mechanism.capture import LayerCalls


def scale_served(calls: LayerCalls) -> bool:
    """Whether every call of the layer was verified as ``weight ⊙ y`` on the step's examples in dimension 0."""
    return bool(calls.records) and all(rec.scaled is not None and not rec.flattened for rec in calls.records)


def scale_layer_grads(calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
    """Per-example grads ``[n, d]`` of the layer's weight (module docstring); zeros for a call no gradient reached."""
    (name, weight), = wanted
    total = weight.new_zeros(n, weight.numel())
    with torch.no_grad():
        for rec in calls.records:
            if rec.grad_out is None:
                continue
            y, d = rec.scaled, rec.grad_out
            prod = (d * y).reshape(n, -1, y.shape[-1]).sum(1)  # in the product's promoted dtype, as autograd's
            total += prod.to(weight.dtype)
    return {name: (total * n).view(n, *weight.shape)}
