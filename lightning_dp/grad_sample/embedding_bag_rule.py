"""``nn.EmbeddingBag`` in mode ``"sum"``/``"mean"``: per-example gradients, ghost norms and book-keeping.

A call's bags are its examples: row b of a 2-D ``[B, L]`` input, or, on a 1-D input packed end to end (the torchtext
tutorial's ``self.embedding(text, offsets)``), the tokens ``input[offsets[b]:offsets[b+1]]`` (the last bag runs to
the end of ``input``, or to ``offsets[B]`` with ``include_last_offset``). Output row b is example b's, so with δ_b
the mean loss's gradient of it (times n, undoing the mean), example b's gradient of the table is

    G_b = Σ_{j ∈ bag b} c_j · onehot(x_j) δ_bᵀ,   c_j = 1 (sum), w_j (sum, per_sample_weights), 1/|bag b| (mean)

with c_j = 0 for ``padding_idx`` tokens (left out of the bag, and of the mean's count |bag b|); an empty bag has
G_b = 0. A token repeated within a bag hits one row several times, so the rows are summed per distinct (example,
token) pair first: with a_{b,v} = Σ_{j ∈ bag b, x_j = v} c_j δ_b (summed over the layer's calls too),

    ‖s ⊙ G_b‖² = Σ_v ‖s_v ⊙ a_{b,v}‖²        Σ_b k_b (s ⊙ G_b) = s ⊙ Σ_{b,v} k_b onehot(v) a_{b,v}ᵀ

(s: scale-then-privatize's per-coordinate scale, 1 without), in O(tokens · d) and without an ``[n, V, d]`` buffer;
the vmap engine gets G scattered into ``[n, V, d]``. Mode ``"max"`` (the gradient goes to each dimension's arg-max
row) is not served here: a 2-D call is replayed per example; a 1-D call with offsets is refused before it runs
(:func:`~lightning_dp.validators.layers.embedding_bag_offsets_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.capture.activations import LayerCalls, Record
from lightning_dp.grad_sample.ghost_tied import Lookup, Representation
from lightning_dp.grad_sample.layer_stats import LayerStats
from lightning_dp.grad_sample.rules import LayerRule, register_rule

SERVED_MODES = ("sum", "mean")


@dataclass
class BagTokens:
    """One call's tokens as (example, row, coefficient): token j of the call is bag ``example[j]``'s, looks up row
    ``row[j]`` and enters the bag's output with weight ``coef[j]`` (the c_j of the module docstring)."""

    example: Tensor
    row: Tensor
    coef: Tensor


def _argument(rec: Record, index: int, key: str) -> Any:
    """The call's argument at ``index`` of ``EmbeddingBag.forward(input, offsets, per_sample_weights)``."""
    assert rec.args is not None
    return rec.args[index] if len(rec.args) > index else rec.kwargs.get(key)


def bag_tokens(m: nn.EmbeddingBag, rec: Record, dtype: torch.dtype) -> BagTokens:
    """The tokens of one call (module docstring): a 2-D ``[B, L]`` input's row b is bag b; a 1-D input is split at
    ``offsets`` (``include_last_offset``: B + 1 of them, tokens after the last one left out, as torch does)."""
    x, offsets, weights = _argument(rec, 0, "input"), _argument(rec, 1, "offsets"), _argument(rec, 2,
                                                                                           "per_sample_weights")
    if x.dim() == 2:
        B, L = x.shape
        example = torch.arange(B, device=x.device).repeat_interleave(L)
        row = x.reshape(-1)
        w = None if weights is None else weights.reshape(-1)
    else:
        offsets = offsets.to(device=x.device, dtype=torch.long)
        starts = offsets[:-1] if m.include_last_offset else offsets
        ends = offsets[1:] if m.include_last_offset else torch.cat([offsets[1:], offsets.new_tensor([x.shape[0]])])
        B = starts.shape[0]
        example = torch.arange(B, device=x.device).repeat_interleave(ends - starts)
        row = x[:example.shape[0]]  # starts[0] = 0 (torch checks it): the bags cover input[:used]
        w = None if weights is None else weights[:example.shape[0]]
    kept = (torch.ones_like(row, dtype=dtype) if m.padding_idx is None else (row != m.padding_idx).to(dtype))
    coef = kept if w is None else w.detach().to(dtype) * kept
    if m.mode == "mean":  # |bag b| counts the tokens other than padding_idx, as torch's forward does
        count = torch.zeros(B, dtype=dtype, device=x.device).index_add_(0, example, kept)
        coef = coef / count.clamp(min=1)[example]
    return BagTokens(example, row.long(), coef)


class EmbeddingBagStats(LayerStats):
    """``nn.EmbeddingBag`` (sum/mean): the rows a_{b,v} of each example's gradient, one per distinct (example,
    token) pair (module docstring); norms, clipped sums and squares read them."""

    def __init__(self, keys: Tensor, rows: Tensor, n: int, weight: Tensor, scale: Optional[ParamMap]) -> None:
        V = weight.shape[0]
        self.n, self.weight = n, weight
        self.s = None if scale is None else scale[weight]
        uniq, inverse = torch.unique(keys, return_inverse=True)  # sorted: example-major
        self.a = rows.new_zeros(uniq.shape[0], rows.shape[1]).index_add_(0, inverse, rows)  # a_{b,v}, unscaled
        self.example, self.row = uniq // V, uniq % V
        self.scaled = self.a if self.s is None else self.a * self.s[self.row]
        self.sq_norms = self.a.new_zeros(n).index_add_(0, self.example, self.scaled.pow(2).sum(1))

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_b c_b · s ⊙ G_b = s ⊙ Σ_{b,v} c_b onehot(v) a_{b,v}ᵀ."""
        w = self.a.new_zeros(self.weight.shape).index_add_(0, self.row, self.a * c.to(self.a.dtype)[self.example, None])
        return {self.weight: w if self.s is None else w * self.s}

    def squares(self, c2: Tensor) -> dict[Tensor, Tensor]:
        """Σ_b c_b² (s ⊙ G_b)²: each (example, row) pair is one row of G_b, so squares add per pair."""
        sq = self.scaled.pow(2) * c2.to(self.a.dtype)[self.example, None]
        return {self.weight: self.a.new_zeros(self.weight.shape).index_add_(0, self.row, sq)}

    def dense(self) -> Tensor:
        """G ``[n, V, d]`` (scaled), scattered."""
        V, d = self.weight.shape
        flat = self.example * V + self.row
        return self.a.new_zeros(self.n * V, d).index_add_(0, flat, self.scaled).view(self.n, V, d)

    def representation(self, p: Tensor) -> Optional[Representation]:
        """The lookup form G_b = Σ_v onehot(v) a_{b,v}ᵀ, padded to the largest count of rows per example (padding
        entries have a = 0); None for a scaled layer (then materialised)."""
        if self.s is not None:
            return None
        n, d = self.n, self.a.shape[1]
        counts = torch.bincount(self.example, minlength=n)
        width = int(counts.max()) if counts.numel() and self.a.shape[0] else 0
        first = torch.cumsum(counts, 0) - counts
        at = torch.arange(self.a.shape[0], device=self.a.device) - first[self.example]
        idx = torch.zeros(n, max(width, 1), dtype=torch.long, device=self.a.device)
        r = self.a.new_zeros(n, max(width, 1), d)
        idx[self.example, at] = self.row
        r[self.example, at] = self.a
        return Lookup(idx, r)


def embedding_bag_stats(calls: LayerCalls, n: int, scale: Optional[ParamMap]) -> EmbeddingBagStats:
    """The (example·V + row) keys and rows c_j δ_{b_j} of every call of the layer (δ the output gradient times n),
    gathered into :class:`EmbeddingBagStats`."""
    m = calls.module
    V, dtype = m.weight.shape[0], m.weight.dtype
    keys, rows = [], []
    for rec in calls.records:
        if rec.grad_out is None:
            continue
        t = bag_tokens(m, rec, dtype)
        delta = rec.grad_out.to(dtype) * n
        keys.append(t.example * V + t.row)
        rows.append(delta[t.example] * t.coef[:, None])
    key = torch.cat(keys) if keys else m.weight.new_zeros(0, dtype=torch.long)
    row = torch.cat(rows) if rows else m.weight.new_zeros(0, m.weight.shape[1])
    return EmbeddingBagStats(key, row, n, m.weight, scale)


def served_call(m: nn.Module, rec: Record) -> bool:
    """A call this rule reads: a 2-D input, or a 1-D input with offsets."""
    if rec.args is None:
        return True  # reduced already (never: the rule does not reduce)
    x, offsets = _argument(rec, 0, "input"), _argument(rec, 1, "offsets")
    return isinstance(x, Tensor) and (x.dim() == 2 or (x.dim() == 1 and isinstance(offsets, Tensor)))


@register_rule
class EmbeddingBagRule(LayerRule):
    """``nn.EmbeddingBag`` (the class itself) in mode sum or mean, without ``scale_grad_by_freq`` (refused anyway),
    on 2-D inputs or 1-D inputs with offsets (module docstring); the vmap engine takes its grads too (a 1-D call
    cannot be replayed per example: its example dimension is the offsets')."""

    name = "embedding_bag"

    def serves(self, m: nn.Module) -> bool:
        """``type(m) is nn.EmbeddingBag``, mode sum or mean, not ``scale_grad_by_freq``."""
        return type(m) is nn.EmbeddingBag and m.mode in SERVED_MODES and not m.scale_grad_by_freq

    def serves_calls(self, calls: LayerCalls) -> bool:
        """Every call on a 2-D input or a 1-D input with offsets."""
        return self.serves(calls.module) and all(served_call(calls.module, r) for r in calls.records)

    def grads(self, calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
        """G scattered into ``[n, V, d]``."""
        with torch.no_grad():
            g = embedding_bag_stats(calls, n, None).dense()
        return {key: g if key == "weight" else p.new_zeros(n, *p.shape) for key, p in wanted}

    def stats(self, calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
              with_squares: bool) -> LayerStats:
        """:func:`embedding_bag_stats`."""
        with torch.no_grad():
            return embedding_bag_stats(calls, n, scale)
