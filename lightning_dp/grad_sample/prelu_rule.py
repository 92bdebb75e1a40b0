"""``nn.PReLU``: per-example gradients in closed form, reduced during backward.

PReLU is y = max(0, x) + a_c · min(0, x), with one slope a (``num_parameters=1``) or one per channel c (dimension 1
of the input). ∂y/∂a_c = min(0, x) at the positions of channel c, so example i's gradient, for the mean loss's output
gradient δ (hence the factor n), is a per-example reduction

    g_i[c] = n Σ_{positions of channel c} min(0, x_i) · δ_i        (one slope: Σ over every element of example i)

``[n, C]`` per call, summed over calls. The ghost engine folds each call into it as the call's output gradient
arrives (its input and output gradient released then), as for the normalisation layers; the vmap engine takes it
instead of replaying the layer per example. A call on flattened examples (``[n·k, C, …]``, recorded ``[n, k, C, …]``)
sums example i's k rows too.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.grad_sample.capture.activations import Record
from lightning_dp.grad_sample.rules import LayerRule, register_rule


def prelu_record_grads(m: nn.PReLU, rec: Record) -> dict[str, Tensor]:
    """One call's per-example slope gradients ``{"weight": [n, num_parameters]}`` (module docstring)."""
    like = m.weight
    x, d = rec.args[0], rec.grad_out
    x = x.to(like.dtype) if x.dtype != like.dtype else x
    d = d.to(like.dtype) if d.dtype != like.dtype else d
    n = d.shape[0]
    g = x.clamp(max=0) * d
    if m.num_parameters == 1:
        return {"weight": g.reshape(n, -1).sum(1, keepdim=True) * n}
    channel = 2 if rec.flattened else 1  # the channel dimension of the recorded input
    dims = tuple(k for k in range(1, g.dim()) if k != channel)
    return {"weight": (g.sum(dims) if dims else g) * n}


class _PReLUInputGradOnly(torch.autograd.Function):
    """F.prelu whose backward computes only the input gradient, δ ⊙ (1 where x > 0, else a): the slopes' gradient
    comes from the rule (book-keeping), and torch's PReLU backward, which reduces it in the same kernel, costs 2–5×
    the elementwise product on CPU."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return F.prelu(x, weight)

    @staticmethod
    def backward(ctx, g: Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        x, weight = ctx.saved_tensors
        a = weight.to(g.dtype)
        if a.numel() > 1:  # one slope per channel: dimension 1
            a = a.view(1, -1, *[1] * (x.dim() - 2))
        slope = (x > 0).to(g.dtype).mul_(1 - a).add_(a)
        return g * slope, None


def _prelu_forward(self: nn.PReLU, input: Tensor) -> Tensor:  # noqa: A002  (the module's own argument name)
    if torch._C._are_functorch_transforms_active():  # replayed inside torch.func
        return F.prelu(input, self.weight)
    return _PReLUInputGradOnly.apply(input, self.weight)


@register_rule
class PReLURule(LayerRule):
    """``nn.PReLU`` and subclasses keeping its forward (module docstring)."""

    name = "prelu"
    reduces = True

    def serves(self, m: nn.Module) -> bool:
        """torch's PReLU forward (a subclass that transforms its slope first keeps the per-example replay)."""
        return isinstance(m, nn.PReLU) and type(m).forward is nn.PReLU.forward

    def record_grads(self, m: nn.Module, rec: Record) -> dict[str, Tensor]:
        """:func:`prelu_record_grads`."""
        return prelu_record_grads(m, rec)

    def input_grad_only_forward(self, m: nn.Module) -> Optional[Callable]:
        """torch's own class (not subclasses): a forward whose backward skips the slopes' gradient."""
        return _prelu_forward if type(m) is nn.PReLU else None
