"""Small layers of one shape, clipped together: one batched product for the norms and one for the sums of all.

The ghost engine's per-layer work for a small layer is a dozen tensor operations of a few thousand numbers each
(norms, bias sums, the book-keeping contraction): on a CPU each costs its dispatch, a few microseconds, far more
than its arithmetic. A deep stack of identical small layers (48 × Linear(64, 64) + LayerNorm) then spends most of
its private step dispatching. Layers of one shape are stacked instead, and each formula runs once on the stack,
[L, n, …] for L layers: the same arithmetic, L times fewer dispatches.

Served (everything else keeps its own :class:`~.layer_stats.LayerStats`):

* :class:`LinearGroup`: plain ``nn.Linear`` layers called once per step on [n, in] (T = 1), unscaled, not tied.
  Example i's weight gradient is k·δ_i a_iᵀ (k = n, the mean loss's factor), its bias gradient k·δ_i, so
  (Li et al., ghost clipping, T = 1)

      ‖g_i‖² = k² (‖a_i‖² ‖δ_i‖² + ‖δ_i‖²)              one [L, n] product of two batched norms
      Σ_i c_i g_i = k ((c ⊙ δ)ᵀ a, cᵀ δ)                  one batched matrix product, one batched vector product

* :class:`NormGroup`: normalisation layers reduced during the backward (:func:`~.ghost.reducer_for`), whose
  per-example gradients are already [n, C] per parameter: norms and Σ_i c_i g_i batched over the stack.

Only small layers are stacked (:data:`SMALL`: the stack copies their inputs and output gradients, which for a small
layer costs less than the dispatches saved; a large layer's arithmetic dominates its dispatch anyway). The squared
norms stay per layer, [L, n], so the sum over layers is still taken in float64 (:func:`~.base.clip_from_parts`).
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.grad_sample.capture.activations import LayerCalls
from lightning_dp.grad_sample.capture.own_tensors import is_parametrized, own
from lightning_dp.grad_sample.layer_stats import LayerStats

SMALL = 1 << 16
"""A layer is stacked when its per-step tensors (n·(in + out) numbers, or n·C per norm parameter) are at most this."""


def linear_key(calls: LayerCalls, wanted: dict[str, Tensor], n: int) -> Optional[Hashable]:
    """The stacking key of a plain Linear layer :class:`LinearGroup` serves, else ``None``."""
    m = calls.module
    if type(m) is not nn.Linear or is_parametrized(m) or len(calls.records) != 1 or calls.reduced:
        return None
    rec = calls.records[0]
    if rec.args is None or len(rec.args) != 1 or rec.kwargs or rec.grad_out is None or rec.flattened:
        return None
    x, d = rec.args[0], rec.grad_out
    if not (isinstance(x, Tensor) and x.numel() == n * m.in_features and d.numel() == n * m.out_features):
        return None  # T > 1 (tokens, positions): the general rule
    if "weight" not in wanted or n * (m.in_features + m.out_features) > SMALL:
        return None
    w = own(m, "weight")
    return ("linear", m.in_features, m.out_features, "bias" in wanted, w.dtype, w.device)


def norm_key(calls: LayerCalls, wanted: dict[str, Tensor], n: int) -> Optional[Hashable]:
    """The stacking key of a normalisation layer reduced during the backward (:class:`NormGroup`), else ``None``."""
    if calls.records or not calls.reduced or set(calls.reduced) != set(wanted):
        return None
    grads = [calls.reduced[name] for name in sorted(wanted)]
    if any(g.shape[0] != n or g.numel() > SMALL for g in grads):
        return None
    return ("norm", tuple(sorted(wanted)), tuple((tuple(g.shape), g.dtype, g.device) for g in grads))


class LinearGroup(LayerStats):
    """L Linear layers of one shape, T = 1 (module docstring). ``k``: the mean loss's factor n."""

    def __init__(self, members: Sequence[tuple[LayerCalls, dict[str, Tensor]]], k: float) -> None:
        self.k = k
        self.weights = [wanted["weight"] for _, wanted in members]
        self.biases = [wanted.get("bias") for _, wanted in members]
        dtype = self.weights[0].dtype
        n = int(k)
        self.a = torch.stack([calls.records[0].args[0].reshape(n, -1).to(dtype) for calls, _ in members])  # [L, n, in]
        # [L, n, out]
        self.d = torch.stack([calls.records[0].grad_out.reshape(n, -1).to(dtype) for calls, _ in members])
        d2 = torch.linalg.vector_norm(self.d, dim=2).square()
        a2 = torch.linalg.vector_norm(self.a, dim=2).square()
        sq = d2 * (a2 + 1.0) if self.biases[0] is not None else d2 * a2
        self.sq_norms = sq * (k * k)  # [L, n]

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i g_i of every member's weight (and bias): one batched product each."""
        ck = c * self.k
        weighted = self.d * ck[None, :, None]
        w = torch.bmm(weighted.transpose(1, 2), self.a)  # [L, out, in]
        out = dict(zip(self.weights, w.unbind(0)))
        if self.biases[0] is not None:
            out.update(zip(self.biases, weighted.sum(1).unbind(0)))  # type: ignore[arg-type]
        return out


class NormGroup(LayerStats):
    """L normalisation layers whose per-example gradients ([n, C] per parameter) were reduced during the backward."""

    def __init__(self, members: Sequence[tuple[LayerCalls, dict[str, Tensor]]]) -> None:
        names = sorted(members[0][1])
        self.params = {name: [wanted[name] for _, wanted in members] for name in names}
        self.grads = {name: torch.stack([calls.reduced[name] for calls, _ in members]) for name in names}  # [L, n, C]
        parts = [torch.linalg.vector_norm(g.flatten(2), dim=2).square() for g in self.grads.values()]
        self.sq_norms = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)  # [L, n]

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i g_i of every member's parameters: one batched contraction per parameter name."""
        out: dict[Tensor, Tensor] = {}
        for name, g in self.grads.items():
            total = torch.einsum("n,ln...->l...", c, g)
            out.update(zip(self.params[name], total.unbind(0)))
        return out


def stack_small_layers(candidates: dict[int, tuple[LayerCalls, dict[str, Tensor]]], n: int) -> tuple[
        list[LayerStats], set[int]]:
    """The groups of two or more stackable layers among ``candidates`` (id(module) → (calls, wanted parameters)),
    and the ids of the modules they serve (the others are left to their own rules)."""
    by_key: dict[Hashable, list[int]] = {}
    for key_id, (calls, wanted) in candidates.items():
        key = linear_key(calls, wanted, n)
        if key is None:
            key = norm_key(calls, wanted, n)
        if key is not None:
            by_key.setdefault(key, []).append(key_id)
    groups: list[LayerStats] = []
    served: set[int] = set()
    for key, ids in by_key.items():
        if len(ids) < 2:
            continue
        members = [candidates[i] for i in ids]
        groups.append(LinearGroup(members, float(n)) if key[0] == "linear" else NormGroup(members))  # type: ignore[index]
        served.update(ids)
    return groups, served
