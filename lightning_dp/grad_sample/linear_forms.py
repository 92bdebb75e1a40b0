"""Linear forms: per-example gradients that are sums of outer products over positions, shared by the rules that
produce them (torch's RNNs, :mod:`.rnn_unrolled`; self-attention's projections, :mod:`.attention_projections`).

A form is what a linear map saw and received at every position: ``a`` ``[n, T, in]`` and ``d`` ``[n, T, out]``
(the loss's gradient w.r.t. the map's output, n times the mean loss's), so that example i's weight gradient is
G_i = Σ_t d_{i,t} ⊗ a_{i,t} and its bias gradient Σ_t d_{i,t}. Several weights may share one form (an LSTM's W_ih
and W_hh read columns of [x_t, h_{t−1}] and share the gate gradients), and several biases one Σ_t d. The ghost engine
takes their norms and clipped sums as for a Linear layer (Li et al. §4, ghost clipping; Bu et al.'s book-keeping;
docs/algorithms.md clip_C):

    ‖G_i‖² = Σ_{t,t'} (a_t·a_t')(d_t·d_t')      cost n·T²·(in + out); or G_i materialised, n·T·in·out
    Σ_i c_i G_i = (c ⊙ d)ᵀ a                     one product over all n·T positions

whichever norm is cheaper in memory (:func:`~.layer_stats.prefer_ghost`); scaled norms (scale-then-privatize) and
second moments (squares) take the materialised per-example grads (:func:`form_grads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.layer_stats import (
    LayerStats,
    MaterialisedStats,
    bookkept_product,
    gram_sq_norms,
    prefer_ghost,
    sq_norms,
    weighted_sum,
)


@dataclass
class LinearForm:
    """Per-example gradients that are sums of outer products over time: example i's gradient of each weight is
    its columns of Σ_t d_{i,t} ⊗ a_{i,t} ``[out, in]``, of each bias Σ_t d_{i,t} (Bu et al.'s book-keeping).
    ``a``: ``[n, T, in]``; ``d``: ``[n, T, out]`` (already multiplied by n, the batch size: the mean loss's 1/n undone);
    ``weights``: parameter
    name → its columns of ``a``; ``biases``: the names whose per-example gradient is Σ_t d_{i,t} (an LSTM's
    ``bias_ih`` and ``bias_hh`` are both)."""

    a: Tensor
    d: Tensor
    weights: dict[str, slice]
    biases: tuple[str, ...]

    def grads(self) -> dict[str, Tensor]:
        """The form's per-example gradients ``[n, *p.shape]`` (each contiguous: the clipping reads them flat)."""
        out: dict[str, Tensor] = {}
        if self.weights:
            G = torch.bmm(self.d.transpose(1, 2), self.a)  # one product for all weights (slices of a are slow)
            out.update({name: G[..., cols].contiguous() for name, cols in self.weights.items()})
        if self.biases:
            db = self.d.sum(1)
            out.update({name: db for name in self.biases})
        return out

    def joined(self, other: "LinearForm") -> "LinearForm":
        """The form of both (the same parameters' gradients from two calls): a and d joined along time."""
        return LinearForm(torch.cat([self.a, other.a], 1), torch.cat([self.d, other.d], 1), self.weights, self.biases)

    def scaled(self, k: float) -> "LinearForm":
        """The same form with ``d`` multiplied by k (the mean loss's 1/n undone: k = n)."""
        return LinearForm(self.a, self.d * k, self.weights, self.biases)

    def restricted(self, names: set[str]) -> Optional["LinearForm"]:
        """The form of the ``names`` among its parameters (None if none), ``a`` cut to their columns."""
        return wanted_form(self.a, self.d, self.weights, self.biases, "", names)

    def per_example(self, n: int) -> "LinearForm":
        """A form over n·m flattened rows as one over n examples (each example's m rows one after another in time)."""
        rows = self.a.shape[0]
        if rows == n:
            return self
        return LinearForm(self.a.reshape(n, -1, self.a.shape[-1]), self.d.reshape(n, -1, self.d.shape[-1]),
                          self.weights, self.biases)


def wanted_form(a: Tensor, d: Tensor, weights: dict[str, slice], biases: tuple[str, ...], suffix: str,
                 wanted: set[str]) -> Optional[LinearForm]:
    """The form of a direction's ``weights``/``biases`` (names without ``suffix``) among ``wanted``, or None; its ``a``
    holds the wanted weights' columns only (so that Σ_t d ⊗ a is exactly their gradients)."""
    kept = [(key + suffix, a[..., cols]) for key, cols in weights.items() if key + suffix in wanted]
    b = tuple(key + suffix for key in biases if key + suffix in wanted)
    if not kept and not b:
        return None
    if len(kept) < len(weights):
        a = torch.cat([cols for _, cols in kept], -1) if kept else a[..., :0]
    columns, start = {}, 0
    for name, cols in kept:
        columns[name], start = slice(start, start + cols.shape[-1]), start + cols.shape[-1]
    return LinearForm(a, d, columns, b)


def form_grads(forms: list[LinearForm], wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
    """The ``wanted`` parameters' per-example grads ``[n, *p.shape]`` from their forms; zeros for a parameter that no
    form holds (no gradient reached it)."""
    total: dict[str, Tensor] = {}
    with torch.no_grad():
        for form in forms:
            total.update(form.grads())
    return {name: total[name] if name in total else p.new_zeros(n, *p.shape) for name, p in wanted}


class FormStats(LayerStats):
    """A layer's squared per-example norms and clipped sums from its linear forms (module docstring)."""

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
                sq = sq + gram_sq_norms(a, d)
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
                w = weighted_sum(c, G) if G is not None else bookkept_product(form.a, form.d, c)
                out.update({self.params[name]: w[:, cols].contiguous() for name, cols in form.weights.items()})
            if db is not None:
                out.update({self.params[name]: c @ db for name in form.biases})
        for p in self.params.values():
            if p not in out:
                out[p] = torch.zeros_like(p)
        return out


def form_stats(forms: list[LinearForm], wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
               with_squares: bool) -> LayerStats:
    """Stats of a layer whose per-example grads are the linear ``forms``: ghost norms and book-keeping
    (:class:`FormStats`), or materialised for scaled norms and squares."""
    if scale is None and not with_squares:
        return FormStats(forms, wanted, n, next(iter(wanted.values())))
    grads = form_grads(forms, list(wanted.items()), n)
    return MaterialisedStats({p: grads[name] for name, p in wanted.items()}, scale)
