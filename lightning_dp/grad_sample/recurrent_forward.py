"""The ghost engine's forward of torch's RNNs (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): torch's fused kernel forward,
the unrolled rule's backward, one backward through time per call.

Book-keeping (Bu et al.) wants from an RNN call what :mod:`.rnn_unrolled` computes: every layer's gate gradients ∂G,
from which the weights' per-example gradients are linear forms (:mod:`.linear_forms`). Those gate gradients are
also what the call's input gradient is made of (∂x_t = Σ_directions ∂G_t W_ih, ∂h_{−1} = ∂R_0 W_hh, and for an
LSTM ∂c_{−1} = dc_0·σ(f_0); rnn_unrolled's docstring). So instead of letting torch's kernel backpropagate to the
input and then recomputing the layers below the last and running the rule's backward through time again at the
clipping (as the engine did before), one ``autograd.Function``:

* forward: the fused kernel layer by layer, no graph, keeping each layer's outputs (what the rule reads; the
  kernel's own autograd would keep more: every gate of every step);
* backward: :func:`~.rnn_unrolled.layers_backward` from the output gradients ∂/∂output, ∂/∂h_n, ∂/∂c_n: the input
  and initial-state gradients autograd asks for, and the weights' linear forms, left on the call's
  :class:`~lightning_dp.grad_sample.capture.recurrent_tape.RecurrentTape` for the clipping. The weights get no ``.grad``
  (as
  ghost's Linear layers: their clipped sums replace it).

A ``PackedSequence`` (``pack_padded_sequence``, sorted or not) runs the kernel's packed form on its data, the states
in its sorted order as the module's own forward has them; the backward brings everything to padded rows in the
batch's order (each example's recurrence stopping at its own length: rnn_unrolled's docstring) and the input
gradient back to the packed rows.

Only calls the rule serves whole take this path (:func:`taped_forward` says None otherwise, and the caller runs the
module's own forward, the recomputation at the clipping then): a padded 3-D tensor or a ``PackedSequence``, ``hx``
None or of the module's own shape and dtype (h_0 ``proj_size`` wide for an LSTM with projections), no inter-layer
dropout in training, the module's
registered parameters (not a ``functional_call``'s substitutes), and no autocast, ``torch.compile`` tracing or
functorch transform around the call. Whatever path a call took, the first step's probe compares the clipped sums,
weights and inputs' alike, with autograd on the module's own forward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from lightning_dp.grad_sample.rnn_unrolled import (
    fused_layer_call,
    initial_state,
    layer_weights,
    layers_backward,
    padded_rows,
    state_shapes,
)
from lightning_dp.grad_sample.capture.recurrent_tape import RecurrentTape

_SERVED = (nn.LSTM, nn.GRU, nn.RNN)


Packing = Optional[tuple[Tensor, Optional[Tensor], Optional[Tensor]]]
"""A ``PackedSequence``'s ``(batch_sizes, sorted_indices, unsorted_indices)``, or None for a padded call."""


class _TapedRNN(torch.autograd.Function):
    """The whole call (every layer and direction): outputs ``(output, h_n[, c_n])`` as torch's kernel returns them; on
    a ``PackedSequence`` (``packing``), the packed data and the final states in its sorted order, as the module's own
    forward has them before putting the states back in the batch's order."""

    @staticmethod
    def forward(ctx, module: nn.RNNBase, tape: RecurrentTape, packing: Packing, x: Tensor, h0: Optional[Tensor],
                c0: Optional[Tensor], *flat: Tensor) -> tuple[Tensor, ...]:
        h0_, c0_ = _initial_state(module, x, packing, h0, c0)
        dirs = _directions(module)
        batch_sizes = None if packing is None else packing[0]
        values, h_n, c_n = [], [], []
        inp = x
        for layer, layer_flat in enumerate(layer_weights(module, dict(zip(module._flat_weights_names, flat)))):
            span = slice(layer * dirs, (layer + 1) * dirs)
            res = fused_layer_call(module, inp, h0_[span], None if c0_ is None else c0_[span], layer_flat,
                                   batch_sizes, module.batch_first)
            inp = res[0]
            values.append(inp)
            h_n.append(res[1])
            c_n.extend(res[2:])
        # every layer's outputs, the last one's a copy: the model may change the output in place (out.mul_(mask);
        # torch's own backward allows it), and the alias the capture hands it shares the storage
        ctx.module, ctx.tape, ctx.packing = module, tape, packing
        ctx.values = (*values[:-1], values[-1].clone())
        ctx.save_for_backward(x, h0, c0, *flat)
        ctx.set_materialize_grads(False)
        return (values[-1], torch.cat(h_n)) + ((torch.cat(c_n),) if c_n else ())

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out: Optional[Tensor], d_hn: Optional[Tensor], *d_cn: Optional[Tensor]):
        module: nn.RNNBase = ctx.module
        # detached: the forms keep the input itself (a GRU's x_t), and a form holding the graph of the call's input
        # would give the clipped sums and norms the clipping takes from it a graph, kept alive with its memory
        x, h0, c0, *flat = (None if t is None else t.detach() for t in ctx.saved_tensors)
        needs = ctx.needs_input_grad
        rows = _Rows(module, ctx.packing, x)
        h0_, c0_ = _initial_state(module, x, ctx.packing, h0, c0)
        result = layers_backward(module, [rows.padded(v) for v in (x, *ctx.values)], rows.lengths,
                                 rows.state(h0_), rows.state(c0_),
                                 (rows.padded(d_out), rows.state(d_hn), rows.state(d_cn[0] if d_cn else None)),
                                 dict(zip(module._flat_weights_names, flat)), set(ctx.tape.names),
                                 input_grads=needs[3], initial_grads=needs[4] or needs[5])
        ctx.tape.receive(result.forms)
        return (None, None, None, rows.laid_out(result.d_input) if needs[3] else None,
                rows.sorted_state(result.d_h0) if needs[4] else None,
                rows.sorted_state(result.d_c0) if needs[5] else None, *([None] * len(flat)))


class _Rows:
    """The call's layouts: the rule's padded batch-first ``[n, T, …]`` rows in the batch's order, and the call's own
    (the module's ``batch_first`` layout; or a ``PackedSequence``'s data, its states in the sorted order)."""

    def __init__(self, module: nn.RNNBase, packing: Packing, x: Tensor) -> None:
        self.batch_first, self.packing = module.batch_first, packing
        self.lengths: Optional[Tensor] = None
        if packing is not None:  # ℓ_i = #{t: batch_sizes[t] > rank of i in the sorted order}
            self.packed = PackedSequence(x, *packing)
            batch_sizes, undo = packing[0], packing[2]
            ranks = torch.arange(int(batch_sizes[0]))
            lengths = (batch_sizes.unsqueeze(0) > ranks.unsqueeze(1)).sum(1)
            self.lengths = (lengths if undo is None else lengths[undo.cpu()]).to(x.device)

    def padded(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """Call layout → padded batch-first rows in the batch's order (a view for a padded call)."""
        if t is None:
            return None
        if self.packing is None:
            return t if self.batch_first else t.transpose(0, 1)
        return padded_rows(self.packed, t)[0]

    def laid_out(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """Padded batch-first rows → the call's layout (inverse of :meth:`padded`)."""
        if t is None or self.packing is None:
            return t if t is None or self.batch_first else t.transpose(0, 1)
        order = self.packing[1]
        lengths = self.lengths if order is None else self.lengths[order]
        rows = t if order is None else t.index_select(0, order)
        return pack_padded_sequence(rows, lengths.cpu(), batch_first=True).data

    def state(self, s: Optional[Tensor]) -> Optional[Tensor]:
        """An initial or final state ``[layers·directions, n, H]`` in the batch's order (from a packed call's sorted
        order)."""
        undo = None if self.packing is None else self.packing[2]
        return s if s is None or undo is None else s.index_select(1, undo)

    def sorted_state(self, s: Optional[Tensor]) -> Optional[Tensor]:
        """:meth:`state`'s inverse."""
        order = None if self.packing is None else self.packing[1]
        return s if s is None or order is None else s.index_select(1, order)


def _directions(module: nn.RNNBase) -> int:
    return 2 if module.bidirectional else 1


def _examples(module: nn.RNNBase, x: Tensor, packing: Packing) -> int:
    return int(packing[0][0]) if packing is not None else x.shape[0 if module.batch_first else 1]


def _initial_state(module: nn.RNNBase, x: Tensor, packing: Packing, h0: Optional[Tensor],
                   c0: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """h_0 (and c_0 for an LSTM): the given ones, zeros otherwise (:func:`~.rnn_unrolled.initial_state`)."""
    return initial_state(module, _examples(module, x, packing), x, h0, c0)


def _state_ok(module: nn.RNNBase, x: Tensor, packing: Packing, hx: Any) -> bool:
    """Whether ``hx`` is None or the module's initial state: tensors of :func:`~.rnn_unrolled.state_shapes` (a tuple
    of two for an LSTM) of x's dtype and device. Anything else keeps the module's own forward (and its own errors)."""
    if hx is None:
        return True
    shapes = state_shapes(module, _examples(module, x, packing))
    states = hx if isinstance(module, nn.LSTM) else (hx,)
    if not isinstance(states, (tuple, list)) or len(states) != len(shapes):
        return False
    return all(isinstance(s, Tensor) and tuple(s.shape) == shape and s.dtype == x.dtype and s.device == x.device
               for s, shape in zip(states, shapes))


def _served(module: nn.RNNBase, x: Any, hx: Any) -> bool:
    """Whether :func:`taped_forward` serves this call (module docstring)."""
    if type(module) not in _SERVED:
        return False
    if module.dropout and module.training and module.num_layers > 1:
        return False
    packing = _packing(x)
    data = x.data if isinstance(x, PackedSequence) else x
    if not (isinstance(data, Tensor) and data.dim() == (2 if packing is not None else 3) and data.numel()
            and data.shape[-1] == module.input_size):
        return False
    if (not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active()
            or torch.compiler.is_compiling() or torch.is_autocast_enabled(data.device.type)):
        return False
    flat = module._flat_weights
    if not all(isinstance(w, nn.Parameter) and w.dtype == data.dtype and w.device == data.device for w in flat):
        return False  # a functional_call's substitutes, or a dtype/device the module's own forward will refuse
    return any(w.requires_grad for w in flat) and _state_ok(module, data, packing, hx)


def _packing(x: Any) -> Packing:
    return (x.batch_sizes, x.sorted_indices, x.unsorted_indices) if isinstance(x, PackedSequence) else None


def taped_forward(module: nn.RNNBase, args: tuple, kwargs: dict) -> Optional[tuple[Any, Any]]:
    """The module's call ``module(*args, **kwargs)`` by :class:`_TapedRNN`: ``(output, h_n)`` or
    ``(output, (h_n, c_n))`` as the module returns them (the output a ``PackedSequence`` for a packed input); None
    where the call is not served (module docstring), and the caller runs the module's own forward. The module's list
    of weights must be up to date with its attributes (``_update_flat_weights``)."""
    if len(args) + len(kwargs) > 2 or not set(kwargs) <= {"input", "hx"}:
        return None
    x = args[0] if args else kwargs.get("input")
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    if not _served(module, x, hx):
        return None
    packing = _packing(x)
    h0, c0 = (hx, None) if not isinstance(hx, (tuple, list)) else hx
    if packing is not None and packing[1] is not None:  # the kernel takes the states in the sorted order
        h0, c0 = (None if s is None else s.index_select(1, packing[1]) for s in (h0, c0))
    names = frozenset(name for name, w in zip(module._flat_weights_names, module._flat_weights) if w.requires_grad)
    data = x.data if packing is not None else x
    res = _TapedRNN.apply(module, RecurrentTape(names), packing, data, h0, c0, *module._flat_weights)
    out: Any = res[0] if packing is None else PackedSequence(res[0], *packing)
    states = [s if packing is None or packing[2] is None else s.index_select(1, packing[2]) for s in res[1:]]
    return (out, (states[0], states[1])) if isinstance(module, nn.LSTM) else (out, states[0])
