"""Unbatched lookups: per-example gradients of a layer called without the examples (no example dimension, or a
``[1, …]`` one), and of parameters read outside any layer (:mod:`.root_parameters`).

T5 and MPNet look up their relative position bias with ``[T, T]`` bucket indices (no batch
dimension at all), permute the ``[T, T, H]`` result to ``[1, H, T, T]`` and add it to every
example's attention scores; a ``pos(torch.arange(T))`` lookup added to ``[B, T, d]`` embeddings
does the same. Autograd sums the gradient over the batch where the bias is broadcast, so a
hook on the lookup sees only Σ_i δ_i. This module finds the broadcast instead.

From the lookup's call until the end of the step a :class:`torch.overrides.TorchFunctionMode`
follows every tensor computed from the lookup's output (:class:`BroadcastSites`). At a
**broadcast site**, an operation whose result has the step's n examples in dimension 0 (or the n·m
rows of verified flattened examples, :mod:`~.validators.example_dim`) while the followed tensor t has none there
(dimension 0 of size 1, or fewer dimensions: ``scores + bias``,
``bias.expand(B, …)``, ``mask_token.repeat(B, k, 1)``, a batched matmul), t is replaced by its explicit
expansion e = t.expand(n, …) (a view: the same values, so the model computes the same result), and a hook
on e receives example i's gradient in row i. Each site's rows are mapped back to the lookup's
output through the chain of operations between them (a tensor computed from several lookups, or from a lookup
called on another's output, reaches each),

    δ_i(out) = ∂⟨t, Σ_{broadcast dims} G_i⟩/∂out        (one batched vector-Jacobian product),

and summed over sites and layers (T5 reuses one bias in every layer). The capture records the
call with its inputs expanded to n rows (views) and these δ_i, so every engine serves it as an
ordinary batched call.

A layer whose arguments hold the examples in another dimension (an RNN's h0 ``[L, n, H]``, time-major attention
and position-wise layers; :mod:`~lightning_dp.grad_sample.capture.example_dims`) is a site too, for a followed argument
with n
there (a learned ``[L, 1, H]`` state ``.expand(-1, B, -1)``-ed: no operation on the way grew dimension 0): the layer
gets an alias whose gradient, its own use alone, is sliced per example by the layer's contract,
G_i = G ⊙ 1[index = i], and mapped back as above (:meth:`BroadcastSites.at_layer`). Every site is an autograd
identity that passes nothing while a source maps rows back, so no map-back runs through another site's expansion
(time-major ``x + attn(x)`` with x a site of the attention: that path is the attention site's, counted once).

A block of m > 1 rows repeated over the batch, ``t.repeat(n, …)`` (DeBERTa-v2 repeats its projected relative table
``[H, 2k, d]`` to ``[n·H, 2k, d]`` and multiplies it with the flattened queries in a ``bmm``), is n copies of t, copy i
in rows i·m … (i+1)·m − 1 — copy i is example i's only if the model meets it row for row with the examples flattened
the same way. It is a candidate (:meth:`BroadcastSites._repeated_block`): confirmed when a batched product or
elementwise op meets it with a verified flattening view of ``[n, …]`` of the same row count; carried through ops
that keep its rows in place; any other use, or none that confirms it, and its rows are not handed over (refused).

A followed weight or bias of ``F.linear`` on the examples (timm's BEiT/EVA call ``F.linear(input=x,
weight=self.qkv.weight, bias=torch.cat((q_bias, k_bias, v_bias)))`` and never the ``qkv`` layer) is a site too, with a
linear layer's rule: ∇W_i = Σ_positions δ_i ⊗ x_i, ∇b_i = Σ_positions δ_i from the output's gradient δ
(:meth:`BroadcastSites._functional_linear`).

A followed weight of ``F.embedding`` looked up with the examples' ids (PEFT's LoRA on an embedding:
``F.embedding(x, lora_embedding_A.T)``) is a site too: example i's gradient of the table is its output gradient's rows
added at its own ids, zero at ``padding_idx`` (:meth:`BroadcastSites._functional_embedding`; a few examples at a time,
each a table-sized ``[V, r]``; not a site with ``max_norm``, which writes the table, or ``scale_grad_by_freq``, which
scales by the batch's counts).

A followed operand of a two-operand ``torch.einsum`` whose other operand holds the examples in its first index, which
leads the result and is not the followed operand's (timm MViTv2's decomposed relative position bias,
``einsum("byhwc,hkc->byhwk", q, Rh)``), is a site too: example i's gradient is the same contraction over its rows
alone (:meth:`BroadcastSites._einsum`).

Which tensors hold the examples is read from shapes (n, or the n·m flattened rows, in dimension 0), and a step's
Poisson batch may hold exactly as many examples as a dimension the model computes without them (T positions, a
``[T, d]`` table times a learned scalar). A call on a followed tensor once seen with a result whose dimension 0 is not
the step's examples is therefore never a site for the run (``_rowless``, the capture's, keyed by the call's name and
shapes: a site meets the examples, whose number is each step's n); positions ``torch.arange(T)`` are never looked up as
the examples' ids; an assignment is a site only into an activation.

Verified every step: Σ_i δ_i equals the gradient autograd delivers to the output (a use that is
not a broadcast over the examples, e.g. ``loss + bias.sum()``, breaks it and the step is refused,
naming the layer); the first step's probe compares the result with each example run alone.
Cost: the mode intercepts every torch call (Python overhead) while a followed tensor is alive: it holds them
weakly, pauses between layers once none is left (:meth:`BroadcastSites.pause_if_idle`), is set aside while the
capture records each layer's call (:meth:`BroadcastSites.aside`: the capture's own checks were most of the calls it
saw) and ends before the engine's clipping; only models with such a lookup pay it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_dp.grad_sample.capture.distance_sites import REDUCED_BROADCASTS, cdist_site, reduced_broadcast_site
from lightning_dp.validators.example_dim import flattened_rows


def adds_up(per_example: Tensor, total: Tensor) -> bool:
    """Σ_i δ_i = the gradient autograd delivered, to the precision of the dtype (rounding of the sums): the
    per-step check that every use of a followed tensor was a broadcast site."""
    rtol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(total.dtype, 3e-2)
    diff = (per_example.sum(0).to(total.dtype) - total).abs().max()
    return bool(diff <= rtol * max(float(total.abs().max()), 1e-12) + 1e-30)


class _Source:
    """One lookup call: its output (held weakly: the model may drop it), the per-example gradient gathered so far,
    where it goes."""

    def __init__(self, out: Tensor, n: int, deliver: Callable[[Optional[Tensor], Tensor], None],
                 mapping: list[int]) -> None:
        self.out, self.edge = weakref.ref(out), get_gradient_edge(out)
        self.n, self.deliver = n, deliver
        self.per_example: Optional[Tensor] = None
        self.rejected = False
        self.mapping = mapping  # shared by the step's sources: > 0 while one maps rows back (a nested backward)

    def arrive(self, t_shape: torch.Size, t_edge: Optional[GradientEdge], full: torch.Size, grad: Tensor) -> None:
        """Tensor hook of a site's expansion e of a followed tensor t (``t_edge``: None when t is the lookup's
        output itself; edges, not tensors, so the tensors the model drops are freed): rows of ``grad`` are the
        examples' gradients w.r.t. e (n·m rows of flattened examples: example i's are rows i·m … (i+1)·m − 1,
        summed)."""
        rows = grad.shape[0]
        if rows != self.n:
            grad = grad.reshape(self.n, rows // self.n, *grad.shape[1:]).sum(1)
        self._add(self._back(t_edge, grad.sum_to_size(self.n, *full[1:]).reshape(self.n, *t_shape)))

    def arrive_sliced(self, t_edge: Optional[GradientEdge], dim: int, grad: Tensor) -> None:
        """Tensor hook of a layer's argument t that holds the examples in dimension ``dim`` by the layer's contract
        (an RNN's h0 ``[L, n, H]``): example i's gradient w.r.t. t is ``grad`` with every other example's slice
        zeroed, G_i = grad ⊙ 1[index_dim = i]; mapped back in chunks of examples (each G_i is t's size)."""
        n, chunk = self.n, max(1, _SLICED_ELEMENTS // max(grad.numel(), 1))
        shape = [1] * grad.dim()
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            shape[dim] = n
            mask = torch.eye(n, dtype=grad.dtype, device=grad.device)[start:stop].reshape(stop - start, *shape)
            self._add(self._back(t_edge, grad.unsqueeze(0) * mask), start, stop)

    def _back(self, t_edge: Optional[GradientEdge], g: Tensor) -> Optional[Tensor]:
        """Rows of example gradients w.r.t. a followed t, mapped back to this source's output (one batched
        vector-Jacobian product)."""
        if t_edge is None:
            return g
        # The nested backward reaches this output's own hook, and those of lookups in between (an MLP over a
        # coordinate table: its second layer is a lookup too): not the real gradient, ignored while it runs.
        self.mapping[0] += 1
        try:  # allow_unused: t may reach the site through another source only (PEFT DoRA divides by a detached norm)
            return torch.autograd.grad(t_edge, self.edge, g, retain_graph=True, is_grads_batched=True,
                                       allow_unused=True)[0]
        finally:
            self.mapping[0] -= 1

    def _add(self, g: Optional[Tensor], start: int = 0, stop: Optional[int] = None) -> None:
        """Add rows ``start … stop − 1`` (all n by default) of the per-example gradient."""
        if g is None:
            return
        if stop is None or (start == 0 and stop == self.n):
            self.per_example = g if self.per_example is None else self.per_example + g
            return
        if self.per_example is None:
            self.per_example = g.new_zeros(self.n, *g.shape[1:])
        self.per_example = self.per_example.index_add(0, torch.arange(start, stop, device=g.device), g)

    def arrive_rows(self, t_edge: Optional[GradientEdge], rows: Tensor, start: int = 0) -> None:
        """Example i's gradient w.r.t. a followed t in row i − ``start`` of ``rows`` ``[k, *t.shape]`` (a functional
        layer's weight: :meth:`BroadcastSites._functional_linear`; all n rows unless ``start``/k say otherwise),
        mapped back to this source's output."""
        self._add(self._back(t_edge, rows), start, start + rows.shape[0])

    def reject(self) -> None:
        """A site whose rows cannot be taken for the examples' (an unconfirmed block of copies): nothing is handed
        over."""
        self.rejected = True

    def settle(self, total: Tensor) -> None:
        """Hook on the lookup's output (fires after every site): hand over the rows, with the total."""
        if self.rejected:
            self.deliver(None, total)
            return
        self.deliver(self.per_example if self.n > 1 else total.unsqueeze(0), total)


class _Site(torch.autograd.Function):
    """The identity at a broadcast site (an alias of t, not a view), whose backward passes no gradient while a source
    maps rows back: a nested backward from a followed tensor to its source must not run through another site's
    expansion of it (a time-major residual ``x + attn(x)``, with the attention's argument x a site), whose rows that
    site's own hook delivers: the path would count twice."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, mapping: list[int]) -> Tensor:
        ctx.mapping = mapping
        return torch.ops.aten._unsafe_view(t, t.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None]:
        return (None if ctx.mapping[0] else grad), None


_SLICED_ELEMENTS = 1 << 24
"""Elements of the masked gradients one batched map-back of :meth:`_Source.arrive_sliced` may hold (64 MiB in
float32)."""


class _Block:
    """A candidate site of per-example copies (:meth:`BroadcastSites._repeated_block`): ``rows`` = n·m, confirmed
    once met row for row with the flattened examples, misused by any other use."""

    def __init__(self, rows: int) -> None:
        self.rows, self.confirmed, self.misused = rows, False, False


class BroadcastSites(TorchFunctionMode):
    """The mode of the module docstring for one step of n examples (entered at the first lookup)."""

    def __init__(self, n: int, flattened: Callable[[], set[int]] = set, anchors: Callable[[], Any] = dict,
                 rowless: Optional[set[tuple]] = None) -> None:
        super().__init__()
        self.n, self._flattened = n, flattened  # the capture's verified row counts n·m of this step (shared)
        # calls (name and shapes) once seen with a result whose dimension 0 was not the step's examples: for the run
        # (the capture's set), so a later step whose n happens to equal that dimension does not take it for them
        self._rowless: set[tuple] = set() if rowless is None else rowless
        self._anchors = anchors  # autograd nodes of this step's layer outputs on the examples (example_dim.py)
        self._followed: dict[int, tuple[weakref.ref, tuple[_Source, ...]]] = {}
        self._mapping = [0]
        self._blocks: dict[int, tuple[weakref.ref, _Block]] = {}  # tensors holding per-example copies of a block
        self.active = False
        self._aside = False  # left for the capture's own work (aside()), entered again after it

    def follow(self, out: Tensor, deliver: Callable[[Optional[Tensor], Tensor], None],
               inputs: Sequence[Tensor] = ()) -> None:
        """Follow ``out`` (a lookup's output); ``deliver(rows, total)`` is called when its gradient is known. ``out``
        stays linked to the sources of any followed tensor among the call's ``inputs``."""
        source = _Source(out, self.n, deliver, self._mapping)
        out.register_hook(lambda g: None if source.mapping[0] else source.settle(g.detach()))
        if self.n > 1:  # a lookup on a followed input (an MLP over a coordinate table) stays linked to that one too
            linked = [s for t in (out, *inputs) for s in self._sources(t)]
            self._remember(out, tuple(dict.fromkeys((*linked, source))))
            if not self.active:
                self.__enter__()
                self.active = True

    def pause_if_idle(self) -> None:
        """Leave the mode while no followed tensor is alive (called between layers; a later :meth:`follow` enters
        it again), so the rest of the forward and the backward's hooks run without its per-call Python work. Only
        when this mode is the innermost one: leaving it from under another mode would pop that one."""
        if self.active and not self._followed and not self._blocks and _innermost_mode() is self:
            self.active = False
            self.__exit__(None, None, None)

    def close(self) -> None:
        """Leave the mode (end of the step's forward and backward); idempotent."""
        if self.active:
            self.active = False
            if not self._aside:
                self.__exit__(None, None, None)
        self._followed.clear()
        self._blocks.clear()

    @contextmanager
    def aside(self) -> Iterator[None]:
        """The mode left for a block of the engine's own code (the capture's hook after each layer: its shape and
        graph checks are most of the torch calls a forward makes while a followed tensor lives), entered again after
        it. Only when this mode is the innermost one. A tensor the block hands the model in place of a followed one
        is followed by :meth:`carry`, as the mode would have followed it."""
        if not (self.active and not self._aside and _innermost_mode() is self):
            yield
            return
        self.__exit__(None, None, None)
        self._aside = True
        try:
            yield
        finally:
            self._aside = False
            if self.active:  # not closed inside the block
                self.__enter__()

    def carry(self, before: Sequence[Any], after: Sequence[Any]) -> None:
        """``after[k]`` (an alias the capture made of ``before[k]`` while the mode was aside) is followed wherever
        ``before[k]`` is."""
        for old, new in zip(before, after):
            if new is not old and isinstance(new, Tensor) and new.requires_grad:
                sources = self._sources(old)
                if sources:
                    self._remember(new, sources)

    def _remember(self, t: Tensor, sources: tuple[_Source, ...]) -> None:
        """Follow ``t`` (computed from the outputs of ``sources``) while it lives: a tensor the model has dropped
        can meet no further operation; once none is left, every torch call passes straight through."""
        _keep_weakly(self._followed, t, sources)

    def _sources(self, t: Any) -> tuple[_Source, ...]:
        """The lookups whose outputs a followed ``t`` was computed from (empty: not followed). A tensor followed from a
        computation without grad (:meth:`_followed_on`) counts only while grad is off (the rest of that computation)
        or once it carries a gradient (a custom Function's output): with grad on, one that never will (an EMA buffer
        written under ``torch.no_grad()``) is no source of anything."""
        if not isinstance(t, Tensor):
            return ()
        entry = self._followed.get(id(t))
        if entry is None or entry[0]() is not t or not (t.requires_grad or not torch.is_grad_enabled()):
            return ()
        return entry[1]

    def _mentions_followed(self, args: tuple, kwargs: dict) -> bool:
        """Cheap pre-check (every torch call of the forward comes here): a followed tensor among the arguments,
        one level of lists/tuples deep; the full pytree walk only when one is."""
        followed, blocks = self._followed, self._blocks
        for v in (*args, *kwargs.values()):
            if id(v) in followed or id(v) in blocks or (
                    type(v) in (list, tuple) and any(id(w) in followed or id(w) in blocks for w in v)):
                return True
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (self._followed or self._blocks) or not self._mentions_followed(args, kwargs):
            return func(*args, **kwargs)
        blocks = self._blocks_among(args, kwargs) if self._blocks else {}
        result = self._dispatch(func, args, kwargs)
        if blocks:
            self._check_block_use(blocks, func, args, kwargs, result)
        return result

    def _dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        """One torch call of the forward with a followed tensor among its arguments: a broadcast site, or a result to
        follow."""
        flat, spec = tree_flatten((args, kwargs))
        followed = [(i, s) for i, s in ((i, self._sources(v)) for i, v in enumerate(flat)) if s]
        if not followed:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__setitem__" and len(args) == 3 and not kwargs and isinstance(flat[0], Tensor) \
                and not self._sources(flat[0]):
            return self._assigned(func, args)
        in_place = name.startswith("__i") or (name.endswith("_") and not name.startswith("__"))
        computed = not (in_place and isinstance(flat[0], Tensor) and not self._sources(flat[0]))
        product = _product_arguments(name, args, kwargs) if name in PRODUCTS else None
        # a costly call is first run on shapes alone (meta tensors): at a site it runs once, on the expansion
        shaped = _shape_only(name, args, kwargs) if computed and name in SHAPED_FIRST and product is None else None
        result = shaped if shaped is not None else func(*args, **kwargs) if computed else flat[0]
        rows = {self.n} | self._flattened()
        call = (name, tuple(tuple(v.shape) if isinstance(v, Tensor) else None for v in flat),
                tuple(result.shape) if isinstance(result, Tensor) else None)
        if call in self._rowless:  # seen without the examples at another step: not a site, whatever n is now
            return self._followed_on(func, args, kwargs, flat, followed, result, computed, shaped, call, rows)
        if name == "linear" and self._functional_linear(_linear_arguments(args, kwargs), result, rows):
            return result
        if name == "einsum" and self._einsum(_einsum_arguments(args, kwargs), result, rows):
            return result
        if name == "cdist" and cdist_site(self, args, kwargs, result, rows):  # learnable prototypes: distance_sites
            return result
        if name in REDUCED_BROADCASTS:  # cosine classifiers' prototypes: distance_sites
            served = reduced_broadcast_site(self, name, args, kwargs, result, rows)
            if served is not None:
                return func(*served[0], **served[1])
        if product is not None and self._einsum(product, result, rows):
            return result
        if func is F.embedding and self._functional_embedding(_embedding_arguments(args, kwargs), result, rows):
            return result
        if name in LOOKUPS and self._functional_embedding(_lookup_arguments(name, args, kwargs), result, rows):
            return result
        sites = [(i, s) for i, s in followed if name in BROADCASTING and _grows_examples(flat[i], result, rows)]
        if not sites and name in REPEATING and followed[0][0] == 0 and not kwargs:
            repeated = self._repeated(flat[0], followed[0][1], args[1:], result, rows)
            if repeated is not None:
                return repeated
        if sites:
            for i, sources in sites:
                flat[i] = self._expanded(flat[i], sources, result.dim(), result.shape[0])
            args, kwargs = tree_unflatten(flat, spec)
            return func(*args, **kwargs)
        return self._followed_on(func, args, kwargs, flat, followed, result, computed, shaped, call, rows)

    def _followed_on(self, func: Any, args: tuple, kwargs: dict, flat: list, followed: list, result: Any,
                     computed: bool, shaped: Any, call: tuple, rows: set[int]) -> Any:
        """A call that is no site: its result is followed. A result whose dimension 0 is not the step's examples
        makes the call's shapes :attr:`_rowless` for the run (sites always meet the examples in dimension 0, whose
        size is each step's n: a call of the same shapes at another n holds none)."""
        if not computed or shaped is not None:
            result = func(*args, **kwargs)
        if isinstance(result, Tensor) and result.dim() > 0 and result.shape[0] not in rows:
            self._rowless.add(call)
        sources = tuple(dict.fromkeys(s for _, group in followed for s in group))  # every source, once, in order
        # Inside a custom autograd.Function's forward (peft LoHa's HadaWeight: ((w1a @ w1b) * (w2a @ w2b)) * scale)
        # gradients are off, so the result does not require grad yet; the Function makes that very tensor its output,
        # with its own backward. Followed too: a result of followed tensors computed without grad (elsewhere, under
        # torch.no_grad(), such a tensor never carries a gradient: it is followed for nothing, and meets no site).
        unrecorded = not torch.is_grad_enabled()
        for t in tree_flatten(result)[0]:
            if isinstance(t, Tensor) and (t.requires_grad or unrecorded):  # no gradient reaches a source otherwise
                self._remember(t, sources)
        return result

    def _assigned(self, func: Any, args: tuple) -> None:
        """``target[index] = value`` of a followed value into a tensor that is not followed. Into the examples' rows
        (wav2vec2's SpecAugment, ``hidden[mask_time_indices] = self.masked_spec_embed``: a value without the examples,
        at positions the index picks in the leading dimensions only) it is a broadcast site: the value is assigned
        as its expansion to the target's rows, the same values, whose gradient reaches it per example. Into anything
        else (peft FourierFT writes its spectrum into a zero matrix, ``dense[rows, cols] = spectrum``, then uses the
        matrix as a weight) the target is followed from then on, as an in-place operation's."""
        target, index, value = args
        sources = self._sources(value)
        if not sources:
            return func(*args)
        lead = _indexed_dims(index)
        # the target holds the examples' rows: an activation (it carries a gradient: a zero template [T, d] whose T
        # happens to be the step's n does not) with n rows
        if (isinstance(value, Tensor) and value.requires_grad and target.dim() >= 1 and target.requires_grad
                and target.shape[0] in ({self.n} | self._flattened()) and lead is not None
                and lead <= target.dim() - value.dim() and (value.dim() < target.dim() or value.shape[0] == 1)):
            try:
                torch.broadcast_shapes(value.shape, target.shape)
            except RuntimeError:
                return func(*args)  # torch's own error, if any, from the user's call as written
            e = self._expanded(value, sources, target.dim(), target.shape[0])
            return func(target, index, e.expand(target.shape)[index])
        func(*args)
        if target.requires_grad:
            self._remember(target, sources)
        return None

    def _repeated(self, t: Tensor, sources: tuple[_Source, ...], reps: tuple, result: Any,
                  rows: set[int]) -> Optional[Tensor]:
        """``t.repeat(n, …)`` (or ``tile``) of a ``t`` whose aligned dimension 0 is 1 or absent: a broadcast site
        too (ViTMAE's ``mask_token.repeat(B, k, 1)``), served as ``t.expand(n, …).repeat(1, …)`` (the same
        values). None when it is not one."""
        sizes = list(reps[0]) if len(reps) == 1 and isinstance(reps[0], (tuple, list)) else list(reps)
        if not sizes or not all(isinstance(r, int) for r in sizes):
            return None
        sizes = [1] * (t.dim() - len(sizes)) + sizes  # tile pads on the left; repeat needs ≥ t.dim() sizes
        aligned0 = t.shape[0] if len(sizes) == t.dim() else 1
        if aligned0 > 1 and len(sizes) == t.dim() and sizes[0] == self.n and isinstance(result, Tensor):
            return self._repeated_block(t, sources, sizes)
        if (not isinstance(result, Tensor) or result.dim() != len(sizes) or aligned0 != 1
                or sizes[0] != result.shape[0] or sizes[0] not in rows):
            return None
        return self._expanded(t, sources, len(sizes), sizes[0]).repeat(1, *sizes[1:])

    def _holds_examples(self, x: Tensor, rows: set[int]) -> bool:
        """Whether x's dimension 0 is the step's examples or verified flattened rows of them; a row count verified
        here joins the step's, as at a layer (a layer later called on these rows — timm SwinV2's proj after a reshape
        that merges the heads — is grouped alike: the capture's set, shared)."""
        if x.shape[0] in rows:
            return True
        if not flattened_rows(x, self.n, self._anchors()):
            return False
        self._flattened().add(int(x.shape[0]))
        return True

    def _functional_linear(self, args: tuple, result: Any, rows: set[int]) -> bool:
        """``F.linear(x, W, b)`` of the examples x ``[n, …, in]`` (or verified flattened ``[n·m, …]``) with a followed
        weight or bias (timm's BEiT/EVA: ``F.linear(x, self.qkv.weight, torch.cat((q_bias, k_bias, v_bias)))``, the
        ``qkv`` layer never called): a site. Example i's gradients are those of a linear layer,
        ∇W_i = Σ_positions δ_i ⊗ x_i and ∇b_i = Σ_positions δ_i, from the output's gradient δ; each is mapped back to
        its sources. False (not a site) when x is followed too or lacks the examples."""
        x = args[0]
        if (not isinstance(x, Tensor) or not isinstance(result, Tensor) or self._sources(x)
                or x.dim() < 2 or not result.requires_grad):
            return False
        if not self._holds_examples(x, rows):
            return False
        n, inputs = self.n, x.detach().reshape(self.n, -1, x.shape[-1])
        parts = [(i, self._sources(args[i])) for i in (1, 2) if self._sources(args[i])]
        edges = {i: get_gradient_edge(args[i]) for i, _ in parts}

        def hook(g: Tensor) -> None:
            if self._mapping[0]:
                return
            delta = g.detach().reshape(n, -1, g.shape[-1])
            for i, sources in parts:
                rows_i = torch.bmm(delta.transpose(1, 2), inputs) if i == 1 else delta.sum(1)
                for source in sources:
                    source.arrive_rows(None if args[i] is source.out() else edges[i], rows_i)

        result.register_hook(hook)
        return True

    def _functional_embedding(self, call: Optional[tuple[Any, Any, Any]], result: Any, rows: set[int]) -> bool:
        """``F.embedding(ids, W)`` of the examples' ids ``[n, …]`` (or verified flattened ``[n·m, …]``) with a followed
        table W ``[V, r]`` (PEFT's LoRA on an embedding: ``F.embedding(x, lora_embedding_A.T)``): a site. Example i's
        gradient of W is its output gradient's rows added at its own ids, ∇W_i[v] = Σ_{t: ids_i,t = v} δ_i,t, zero at
        ``padding_idx`` (as the lookup's own backward); mapped back to W's sources a few examples at a time (each row
        is table-sized, ≤ ``_SLICED_ELEMENTS`` elements per batch of rows). ``call``: (ids, W, padding_idx), None for a
        call that is not a site (``max_norm``, ``scale_grad_by_freq``, ``sparse``). The same lookup written as indexing,
        ``W[ids]`` or ``W.index_select(0, ids)`` (center loss: ``self.centers[y]``), is served alike, for a table of
        any number of dimensions (:func:`_lookup_arguments`)."""
        if call is None or not isinstance(result, Tensor) or not result.requires_grad:
            return False
        ids, table, padding_idx = call
        if (not isinstance(ids, Tensor) or not isinstance(table, Tensor) or self._sources(ids) or table.dim() < 1
                or not self._sources(table) or ids.dim() < 1 or ids.is_floating_point() or ids.dtype == torch.bool
                or not self._holds_examples(ids, rows)):
            return False
        n, V, shape = self.n, table.shape[0], table.shape
        r = max(shape[1:].numel(), 1)
        idx = ids.detach().reshape(n, -1) % max(V, 1)  # an index may count from the end (W[-1])
        sources, edge = self._sources(table), get_gradient_edge(table)
        pad = None if padding_idx is None else padding_idx % V
        chunk = max(1, _SLICED_ELEMENTS // max(V * r, 1))

        def hook(g: Tensor) -> None:
            if self._mapping[0]:
                return
            delta = g.detach().reshape(n, -1, r)
            for start in range(0, n, chunk):
                stop = min(n, start + chunk)
                at = idx[start:stop].unsqueeze(-1).expand(-1, -1, r)
                per_example = delta.new_zeros(stop - start, V, r).scatter_add_(1, at, delta[start:stop])
                if pad is not None:
                    per_example[:, pad] = 0
                per_example = per_example.reshape(stop - start, *shape)
                for source in sources:
                    source.arrive_rows(None if table is source.out() else edge, per_example, start)

        result.register_hook(hook)
        return True

    def _einsum(self, parsed: Optional[tuple[list[str], str, list[Tensor]]], result: Any, rows: set[int]) -> bool:
        """``torch.einsum("bhwc,hkc->bhwk", x, t)`` with a followed t and the examples x ``[n, …]`` (or verified
        flattened ``[n·m, …]``) whose first index b leads the result and is not one of t's (timm MViTv2's decomposed
        relative position bias, from its ``rel_pos_h``): a site. Example i's gradient of t is the same contraction over
        example i's rows alone, ``einsum("zbhwk,zbhwc->zhkc", δ, x)`` with δ and x split into ``[n, m, …]``; mapped back
        to t's sources. False (not a site) for any other form (ellipsis, more operands, t's index repeated, an index of
        t in neither x nor the result)."""
        if parsed is None or not isinstance(result, Tensor) or not result.requires_grad:
            return False
        (left, right), out, (a, b) = parsed
        if bool(self._sources(a)) == bool(self._sources(b)):
            return False
        (x, xs), (t, ts) = ((a, left), (b, right)) if self._sources(b) else ((b, right), (a, left))
        if (x.dim() != len(xs) or t.dim() != len(ts) or result.dim() != len(out) or len(set(ts)) != len(ts)
                or not xs or not out or xs[0] != out[0] or xs[0] in ts or not set(ts) <= set(xs) | set(out)
                or x.dim() == 0 or result.shape[0] != x.shape[0]):
            return False
        if not self._holds_examples(x, rows):
            return False
        n, sources, edge = self.n, self._sources(t), get_gradient_edge(t)
        z = next(c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in xs + ts + out)
        equation = f"{z}{out},{z}{xs}->{z}{ts}"
        inputs = x.detach().reshape(n, -1, *x.shape[1:])

        def hook(g: Tensor) -> None:
            if self._mapping[0]:
                return
            per_example = torch.einsum(equation, g.detach().reshape(n, -1, *g.shape[1:]), inputs.to(g.dtype))
            for source in sources:
                source.arrive_rows(None if t is source.out() else edge, per_example)

        result.register_hook(hook)
        return True

    def _repeated_block(self, t: Tensor, sources: tuple[_Source, ...], sizes: list[int]) -> Tensor:
        """``t.repeat(n, …)`` of a followed block t of m > 1 rows: n copies, rows i·m … (i+1)·m − 1 being copy i
        (DeBERTa-v2 repeats its projected relative-position table ``[H, 2k, d]`` over the batch and multiplies it
        with ``[B·H, T, d]`` queries in a ``bmm``). A copy per example only if the model meets it row for row with
        the examples flattened the same way; until then it is a candidate (:class:`_Block`), checked at every use
        (:meth:`_check_block_use`), and its examples' gradients are handed over only once confirmed. Served as
        ``t.expand(n, m, …)``, repeated along the other dimensions and reshaped to ``[n·m, …]`` (the same values)."""
        block = _Block(self.n * t.shape[0])
        e = self._site(t).unsqueeze(0).expand(self.n, *t.shape)
        shape, t_shape = e.shape, t.shape
        self._deliver_to(e, t, sources, lambda s, t_edge, g: (
            s.arrive(t_shape, t_edge, shape, g) if block.confirmed and not block.misused else s.reject()))
        r = e.repeat(1, 1, *sizes[1:]) if any(k != 1 for k in sizes[1:]) else e
        r = r.reshape(block.rows, *r.shape[2:])
        _keep_weakly(self._blocks, r, block)
        return r

    def _blocks_among(self, args: tuple, kwargs: dict) -> dict[int, "_Block"]:
        """The candidate blocks among a call's arguments (id of the tensor → its block)."""
        found = {}
        for v in tree_flatten((args, kwargs))[0]:
            entry = self._blocks.get(id(v)) if isinstance(v, Tensor) else None
            if entry is not None and entry[0]() is v:
                found[id(v)] = entry[1]
        return found

    def _check_block_use(self, blocks: dict[int, "_Block"], func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        """One use of a tensor of per-example copies (:meth:`_repeated_block`): met row for row with a verified
        flattening of the examples ``[n·m, …]`` in a broadcasting op or a batched product (confirmed), carried through
        an op that keeps its rows in place (a transpose of the other dimensions, a copy), or anything else
        (misused: the step is refused). A use without a tensor result (``.size()``) is none."""
        name = getattr(func, "__name__", "")
        others = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, Tensor) and id(v) not in blocks]
        outs = [t for t in tree_flatten(result)[0] if isinstance(t, Tensor) and t.requires_grad]
        for block in dict.fromkeys(blocks.values()):
            if name in BLOCK_MEETS and any(v.dim() > 0 and v.shape[0] == block.rows and flattened_rows(v, self.n)
                                           for v in others):
                block.confirmed = True
            elif name in BLOCK_CARRIES and _keeps_rows(name, args) and all(
                    t.dim() > 0 and t.shape[0] == block.rows for t in outs):
                for t in outs:
                    _keep_weakly(self._blocks, t, block)
            elif outs:
                block.misused = True

    def at_layer(self, t: Any, dim: int) -> Any:
        """A layer's argument holding the examples in dimension ``dim`` by the layer's contract (an RNN's h0, a
        time-major attention's query; :mod:`~lightning_dp.grad_sample.capture.example_dims`), called from the layer's
        forward
        pre-hook: a followed ``t`` with n there (``h0.expand(L, B, H)`` of a learned ``[L, 1, H]`` state: the batch
        is not in dimension 0, so no operation on the way was a site) is a broadcast site. The layer gets an alias
        of t whose gradient, the layer's use alone, reaches each source sliced per example
        (:meth:`_Source.arrive_sliced`); anything else is returned unchanged."""
        sources = self._sources(t)
        if not sources or t.dim() <= dim or t.shape[dim] != self.n or not t.requires_grad:
            return t
        e = self._site(t)
        self._deliver_to(e, t, sources, lambda s, t_edge, g: s.arrive_sliced(t_edge, dim, g))
        return e

    def _site(self, t: Tensor) -> Tensor:
        """t through the :class:`_Site` identity (outside this mode: the alias is the site's, not a followed result)."""
        with torch._C.DisableTorchFunction():
            return _Site.apply(t, self._mapping)

    @staticmethod
    def _deliver_to(e: Tensor, t: Tensor, sources: tuple[_Source, ...],
                    arrive: Callable[[_Source, Optional[GradientEdge], Tensor], None]) -> None:
        """Hook on a site's tensor e (made from the followed t): ``arrive(source, t_edge, grad)`` for each source
        (``t_edge`` None when t is the source's output itself), except during a map-back."""
        for source in sources:
            t_edge = None if t is source.out() else get_gradient_edge(t)
            e.register_hook(lambda g, s=source, t_edge=t_edge: None if s.mapping[0] else arrive(s, t_edge, g))

    @property
    def following(self) -> bool:
        """Whether a followed tensor is alive."""
        return bool(self._followed)

    @property
    def mapping(self) -> bool:
        """Whether a source is mapping rows back (a nested backward: layers' output hooks must ignore it)."""
        return self._mapping[0] > 0

    def _expanded(self, t: Tensor, sources: tuple[_Source, ...], rank: int, rows: int) -> Tensor:
        """t's explicit expansion e to ``rows`` rows at rank ``rank``; e's gradient reaches each source (t may be
        computed from several: PVT concatenates two reads of its position table)."""
        full = t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) if t.dim() < rank else t
        if not full.requires_grad:
            return full.expand(rows, *full.shape[1:])
        e = self._site(full).expand(rows, *full.shape[1:])
        shape, t_shape = e.shape, t.shape
        self._deliver_to(e, t, sources, lambda s, t_edge, g: s.arrive(t_shape, t_edge, shape, g))
        return e


BROADCASTING: frozenset[str] = frozenset({
    "add", "sub", "mul", "div", "true_divide", "addcmul", "addcdiv", "where", "maximum", "minimum", "matmul",
    "add_", "sub_", "mul_", "div_", "addcmul_", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__",
    "__isub__", "__mul__", "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__matmul__",
    "__rmatmul__", "expand", "expand_as", "broadcast_to", "scaled_dot_product_attention",
})
"""Operations whose result broadcasts their inputs (so an input expanded to n rows gives the same values). Only
these are broadcast sites: expanding a weight of ``F.linear`` or ``F.embedding`` would change the operation; such
a use is followed on, never served, and the examples' gradients then do not add up (refused)."""


SHAPED_FIRST: frozenset[str] = frozenset({"scaled_dot_product_attention", "matmul", "__matmul__", "__rmatmul__"})
"""Costly broadcasting operations whose result's shape is worked out from the arguments' before the call
(:func:`_shape_only`): at a site the real call then runs once, on the expansion (T5's relative bias as SDPA's
``attn_mask``), not once to learn the shape and again on the expansion."""


def _shape_only(name: str, args: tuple, kwargs: dict) -> Optional[Tensor]:
    """An empty meta tensor of the shape ``name``'s result will have (SDPA: the broadcast batch dimensions of query,
    key and value, into which the mask's must broadcast, then the query's length and the value's width; matmul of ≥ 2-D
    operands: the broadcast batch
    dimensions, then rows × columns), or None where the rule does not cover the call (computed for real)."""
    if name == "scaled_dot_product_attention":
        keys = ("query", "key", "value", "attn_mask")
        named = dict(zip(keys, args))
        named.update({k: v for k, v in kwargs.items() if k in keys})
        q, k, v, mask = (named.get(key) for key in keys)
        if not all(isinstance(t, Tensor) and t.dim() >= 2 for t in (q, k, v)):
            return None
        parts = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
        rows, cols = q.shape[-2], v.shape[-1]
    else:
        a, b = (args[1], args[0]) if name == "__rmatmul__" else (args + (None, None))[:2]
        if kwargs or not isinstance(a, Tensor) or not isinstance(b, Tensor) or a.dim() < 2 or b.dim() < 2:
            return None
        parts, rows, cols = [a.shape[:-2], b.shape[:-2]], a.shape[-2], b.shape[-1]
    try:
        batch = torch.broadcast_shapes(*parts)
        if name == "scaled_dot_product_attention" and isinstance(mask, Tensor) and mask.dim() > 2:
            if torch.broadcast_shapes(batch, mask.shape[:-2]) != batch:  # a mask cannot grow the output
                return None
    except RuntimeError:  # grouped-query attention's fewer key heads, or a call that will fail anyway
        return None
    return torch.empty((*batch, rows, cols), device="meta")


REPEATING: frozenset[str] = frozenset({"repeat", "tile"})
"""Operations that copy their input ``sizes[0]`` times along dimension 0: a broadcast site when that makes one row
per example (:meth:`BroadcastSites._repeated`)."""


BLOCK_MEETS: frozenset[str] = frozenset({"bmm", "baddbmm", "matmul", "__matmul__", "__rmatmul__", "add", "sub", "mul",
                                          "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__"})
"""Operations that meet a tensor of per-example copies row for row with the examples (batched products, elementwise)."""

BLOCK_CARRIES: frozenset[str] = frozenset({"transpose", "permute", "contiguous", "clone", "to", "float", "double",
                                            "half", "bfloat16", "type_as"})
"""Operations that keep a tensor's rows in place (with :func:`_keeps_rows`)."""


def _keeps_rows(name: str, args: tuple) -> bool:
    """A transpose or permute that leaves dimension 0 where it is; the other carriers always do."""
    if name == "transpose":
        t, a, b = args[0], args[1], args[2]
        return a % t.dim() != 0 and b % t.dim() != 0
    if name == "permute":
        dims = list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])
        return bool(dims) and dims[0] % args[0].dim() == 0
    return True


def _keep_weakly(table: dict[int, tuple[weakref.ref, Any]], t: Tensor, value: Any) -> None:
    """``table[id(t)] = (weak reference to t, value)``, removed when t is freed (a tensor the model dropped can meet
    no further operation)."""
    key = id(t)

    def gone(ref: weakref.ref) -> None:
        entry = table.get(key)
        if entry is not None and entry[0] is ref:
            del table[key]

    table[key] = (weakref.ref(t, gone), value)


def _linear_arguments(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    """``(input, weight, bias)`` of an ``F.linear`` call, positional or keyword (timm: ``F.linear(input=x, …)``)."""
    named = (*args, *(None,) * 3)[:3]
    return tuple(kwargs.get(key, named[k]) for k, key in enumerate(("input", "weight", "bias")))  # type: ignore


def _embedding_arguments(args: tuple, kwargs: dict) -> Optional[tuple[Any, Any, Any]]:
    """``(input, weight, padding_idx)`` of an ``F.embedding`` call, positional or keyword; None when it renormalises
    (``max_norm``), scales by frequency or is sparse (not a site)."""
    keys = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    named = dict(zip(keys, args))
    named.update(kwargs)
    if named.get("max_norm") is not None or named.get("scale_grad_by_freq") or named.get("sparse"):
        return None
    return named.get("input"), named.get("weight"), named.get("padding_idx")


LOOKUPS: frozenset[str] = frozenset({"__getitem__", "index_select"})
"""Indexing that is ``F.embedding`` written otherwise (:func:`_lookup_arguments`)."""


def _indexed_dims(index: Any) -> Optional[int]:
    """How many leading dimensions ``index`` picks from (a boolean mask: its own number; an integer, a slice or an
    integer tensor: one; ``None``: none), or None where it is not a plain leading index (an ellipsis)."""
    parts = index if isinstance(index, tuple) else (index,)
    count = 0
    for k in parts:
        if k is Ellipsis:
            return None
        if k is None:
            continue
        count += k.dim() if isinstance(k, Tensor) and k.dtype == torch.bool else 1
    return count


def _lookup_arguments(name: str, args: tuple, kwargs: dict) -> Optional[tuple[Any, Any, Any]]:
    """``(ids, table, None)`` of a row lookup written as indexing: ``W[ids]``, ``W[ids, :]``, ``W[ids, ...]``, or
    ``W.index_select(0, ids)``, with an integer (not boolean) index tensor; None for any other indexing (a slice, a
    mask, an index in another dimension: not a site)."""
    if name == "__getitem__" and len(args) == 2 and not kwargs:
        table, index = args
        whole = [k is Ellipsis or (isinstance(k, slice) and k == slice(None)) for k in index[1:]] \
            if isinstance(index, tuple) else []
        if isinstance(index, tuple) and index and all(whole):
            index = index[0]
    elif name == "index_select":
        named = dict(zip(("input", "dim", "index"), args))
        named.update(kwargs)
        table, index, dim = named.get("input"), named.get("index"), named.get("dim")
        if not isinstance(table, Tensor) or not isinstance(dim, int) or dim % max(table.dim(), 1) != 0:
            return None
    else:
        return None
    if not isinstance(index, Tensor) or index.is_floating_point() or index.dtype == torch.bool:
        return None
    if index.dim() == 1 and torch.equal(index, torch.arange(index.shape[0], device=index.device)):
        # positions 0 … T−1 (self.pos[torch.arange(T)]): one sequence's rows, whatever T is, never the examples' own
        # ids, though T may equal the step's n: followed on to where they meet the examples (a broadcast site)
        return None
    return index, table, None


PRODUCTS: frozenset[str] = frozenset({"matmul", "__matmul__", "__rmatmul__", "mm", "mv"})
"""Products served as the two-operand einsum they are when one operand holds the examples in its rows and the
followed one is 1- or 2-D (:func:`_product_arguments`): ``x @ W`` (``[n, in] @ [in, out]``, ``x @ self.ws[i].t()``, a
parameter of an ``nn.ParameterList`` used as a weight) is ``einsum("ab,bc->ac", x, W)``, and example i's gradient of W
is its own row's outer product (:meth:`BroadcastSites._einsum`). A product whose followed operand has fewer
dimensions than the examples' (``[B, T, in] @ [in, out]``) is a broadcast site instead (``BROADCASTING``)."""


def _product_arguments(name: str, args: tuple, kwargs: dict) -> Optional[tuple[list[str], str, list[Tensor]]]:
    """``([left, right], out, [a, b])`` of ``a @ b`` with a 2-D ``a`` and a 1- or 2-D ``b`` (``__rmatmul__(b, a)`` is
    ``a @ b``), in the form of :func:`_einsum_arguments`; None for any other call (batched operands: a broadcast, or
    an ``out=``)."""
    if kwargs or len(args) != 2:
        return None
    a, b = (args[1], args[0]) if name == "__rmatmul__" else args
    if not isinstance(a, Tensor) or not isinstance(b, Tensor) or a.dim() != 2 or b.dim() not in (1, 2):
        return None
    if (name == "mm" and b.dim() != 2) or (name == "mv" and b.dim() != 1):
        return None
    return ["ab", "bc" if b.dim() == 2 else "b"], "ac" if b.dim() == 2 else "a", [a, b]


def _einsum_arguments(args: tuple, kwargs: dict) -> Optional[tuple[list[str], str, list[Tensor]]]:
    """``([left, right], out, [a, b])`` of a two-operand ``torch.einsum(equation, a, b)`` (or ``(equation, [a, b])``)
    with an explicit output and no ellipsis, spaces removed; None for any other call."""
    if kwargs or not args or not isinstance(args[0], str):
        return None
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    equation = args[0].replace(" ", "")
    if len(operands) != 2 or not all(isinstance(o, Tensor) for o in operands) or "..." in equation \
            or equation.count("->") != 1:
        return None
    inputs, out = equation.split("->")
    parts = inputs.split(",")
    if len(parts) != 2 or not all(p.isalpha() for p in parts) or not (out.isalpha() or out == ""):
        return None
    return parts, out, operands


def _innermost_mode() -> Optional[TorchFunctionMode]:
    """The innermost active TorchFunctionMode (None where torch does not say: the mode then stays entered)."""
    current = getattr(torch.overrides, "_get_current_function_mode", None)
    return current() if current is not None else None


def _grows_examples(t: Tensor, result: Any, rows: set[int]) -> bool:
    """Whether ``result`` has one row per example (n, or the n·m rows of flattened examples) in dimension 0 that
    ``t`` broadcasts into (t's aligned dimension 0 is 1 or absent)."""
    if not isinstance(result, Tensor) or result.dim() == 0 or result.shape[0] not in rows or t.dim() > result.dim():
        return False
    return t.dim() < result.dim() or t.shape[0] == 1
