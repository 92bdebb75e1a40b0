"""What the ghost engine keeps of one layer for one step (:class:`LayerStats`): each example's squared gradient
norm, and the clipped sums Σ_i c_i g_i on demand; with the two forms every rule may fall back to (materialised
per-example grads; a parameter the step never read)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.ghost_tied import Dense, Representation


def sq_norms(g: Tensor) -> Tensor:
    """Squared L2 norm of each example's slice g[i], as one fused reduction (no g² temporary)."""
    return torch.linalg.vector_norm(g if g.dim() == 2 else g.reshape(g.shape[0], -1), dim=1).square_()


def weighted_sum(c: Tensor, g: Tensor) -> Tensor:
    """Σ_i c_i g[i] ``g.shape[1:]``: ``torch.tensordot(c, g, dims=1)``'s one product (the same values) without its
    Python argument handling (nor, for a ``[n, d]`` g, a view before and after it)."""
    if g.dim() == 2:
        return c @ g
    return (c @ g.reshape(g.shape[0], -1)).reshape(g.shape[1:])


class LayerStats:
    """Per-layer statistics: squared per-example norms, then clipped sums on demand."""

    sq_norms: Tensor

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i s⊙g_i for each of the layer's wanted parameters."""
        raise NotImplementedError

    def squares(self, c2: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i² (s⊙g_i)² for each of the layer's wanted parameters."""
        raise NotImplementedError

    def representation(self, p: Tensor) -> Optional[Representation]:
        """Example i's gradient of ``p`` in a form the tied-weight cross terms read (None: not available)."""
        return None

    def param_sq_norms(self, params: list[Tensor]) -> Optional[dict[Tensor, Tensor]]:
        """Each example's squared norm per parameter of the layer's ``params`` (per-layer clipping), from what the
        norms were computed with; ``None`` where the layer holds only their total (then materialised)."""
        return {params[0]: self.sq_norms} if len(params) == 1 else None

    def sums_by_param(self, factors: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Σ_i c_{i,p} s⊙g_i for a factor vector per parameter: one :meth:`sums` per distinct vector."""
        out: dict[Tensor, Tensor] = {}
        for c in {id(c): c for c in factors.values()}.values():
            part = self.sums(c)
            out.update({p: part[p] for p, f in factors.items() if f is c})
        return out


class MaterialisedStats(LayerStats):
    """Per-example grads ``[n, *p.shape]`` held explicitly (small layers, fallbacks)."""

    def __init__(self, grads: dict[Tensor, Tensor], scale: Optional[ParamMap]) -> None:
        if scale is not None:
            grads = {p: g * scale[p] for p, g in grads.items()}
        self.grads = grads
        self.sq_norms = add_parts([sq_norms(g) for g in grads.values()])

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i · g_i per parameter, for per-example clip factors c."""
        return {p: weighted_sum(c, g) for p, g in self.grads.items()}

    def squares(self, c2: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i² · g_i² per parameter, for squared clip factors c2."""
        return {p: torch.tensordot(c2, g * g, dims=1) for p, g in self.grads.items()}

    def representation(self, p: Tensor) -> Optional[Representation]:
        """The materialised per-example gradients of ``p``."""
        return Dense(self.grads[p])

    def param_sq_norms(self, params: list[Tensor]) -> Optional[dict[Tensor, Tensor]]:
        """Each parameter's per-example squared norms."""
        return {p: sq_norms(self.grads[p]) for p in params}

    def sums_by_param(self, factors: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Σ_i c_{i,p} · g_i per parameter."""
        return {p: weighted_sum(c, self.grads[p]) for p, c in factors.items()}


class WeightBiasStats(LayerStats):
    """Layers whose per-example weight grad is G_i = n Σ_t δ_{i,t} a_{i,t}ᵀ (Linear; convolutions on patches), plus
    a bias grad ``db``. The clipped sums use G when it was materialised for the norms (c·G),
    else the subclass's book-keeping contraction (Bu et al.; :mod:`.ghost`'s docstring)."""

    k: float
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    G: Optional[Tensor]
    db: Tensor
    weight_sq: Optional[Tensor] = None
    """The weight's part of the per-example squared norms (before k²), kept by subclasses that compute it apart."""

    def param_sq_norms(self, params: list[Tensor]) -> Optional[dict[Tensor, Tensor]]:
        """Weight and bias apart: the weight's part as computed for the norms, the bias's k²‖db_i‖²."""
        if self.weight is not None and self.bias is not None and self.weight_sq is None:
            return None
        kk = self.k * self.k
        out = {}
        if self.weight is not None:
            out[self.weight] = self.sq_norms if self.bias is None else self.weight_sq * kk
        if self.bias is not None:
            out[self.bias] = self.db.pow(2).sum(1) * kk
        return {p: out[p] for p in params}

    def sums_by_param(self, factors: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """The weight's contraction with its factors, the bias's with its own."""
        out = {}
        if self.weight is not None and self.weight in factors:
            out[self.weight] = super().sums_by_param({self.weight: factors[self.weight]})[self.weight]
        if self.bias is not None and self.bias in factors:
            out[self.bias] = (factors[self.bias] * self.k) @ self.db
        return out

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i · g_i per parameter, for per-example clip factors c."""
        out = {}
        c = c * self.k
        if self.weight is not None:
            w = weighted_sum(c, self.G) if self.G is not None else self._bookkept_weight_sum(c)
            out[self.weight] = self._as_weight(w)
        if self.bias is not None:
            out[self.bias] = c @ self.db
        return out

    def squares(self, c2: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i² · g_i² per parameter, for squared clip factors c2."""
        out = {}
        c2 = c2 * (self.k * self.k)
        if self.weight is not None:
            w = (torch.tensordot(c2, self.G.pow(2), dims=1) if self.G is not None
                 else self._bookkept_weight_squares(c2))
            out[self.weight] = self._as_weight(w)
        if self.bias is not None:
            out[self.bias] = c2 @ self.db.pow(2)
        return out

    def _as_weight(self, w: Tensor) -> Tensor:
        """A [out, in]-ordered weight-shaped result in the parameter's own layout."""
        return w.reshape(self.weight.shape)

    def representation(self, p: Tensor) -> Optional[Representation]:
        """Materialised G (or the bias grads) when held, else the subclass's low-rank form."""
        if p is self.bias:
            return Dense(self.db * self.k)
        if self.G is not None:
            g = self.G.transpose(1, 2) if getattr(self, "transposed", False) else self.G
            return Dense(g.reshape(g.shape[0], *self.weight.shape) * self.k)
        return self._low_rank()

    def _low_rank(self) -> Optional[Representation]:
        return None

    def _bookkept_weight_sum(self, c: Tensor) -> Tensor:
        raise NotImplementedError

    def _bookkept_weight_squares(self, c2: Tensor) -> Tensor:
        raise RuntimeError(f"{type(self).__name__}: squares need the materialised per-example grads")


class UnusedStats(LayerStats):
    """A parameter the step's loss never read (:func:`~.functorch_vmap.unused_in_step`): every example's
    gradient is exactly zero, so it adds nothing to the norms and its clipped sum is zero (not materialised)."""

    def __init__(self, p: Tensor, n: int) -> None:
        self.p, self.sq_norms = p, p.new_zeros(n)

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i · 0."""
        return {self.p: torch.zeros_like(self.p)}

    def sums_by_param(self, factors: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Zero."""
        return {self.p: torch.zeros_like(self.p)}

    def squares(self, c2: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i² · 0²."""
        return {self.p: torch.zeros_like(self.p)}


def gram_blocks(T: int) -> int:
    """Row blocks of a T×T Gram product (:func:`gram_sq_norms`): 1 below T = 32 (small products gain nothing), 2 up
    to T = 63, else 4 (measured at T = 64 and 256 on CPU: 8 blocks gain no more than 4)."""
    return 1 if T < 32 else 2 if T < 64 else 4


def gram_sq_norms(a: Tensor, d: Tensor) -> Tensor:
    """‖Σ_t d_{i,t} ⊗ a_{i,t}‖² for every example i without the outer products (Li et al. §4, ghost clipping):
    Σ_{t,t'} (a_t·a_t')(d_t·d_t') from ``a`` ``[n, T, in]`` and ``d`` ``[n, T, out]``.

    Both Gram matrices are symmetric, so with k row blocks (:func:`gram_blocks`) only the blocks on and right of
    the diagonal are formed, those right of it counted twice: (k + 1)/(2k) of the products' FLOPs (k = 4 at T = 64:
    25–30 % faster on CPU than the whole T×T products, measured for in, out ∈ {128, 384, 512})."""
    T = a.shape[1]
    k = gram_blocks(T)
    if k == 1:
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))).sum((1, 2))
    size = -(-T // k)
    total = a.new_zeros(a.shape[0])
    for start in range(0, T, size):
        rows = slice(start, min(start + size, T))
        block = torch.bmm(a[:, rows], a[:, start:].transpose(1, 2)).mul_(
            torch.bmm(d[:, rows], d[:, start:].transpose(1, 2)))
        width = rows.stop - start
        total += block[:, :, :width].sum((1, 2)) + 2 * block[:, :, width:].sum((1, 2))
    return total


def bookkept_product(a: Tensor, d: Tensor, c: Tensor) -> Tensor:
    """Σ_i c_i Σ_t d_{i,t} ⊗ a_{i,t} ``[out, in]`` as one product (c ⊙ d)ᵀ a over all n·T positions (Bu et al.'s
    book-keeping), c applied to the narrower side."""
    if d.shape[2] <= a.shape[2]:
        return (d * c[:, None, None]).reshape(-1, d.shape[2]).t() @ a.reshape(-1, a.shape[2])
    return d.reshape(-1, d.shape[2]).t() @ (a * c[:, None, None]).reshape(-1, a.shape[2])


def prefer_ghost(T: int, d_in: int, d_out: int) -> bool:
    """Ghost norm (n·T²·(in+out)) beats materialising (n·T·in·out) when T·(in+out) < in·out."""
    return T * (d_in + d_out) < d_in * d_out


def add_parts(parts: list[Tensor]) -> Tensor:
    """Sum of one layer's per-call tensors (no copy for a single call, unlike ``sum``)."""
    out = parts[0]
    for t in parts[1:]:
        out = out + t
    return out
