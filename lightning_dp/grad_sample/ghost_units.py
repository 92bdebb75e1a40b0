"""The ghost engine's norms for clipping policies beyond flat per-example clipping (issue #39).

**Per-parameter norms** (per-layer clipping): each layer's statistics already hold the parts its per-example
norm was summed from (a Linear's weight part and bias part, :meth:`~.layer_stats.LayerStats.param_sq_norms`);
a layer that holds only their total is materialised. A tied parameter adds its owners' cross terms
(:mod:`.ghost_tied`).

**Norms of units of several examples** (user-level DP): a user's gradient is the sum of its records'
per-example gradients, S_u = Σ_{i∈u} G_i, whose squared norm has cross terms between records,

    ‖S_u‖² = Σ_{i,j∈u} ⟨G_i, G_j⟩.

For a layer linear in W (G_i = k Σ_t δ_{i,t} a_{i,t}ᵀ, :class:`~.ghost_tied.LowRank`) the sum is again of that
form with the user's tokens concatenated: S_u = k Σ_{(i,t), i∈u} δ_{i,t} a_{i,t}ᵀ, so the ghost norm applies to
it unchanged (Li et al. 2022, §4, on M·T positions for a user of M records):

    ‖S_u‖² = k² Σ_{(i,t),(j,s)} (a_{i,t}·a_{j,s})(δ_{i,t}·δ_{j,s})        cost u·(M·T)²·(in + out)

An embedding lookup likewise (:class:`~.ghost_tied.Lookup`, its tokens concatenated). Where materialising is
cheaper ((M·T)·(in + out) ≥ in·out, :func:`~.layer_stats.prefer_ghost`) the user's S_u is formed instead
(u·in·out memory, like the vmap engine for u examples); materialised per-example gradients
(:class:`~.ghost_tied.Dense`) are summed per user. :func:`regroup` makes these per-user representations, zero-
padding users with fewer records (a zero row adds nothing to either form); :func:`unit_sq_norms` adds the
owners' terms of a tied parameter. The clipped sum then needs nothing new: Σ_i f_i G_i with f_i the user's
factor for each of its records, each layer's own book-keeping contraction.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.grad_sample.ghost_tied import Dense, Lookup, LowRank, Representation, cross_term, dense
from lightning_dp.grad_sample.layer_stats import prefer_ghost


def slots(groups: Tensor, units: int) -> tuple[Tensor, int]:
    """Each example's position among its unit's examples (in batch order) ``[n]``, and M, the most examples of
    one unit."""
    n = groups.numel()
    counts = torch.bincount(groups, minlength=units)
    order = torch.argsort(groups, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty(n, dtype=torch.long, device=groups.device)
    position[order] = torch.arange(n, device=groups.device) - starts[groups[order]]
    return position, int(counts.max()) if n else 0


def _padded(x: Tensor, groups: Tensor, position: Tensor, units: int, most: int) -> Tensor:
    """``x`` ``[n, T, …]`` → ``[u, M·T, …]``: unit u's examples' rows concatenated, zero rows after them."""
    out = x.new_zeros((units * most, *x.shape[1:]))
    out[groups * most + position] = x
    return out.reshape(units, most * x.shape[1], *x.shape[2:])


def regroup(rep: Representation, groups: Tensor, units: int, rows: int) -> Representation:
    """The per-unit sums S_u of per-example gradients ``rep`` (module docstring), in the cheaper form."""
    groups = groups.to(_device(rep))
    if isinstance(rep, Dense):
        return Dense(rep.g.new_zeros((units, *rep.g.shape[1:])).index_add_(0, groups, rep.g))
    position, most = slots(groups, units)
    if isinstance(rep, LowRank):
        tokens = most * rep.l.shape[1]
        grouped = LowRank(_padded(rep.l, groups, position, units, most), _padded(rep.r, groups, position, units, most),
                          rep.k)
        if prefer_ghost(tokens, rep.l.shape[2], rep.r.shape[2]):
            return grouped
        return Dense(dense(grouped, rows))
    idx = _padded(rep.idx, groups, position, units, most)  # padding looks up row 0 with a zero output gradient
    return Lookup(idx, _padded(rep.r, groups, position, units, most))


def _device(rep: Representation) -> torch.device:
    return rep.g.device if isinstance(rep, Dense) else rep.r.device


def unit_sq_norms(reps: Sequence[Representation], groups: Tensor, units: int, rows: int) -> Tensor:
    """‖Σ_A S_u^A‖² ``[u]`` for a parameter with one representation per owning layer A (tied weights: several)."""
    grouped = [regroup(r, groups, units, rows) for r in reps]
    total: Optional[Tensor] = None
    for j, a in enumerate(grouped):
        for b in grouped[j:]:
            term = cross_term(a, b, rows) * (1.0 if b is a else 2.0)
            total = term if total is None else total + term
    assert total is not None
    return total
