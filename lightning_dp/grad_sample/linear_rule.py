"""``nn.Linear`` and Hugging Face's ``Conv1D``: ghost norms and book-keeping (the ghost engine's Linear rule).

A layer linear in its weight W ∈ R^{out×in} has example i's weight gradient G_i = n Σ_t δ_{i,t} a_{i,t}ᵀ, with a the
layer input, δ the output gradient of the *mean* loss (hence the factor n = batch size) and t over tokens. Li et al.
("Large language models can be strong DP learners", §4, ghost clipping) give its norm without forming G_i:

    ‖G_i‖² = Σ_{t,t'} (a_t·a_t')(δ_t·δ_t') · n²         cost n·T²·(in+out)
    ‖G_i‖² = ‖δ_i‖² ‖a_i‖² · n²                          T = 1 (plain Linear)

and Bu et al.'s book-keeping turns the clipped sum into one contraction of the stored (a, δ), with no second
backward:

    Σ_i c_i G_i = (c ⊙ n δ)ᵀ a,     c_i = min(1, C/‖g_i‖)   (docs/algorithms.md, clip_C)

The cheaper of the ghost norm and materialising G_i (cost n·T·in·out, memory n·in·out) is chosen. Scale-then-privatize
(docs/algorithms.md §4) needs ‖s⊙G_i‖: exact in closed form for T = 1 (Σ_{o,j} s²_{oj} δ²_o a²_j); otherwise the
layer materialises. Σ_i c_i s⊙G_i = s ⊙ Σ_i c_i G_i stays one contraction. Hugging Face's ``Conv1D`` (GPT-2) is a
Linear layer with its weight stored [in, out]. Book-keeping proper: ``nn.Linear`` runs a forward whose backward skips
the weight and bias gradients (:func:`_linear_forward`). The vmap engine replays these layers (``for_vmap`` off).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.capture.activations import LayerCalls
from lightning_dp.grad_sample.capture.own_tensors import own
from lightning_dp.grad_sample.ghost_tied import LowRank, Representation
from lightning_dp.grad_sample.layer_stats import (
    LayerStats,
    WeightBiasStats,
    bookkept_product,
    gram_sq_norms,
    prefer_ghost,
    sq_norms,
)
from lightning_dp.grad_sample.rules import LayerRule, register_rule


class LinearFormStats(WeightBiasStats):
    """A layer with per-example weight grad n Σ_t δ_t a_tᵀ (+ bias grad n Σ_t δ_t).

    ``a``: [n, T, in]; ``d``: [n, T, out], the mean-loss output gradient; ``k`` = n multiplies
    it (folded into the norms and the clip factors instead of copying ``d``).
    """

    def __init__(self, a: Tensor, d: Tensor, k: float, weight: Optional[Tensor], bias: Optional[Tensor],
                 scale: Optional[ParamMap], with_squares: bool, transposed: bool = False) -> None:
        self.a, self.d, self.k, self.weight, self.bias = a, d, k, weight, bias
        self.transposed = transposed  # the weight is stored [in, out] (Hugging Face's Conv1D)
        sw = None if scale is None or weight is None else scale[weight]
        self.sw = None if sw is None else (sw.t() if transposed else sw).reshape(d.shape[2], a.shape[2])
        self.sb = None if scale is None or bias is None else scale[bias]
        self.G: Optional[Tensor] = None
        n, T = a.shape[0], a.shape[1]
        self.single = T == 1 and self.sw is None  # one position, unscaled weight: the vectors a_i, δ_i themselves
        if self.single and weight is not None and bias is not None and self.sb is None:
            # ‖G_i‖² + ‖db_i‖² = ‖δ_i‖² (‖a_i‖² + 1) (Li et al., T = 1): both norms once; the bias's gradient: δ_i
            d1 = self.db = d[:, 0]
            d2 = torch.linalg.vector_norm(d1, dim=1).square_()
            self.weight_sq = d2 * torch.linalg.vector_norm(a[:, 0], dim=1).square_()
            self.sq_norms = (self.weight_sq + d2).mul_(k * k)
            return
        sq: Optional[Tensor] = None  # 0 + x is x: the first part is taken as it is
        if weight is not None:
            self.weight_sq = sq = self._weight_sq_norms(T, with_squares)
        if bias is not None:
            self.db = d.sum(1) if self.sb is None else d.sum(1) * self.sb
            sq = self.db.pow(2).sum(1) if sq is None else sq + self.db.pow(2).sum(1)
        self.sq_norms = (a.new_zeros(n) if sq is None else sq) * (k * k)

    def _weight_sq_norms(self, T: int, with_squares: bool) -> Tensor:
        a, d, sw = self.a, self.d, self.sw
        if T == 1:
            a1, d1 = a[:, 0], d[:, 0]
            if sw is None:
                return torch.linalg.vector_norm(a1, dim=1).pow(2) * torch.linalg.vector_norm(d1, dim=1).pow(2)
            return ((d1 * d1) @ (sw * sw) * (a1 * a1)).sum(1)
        if sw is None and not with_squares and prefer_ghost(T, a.shape[2], d.shape[2]):
            return gram_sq_norms(a, d)
        G = torch.bmm(d.transpose(1, 2), a)
        self.G = G if sw is None else G * sw
        return sq_norms(self.G)

    def _as_weight(self, w: Tensor) -> Tensor:
        return w.t() if self.transposed else w.reshape(self.weight.shape)

    def _low_rank(self) -> Optional[Representation]:
        if self.sw is not None:
            return None
        return LowRank(self.a, self.d, self.k) if self.transposed else LowRank(self.d, self.a, self.k)

    def _bookkept_weight_sum(self, c: Tensor) -> Tensor:
        """Σ_i c_i G_i without G: one book-keeping contraction (c ⊙ δ)ᵀa over all n·T tokens (T = 1: on the vectors
        δ_i, a_i themselves, without the views of the general product)."""
        if self.single:
            a, d = self.a[:, 0], self.d[:, 0]
            return (d * c[:, None]).t() @ a if d.shape[1] <= a.shape[1] else d.t() @ (a * c[:, None])
        w = bookkept_product(self.a, self.d, c)
        return w if self.sw is None else w * self.sw

    def _bookkept_weight_squares(self, c2: Tensor) -> Tensor:
        """Σ_i c_i² G_i² without G: only for T = 1, where G_i² = (δ_i²)(a_i²)ᵀ."""
        w = (self.d[:, 0].pow(2) * c2[:, None]).t() @ self.a[:, 0].pow(2)
        return w if self.sw is None else w * self.sw.pow(2)


def _as_float(t: Tensor, like: Tensor) -> Tensor:
    return t.to(like.dtype) if t.dtype != like.dtype else t


def _cat(parts: list[Tensor], dim: int = 1) -> Tensor:
    """Concatenate calls of one layer along the token axis (no copy for a single call)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def linear_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """nn.Linear: inputs [n, *, in] flattened to [n, T, in]; calls concatenated along T."""
    m = calls.module
    w = own(m, "weight")
    a = _cat([_as_float(r.args[0], w).reshape(n, -1, m.in_features) for r in calls.records])
    d = _cat([_as_float(r.grad_out, w).reshape(n, -1, m.out_features) for r in calls.records])
    return LinearFormStats(a, d, n, wanted.get("weight"), wanted.get("bias"), scale, with_squares)


def is_hf_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): y = x W + b with W stored [in, out]; a Linear in all but layout."""
    if type(m).__name__ != "Conv1D":  # the name first: the dispatch asks it of every layer, every step
        return False
    w = getattr(m, "weight", None)
    return isinstance(w, Tensor) and w.dim() == 2 and getattr(m, "nf", None) == w.shape[1]


def hf_conv1d_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """Hugging Face's Conv1D: the Linear rule on [n, T, in] inputs, weight transposed."""
    m = calls.module
    d_in, d_out = m.weight.shape
    a = _cat([_as_float(r.args[0], m.weight).reshape(n, -1, d_in) for r in calls.records])
    d = _cat([_as_float(r.grad_out, m.weight).reshape(n, -1, d_out) for r in calls.records])
    return LinearFormStats(a, d, n, wanted.get("weight"), wanted.get("bias"), scale, with_squares, transposed=True)


class _LinearInputGradOnly(torch.autograd.Function):
    """F.linear whose backward computes only the input gradient (book-keeping, Bu et al.):
    the weight/bias gradients come from :class:`LinearFormStats`, so the ordinary backward
    leaves ``p.grad`` untouched instead of spending a matmul on the non-private gradient.

    For a call whose input does not require grad (a first layer), whose output must still require it (the capture's
    hook on it receives δ). A call whose input requires grad takes torch's own ``F.linear`` on the detached weight and
    bias instead (:func:`_linear_forward`): the same forward and input gradient, without this Function's Python
    dispatch in forward and backward (≈ 40–50 µs per layer and step on this repository's CPU)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        # ctx-style forward (no setup_context): autograd then skips an inspect.signature per call.
        ctx.save_for_backward(weight)
        ctx.x_dtype = x.dtype
        if x.dim() <= 2:
            return F.linear(x, weight, bias)
        # F.linear on [..., d] returns a view of its 2-D product, and autograd forbids in-place ops on a view
        # a custom Function returns (`q = self.q(h); q /= s`: Longformer, LED, Swinv2). Reshaped the way
        # aten::linear's own autograd path does it (_unsafe_view: same storage, not tracked as a view).
        out = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx, g: Tensor):
        (weight,) = ctx.saved_tensors
        gx = (g @ weight.to(g.dtype)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return gx, None, None


def _linear_forward(self: nn.Linear, input: Tensor) -> Tensor:  # noqa: A002  (nn.Linear's own name: keyword calls)
    weight, bias = own(self, "weight"), own(self, "bias")  # read as self.weight, self.bias (own_tensors.py)
    if torch._C._are_functorch_transforms_active():  # replayed inside vmap (a PEFT DoRA layer calls its base layer)
        return F.linear(input, weight, bias)
    if input.requires_grad:  # torch's own linear on the parameters detached: its backward is the input gradient only
        return F.linear(input, weight.detach(), None if bias is None else bias.detach())
    return _LinearInputGradOnly.apply(input, weight, bias)  # a first layer: its output must require grad


@register_rule
class LinearRule(LayerRule):
    """``nn.Linear`` (the class itself: a subclass may change its forward) and Hugging Face's ``Conv1D``."""

    name = "linear"
    for_vmap = False  # the vmap engine replays them

    def serves(self, m: nn.Module) -> bool:
        """``type(m) is nn.Linear`` or :func:`is_hf_conv1d`."""
        return type(m) is nn.Linear or is_hf_conv1d(m)

    def closed_form(self, m: nn.Module) -> bool:
        """Both: served under FSDP2."""
        return True

    def stats(self, calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
              with_squares: bool) -> LayerStats:
        """:func:`linear_stats`, or :func:`hf_conv1d_stats` (weight stored transposed)."""
        if type(calls.module) is nn.Linear:
            return linear_stats(calls, wanted, n, scale, with_squares)
        return hf_conv1d_stats(calls, wanted, n, scale, with_squares)

    def input_grad_only_forward(self, m: nn.Module) -> Optional[Callable]:
        """``nn.Linear``: :func:`_linear_forward` (Hugging Face's Conv1D keeps its own)."""
        return _linear_forward if type(m) is nn.Linear else None
