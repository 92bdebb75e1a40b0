"""Materialised per-example gradients of several layers, clipped in one pass: one norm and one product for them all.

Some rules hold a layer's per-example gradients whole, ``[n, *p.shape]`` per parameter, times a constant k (the mean
loss's n, or 1 where the rule folded it in already): the normalisation layers reduced during the backward
(:mod:`.norm_rule`), a convolution whose per-example weight gradient is cheaper to form than its ghost norm and its
bias's Σ_t δ (:mod:`.conv_rules`). Layer by layer, each such tensor costs its own reduction for the norms and its own
product for the clipped sum, with the views around them: on a CPU a few microseconds of dispatch each, far more than
their arithmetic for the small ones. Pooled (:class:`DenseGrads`), the small tensors of one k, dtype and device are
joined into one ``[n, D]`` matrix, so that

    ‖g_i‖² over all of them = k² ‖row i‖²          one reduction
    Σ_i c_i g_i of all of them = (k c)ᵀ [n, D]        one product, cut into each parameter's slice (views)

Only tensors of at most :data:`POOLED` numbers are joined (the join copies them; for a larger one the copy costs more
than the dispatches it saves): a larger one keeps its own reduction and product. The squared norms stay one part per
joined matrix or large tensor, ``[P, n]``, so the sum over all layers is still taken in float64
(:func:`~.base.clip_from_parts`). Served where the ghost engine stacks small layers (whole-gradient clipping, no
scale, no squares, no streaming, no tied weight); the rules say which layers they hold so
(:meth:`~.rules.LayerRule.dense`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lightning_dp.grad_sample.layer_stats import LayerStats, weighted_sum

POOLED = 1 << 16
"""A per-example gradient of at most this many numbers (n·|p|) is joined into its pool's matrix."""

DenseMember = tuple[Tensor, Tensor, float]
"""(parameter p, its per-example gradients ``[n, *p.shape]`` g, k): example i's gradient of p is k·g[i]."""


class DenseGrads(LayerStats):
    """The members' squared per-example norms ``[P, n]`` and clipped sums (module docstring)."""

    def __init__(self, members: Sequence[DenseMember], n: int) -> None:
        pools: dict[tuple, list[tuple[Tensor, Tensor]]] = {}
        self.alone: list[DenseMember] = []
        for p, g, k in members:
            if g.numel() <= POOLED:
                pools.setdefault((k, g.dtype, g.device), []).append((p, g))
            else:
                self.alone.append((p, g, k))
        self.pools: list[tuple[float, Tensor, list[Tensor], list[int]]] = []  # (k, [n, D], params, sizes)
        parts = []
        for (k, _, _), items in pools.items():
            flat = [g if g.dim() == 2 else g.reshape(n, -1) for _, g in items]
            matrix = flat[0] if len(flat) == 1 else torch.cat(flat, 1)
            self.pools.append((k, matrix, [p for p, _ in items], [f.shape[1] for f in flat]))
            parts.append(_scaled(torch.linalg.vector_norm(matrix, dim=1).square_(), k * k))
        for _, g, k in self.alone:
            parts.append(_scaled(torch.linalg.vector_norm(g.reshape(n, -1), dim=1).square_(), k * k))
        self.sq_norms = parts[0] if len(parts) == 1 else torch.stack(parts)

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i k g_i of every member: one product per pool (its slices viewed as each parameter), one per large
        tensor."""
        scaled: dict[float, Tensor] = {}
        out: dict[Tensor, Tensor] = {}
        for k, matrix, params, sizes in self.pools:
            ck = scaled.get(k)
            if ck is None:
                ck = scaled[k] = c if k == 1 else c * k
            total = ck @ matrix
            pieces = (total,) if len(params) == 1 else total.split_with_sizes(sizes)  # (Tensor.split: Python)
            for p, piece in zip(params, pieces):
                out[p] = piece if p.dim() == 1 else piece.view(p.shape)
        for p, g, k in self.alone:
            ck = scaled.get(k)
            if ck is None:
                ck = scaled[k] = c if k == 1 else c * k
            out[p] = weighted_sum(ck, g)
        return out


def _scaled(sq: Tensor, kk: float) -> Tensor:
    return sq if kk == 1 else sq.mul_(kk)
