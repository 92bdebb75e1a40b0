"""Ghost norms and book-keeping for torch's RNNs (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) in the ghost engine.

The unrolled rule (:mod:`.rnn_unrolled`) gives, for each layer and direction, the gate gradients ∂G ``[n, T, out]``
and what each weight multiplies, ``a`` ``[n, T, in]`` ([x_t, h_{t−1}] for an LSTM or RNN, whose W_ih and W_hh share
∂G; x_t and h_{t−1} with their own ∂G and ∂R for a GRU), so that example i's weight gradient is the linear form
G_i = Σ_t ∂G_{i,t} ⊗ a_{i,t} (:class:`~.rnn_unrolled.LinearForm`) that the ghost engine's Linear rule reads
(Li et al. §4, ghost clipping; Bu et al.'s book-keeping; ALGORITHMS.md clip_C):

    ‖G_i‖² = Σ_{t,t'} (a_t·a_t')(∂G_t·∂G_t')      cost n·T²·(in + out); or G_i materialised, n·T·in·out
    Σ_i c_i G_i = (c ⊙ ∂G)ᵀ a                      one product over all n·T steps

whichever norm is cheaper (:func:`~.layer_stats.prefer_ghost`). For an LSTM one Gram of ∂G and one of
[x_t, h_{t−1}] give the norm of W_ih and W_hh together, and b_ih and b_hh share the per-example gradient Σ_t ∂G_t
(counted once per bias in the norm). Before this rule, the ghost engine materialised every RNN weight's per-example
gradients ``[n, out, in]``. Scale-then-privatize (scaled norms) and second moments (squares) keep the materialised
per-example grads.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_dp.mechanism.capture import LayerCalls
from lightning_dp.mechanism.grad_sample.base import ParamMap
from lightning_dp.mechanism.grad_sample.layer_stats import LayerStats, MaterialisedStats, prefer_ghost, sq_norms
from lightning_dp.mechanism.grad_sample.rnn_unrolled import LinearForm, unrolled_rnn_forms, unrolled_supported

_SERVED = (nn.LSTM, nn.GRU, nn.RNN)


def recurrent_served(calls: LayerCalls) -> bool:
    """Whether :func:`recurrent_stats` serves this layer's calls (the unrolled rule serves every call)."""
    return (type(calls.module) in _SERVED and bool(calls.records)
            and all(unrolled_supported(calls.module, rec) for rec in calls.records))


class FormStats(LayerStats):
    """A layer's squared per-example norms and clipped sums from its linear forms (module docstring): torch's RNNs,
    and self-attention's projections (:mod:`.attention_projections`)."""

    def __init__(self, forms: list[LinearForm], params: dict[str, Tensor], n: int, like: Tensor) -> None:
        self.forms, self.params = forms, params
        self.G: list[Optional[Tensor]] = []  # per form: the materialised G_i where that was cheaper
        self.db: list[Optional[Tensor]] = []  # per form: Σ_t ∂G_{i,t}, the biases' per-example gradient
        self.sq_norms = like.new_zeros(n)
        for form in forms:
            self.sq_norms = self.sq_norms + self._form_sq_norms(form)

    def _form_sq_norms(self, form: LinearForm) -> Tensor:
        a, d = form.a, form.d
        sq = d.new_zeros(d.shape[0])
        G = None
        if form.weights:
            if prefer_ghost(d.shape[1], a.shape[2], d.shape[2]):
                sq = sq + (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))).sum((1, 2))
            else:
                G = torch.bmm(d.transpose(1, 2), a)
                sq = sq + sq_norms(G)
        db = d.sum(1) if form.biases else None
        if db is not None:
            sq = sq + len(form.biases) * db.pow(2).sum(1)
        self.G.append(G)
        self.db.append(db)
        return sq

    def sums(self, c: Tensor) -> dict[Tensor, Tensor]:
        """Σ_i c_i g_i per parameter: one book-keeping product per form (or c·G where G was materialised); a
        parameter no gradient reached (no form) sums to zero."""
        out: dict[Tensor, Tensor] = {}
        for form, G, db in zip(self.forms, self.G, self.db):
            if form.weights:
                w = torch.tensordot(c, G, dims=1) if G is not None else _bookkept(form, c)
                out.update({self.params[name]: w[:, cols].contiguous() for name, cols in form.weights.items()})
            if db is not None:
                out.update({self.params[name]: c @ db for name in form.biases})
        for p in self.params.values():
            if p not in out:
                out[p] = torch.zeros_like(p)
        return out


def _bookkept(form: LinearForm, c: Tensor) -> Tensor:
    """Σ_i c_i G_i = (c ⊙ ∂G)ᵀ a ``[out, in]`` over all n·T steps, c applied to the narrower side."""
    a, d = form.a, form.d
    if d.shape[2] <= a.shape[2]:
        return (d * c[:, None, None]).reshape(-1, d.shape[2]).t() @ a.reshape(-1, a.shape[2])
    return d.reshape(-1, d.shape[2]).t() @ (a * c[:, None, None]).reshape(-1, a.shape[2])


def recurrent_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
                    with_squares: bool) -> LayerStats:
    """The ghost engine's stats of an RNN layer served by :func:`recurrent_served` (module docstring)."""
    return form_stats(unrolled_rnn_forms(calls, list(wanted.items()), n), wanted, n, scale, with_squares)


def form_stats(forms: list[LinearForm], wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
               with_squares: bool) -> LayerStats:
    """Stats of a layer whose per-example grads are the linear ``forms`` (torch's RNNs; self-attention's projections,
    :mod:`.attention_projections`): ghost norms and book-keeping, or materialised for scaled norms and squares."""
    if scale is None and not with_squares:
        return FormStats(forms, wanted, n, next(iter(wanted.values())))
    grads: dict[str, Tensor] = {}
    for form in forms:
        grads.update(form.grads())
    zeros = {name: p.new_zeros(n, *p.shape) for name, p in wanted.items() if name not in grads}
    return MaterialisedStats({p: {**grads, **zeros}[name] for name, p in wanted.items()}, scale)
