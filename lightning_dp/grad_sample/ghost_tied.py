"""Tied parameters in the ghost engine: the cross terms of the per-example norm.

A parameter W used by several layers (GPT-2/BERT/T5 ``tie_word_embeddings``: the token
embedding and the LM head share one [V, d] matrix) has per-example gradient G_i = Σ_A G_i^A,
one term per owning layer A, so

    ‖G_i‖² = Σ_A ‖G_i^A‖² + 2 Σ_{A<B} ⟨G_i^A, G_i^B⟩.

Each layer's statistics already give ‖G_i^A‖²; this module gives the cross terms without
forming G_i where the layers' gradients have low rank (Li et al. 2022, ghost clipping, applied to
the inner product instead of the norm):

- a layer linear in W (Linear: G_i = k Σ_t δ_t a_tᵀ) is a :class:`LowRank` (l_t = δ_t, r_t = a_t);
- an embedding lookup (G_i = Σ_t onehot(x_t) δ_tᵀ) is a :class:`LowRank` whose left factors are
  one-hot (:class:`Lookup`);
- anything else is :class:`Dense` (the per-example gradients materialised).

    ⟨Σ_t l_t r_tᵀ, Σ_s l'_s r'_sᵀ⟩ = Σ_{t,s} (l_t·l'_s)(r_t·r'_s)        (one-hot l: l'_s[x_t])

The clipped sum needs nothing new: Σ_i c_i G_i = Σ_A Σ_i c_i G_i^A, each layer's own contraction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor


@dataclass
class Dense:
    """Materialised per-example gradients ``g`` [n, *W.shape]."""

    g: Tensor


@dataclass
class LowRank:
    """G_i = k Σ_t l_{i,t} r_{i,t}ᵀ with ``l`` [n, T, rows] and ``r`` [n, T, cols]."""

    l: Tensor  # noqa: E741  (the formula's l_{i,t}, docs/algorithms.md)
    r: Tensor
    k: float = 1.0


@dataclass
class Lookup:
    """G_i = Σ_t onehot(idx_{i,t}) r_{i,t}ᵀ with ``idx`` [n, T] and ``r`` [n, T, cols] (an embedding)."""

    idx: Tensor
    r: Tensor


Representation = Union[Dense, LowRank, Lookup]


def dense(rep: Representation, rows: int) -> Tensor:
    """The per-example gradients ``[n, *W.shape]`` of a representation, materialised."""
    if isinstance(rep, Dense):
        return rep.g
    if isinstance(rep, LowRank):
        return rep.k * torch.bmm(rep.l.transpose(1, 2), rep.r)
    n, _, cols = rep.r.shape
    flat = (torch.arange(n, device=rep.idx.device)[:, None] * rows + rep.idx).reshape(-1)
    return rep.r.new_zeros(n * rows, cols).index_add_(0, flat, rep.r.reshape(-1, cols)).view(n, rows, cols)


def cross_term(a: Representation, b: Representation, rows: int) -> Tensor:
    """⟨G_i^a, G_i^b⟩ for every example i ([n]); ``rows`` is W.shape[0] (the vocabulary of a lookup)."""
    if isinstance(a, Lookup) and isinstance(b, LowRank):
        a, b = b, a
    if isinstance(a, LowRank) and isinstance(b, LowRank):
        return a.k * b.k * (torch.bmm(a.l, b.l.transpose(1, 2)) * torch.bmm(a.r, b.r.transpose(1, 2))).sum((1, 2))
    if isinstance(a, LowRank) and isinstance(b, Lookup):
        picked = torch.gather(a.l, 2, b.idx[:, None, :].expand(-1, a.l.shape[1], -1))  # [n, T_a, T_b]: l_t[x_s]
        return a.k * (picked * torch.bmm(a.r, b.r.transpose(1, 2))).sum((1, 2))
    if isinstance(a, Lookup) and isinstance(b, Lookup):
        same = (a.idx[:, :, None] == b.idx[:, None, :]).to(a.r.dtype)
        return (same * torch.bmm(a.r, b.r.transpose(1, 2))).sum((1, 2))
    ga, gb = dense(a, rows), dense(b, rows)
    return (ga.reshape(ga.shape[0], -1) * gb.reshape(gb.shape[0], -1)).sum(1)
