"""``nn.Embedding``: ghost norms (or a scatter) and book-keeping (the ghost engine's Embedding rule).

Example i's gradient of the table is n Σ_t onehot(x_t) δ_tᵀ (δ the mean loss's output gradient, hence the factor n;
``padding_idx`` rows get none). Its squared norm without forming it (ghost norm):

    ‖G_i‖² = n² Σ_{t,t'} [x_t = x_t'] (s²_{x_t} ⊙ δ_t)·δ_t'        cost n·T²·d, an [n, T, T] buffer

exact with scale-then-privatize's s too; or the per-example tables scattered into [n, V, d] when that is cheaper and
small (:func:`prefer_ghost_embedding`) or squares are wanted. The clipped sum is one ``index_add_`` of c ⊙ δ. A layer
with ``scale_grad_by_freq`` (the gradient depends on the batch's counts) or a subclass is replayed per example. The
vmap engine replays these layers (``for_vmap`` off).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.capture.activations import LayerCalls
from lightning_dp.grad_sample.ghost_tied import Dense, Lookup, Representation
from lightning_dp.grad_sample.layer_stats import LayerStats, sq_norms
from lightning_dp.grad_sample.rules import LayerRule, register_rule


def prefer_ghost_embedding(T: int, V: int) -> bool:
    """Embedding: ghost norm (n·T²·d multiply-adds, an [n, T, T] buffer) unless scattering
    into [n, V, d] is both cheaper and small: T² > 16·V (one scattered element costs about as
    much as 16–20 multiply-adds; measured on CPU, V = 64–256, T = 64) and V ≤ 8·T (the
    scatter buffer at most 8× the output gradient). A 50k vocabulary at T = 512 thus takes the
    ghost norm (a [n, V, d] buffer would be 9.9 GB at n = 64, d = 768); position tables
    (V = T) scatter."""
    return T * T <= 16 * V or V > 8 * T


class EmbeddingStats(LayerStats):
    """nn.Embedding: per-example grad n Σ_t onehot(x_t) δ_tᵀ. Ghost norm
    Σ_{t,t'} [x_t = x_t'] (s²_{x_t} ⊙ δ_t)·δ_t' (exact with scale), or scatter into [n, V, d]
    when :func:`prefer_ghost_embedding` says so (or squares are wanted)."""

    def __init__(self, idx: Tensor, d: Tensor, weight: Tensor, scale: Optional[ParamMap], with_squares: bool) -> None:
        self.idx, self.d, self.weight = idx, d, weight
        self.s = None if scale is None else scale[weight]
        self.G: Optional[Tensor] = None
        n, T = idx.shape
        V = weight.shape[0]
        if with_squares or not prefer_ghost_embedding(T, V):
            G = self._scatter()
            self.G = G if self.s is None else G * self.s
            self.sq_norms = sq_norms(self.G)
        else:
            ds = d if self.s is None else d * self.s.pow(2)[idx]
            same = (idx[:, :, None] == idx[:, None, :]).to(d.dtype)
            self.sq_norms = (torch.bmm(ds, d.transpose(1, 2)) * same).sum((1, 2))

    def _scatter(self) -> Tensor:
        n, T = self.idx.shape
        V, dim = self.weight.shape
        flat = (torch.arange(n, device=self.idx.device)[:, None] * V + self.idx).reshape(-1)
        G = self.d.new_zeros(n * V, dim).index_add_(0, flat, self.d.reshape(-1, dim))
        return G.view(n, V, dim)

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i · g_i per parameter, for per-example clip factors c."""
        dim = self.weight.shape[1]
        w = self.d.new_zeros(self.weight.shape)
        w.index_add_(0, self.idx.reshape(-1), (self.d * c[:, None, None]).reshape(-1, dim))
        return {self.weight: w if self.s is None else w * self.s}

    def squares(self, c2: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i² · g_i² per parameter, for squared clip factors c2."""
        return {self.weight: torch.tensordot(c2, self.G.pow(2), dims=1)}

    def representation(self, p: Tensor) -> Optional[Representation]:
        """The scattered G, or the lookup form Σ_t onehot(x_t) δ_tᵀ (unscaled layers)."""
        if self.G is not None:
            return Dense(self.G)
        return Lookup(self.idx, self.d) if self.s is None else None


def _as_float(t: Tensor, like: Tensor) -> Tensor:
    return t.to(like.dtype) if t.dtype != like.dtype else t


def embedding_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale, with_squares) -> LayerStats:
    """nn.Embedding: indices [n, *] flattened to [n, T]; padding_idx rows get no gradient."""
    m = calls.module
    idx = torch.cat([r.args[0].reshape(n, -1) for r in calls.records], 1)
    d = torch.cat([_as_float(r.grad_out, m.weight).reshape(n, -1, m.embedding_dim) for r in calls.records], 1) * n
    if m.padding_idx is not None:
        d = d * (idx != m.padding_idx).unsqueeze(-1).to(d.dtype)
    return EmbeddingStats(idx, d, m.weight, scale, with_squares)


@register_rule
class EmbeddingRule(LayerRule):
    """``nn.Embedding`` (the class itself) without ``scale_grad_by_freq`` (module docstring)."""

    name = "embedding"
    for_vmap = False  # the vmap engine replays it

    def serves(self, m: nn.Module) -> bool:
        """``type(m) is nn.Embedding`` and not ``m.scale_grad_by_freq``."""
        return type(m) is nn.Embedding and not m.scale_grad_by_freq

    def closed_form(self, m: nn.Module) -> bool:
        """Served under FSDP2."""
        return True

    def stats(self, calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
              with_squares: bool) -> LayerStats:
        """:func:`embedding_stats`."""
        return embedding_stats(calls, wanted, n, scale, with_squares)
