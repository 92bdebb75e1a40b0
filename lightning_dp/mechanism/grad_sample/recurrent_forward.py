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
  :class:`~lightning_dp.mechanism.recurrent_tape.RecurrentTape` for the clipping. The weights get no ``.grad`` (as
  ghost's Linear layers: their clipped sums replace it).

Only calls the rule serves whole take this path (:func:`taped_forward` says None otherwise, and the caller runs the
module's own forward): a padded 3-D tensor input, ``hx`` None or of the module's own shape and dtype, no
``proj_size``, no inter-layer dropout in training, the module's registered parameters (not a ``functional_call``'s
substitutes), and no autocast, ``torch.compile`` tracing or functorch transform around the call. A
``PackedSequence`` keeps the module's own forward and the recomputation at the clipping. Whatever path a call took,
the first step's probe compares the clipped sums, weights and inputs' alike, with autograd on the module's own
forward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lightning_dp.mechanism.grad_sample.rnn_unrolled import fused_layer_call, layers_backward
from lightning_dp.mechanism.recurrent_tape import RecurrentTape

_SERVED = (nn.LSTM, nn.GRU, nn.RNN)


class _TapedRNN(torch.autograd.Function):
    """The whole call (every layer and direction): outputs ``(output, h_n[, c_n])`` as torch's kernel returns them."""

    @staticmethod
    def forward(ctx, module: nn.RNNBase, tape: RecurrentTape, x: Tensor, h0: Optional[Tensor],
                c0: Optional[Tensor], *flat: Tensor) -> tuple[Tensor, ...]:
        h0_, c0_ = _initial_state(module, x, h0, c0)
        dirs, per = _directions(module), len(flat) // module.num_layers
        values, h_n, c_n = [], [], []
        inp = x
        for layer in range(module.num_layers):
            span = slice(layer * dirs, (layer + 1) * dirs)
            res = fused_layer_call(module, inp, h0_[span], None if c0_ is None else c0_[span],
                                   list(flat[layer * per:(layer + 1) * per]), batch_first=module.batch_first)
            inp = res[0]
            values.append(inp)
            h_n.append(res[1])
            c_n.extend(res[2:])
        # every layer's outputs, the last one's a copy: the model may change the output in place (out.mul_(mask);
        # torch's own backward allows it), and the alias the capture hands it shares the storage
        ctx.module, ctx.tape, ctx.values = module, tape, (*values[:-1], values[-1].clone())
        ctx.save_for_backward(x, h0, c0, *flat)
        ctx.set_materialize_grads(False)
        return (values[-1], torch.cat(h_n)) + ((torch.cat(c_n),) if c_n else ())

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out: Optional[Tensor], d_hn: Optional[Tensor], *d_cn: Optional[Tensor]):
        module: nn.RNNBase = ctx.module
        x, h0, c0, *flat = ctx.saved_tensors
        front = _batch_first(module)
        h0_, c0_ = _initial_state(module, x, h0, c0)
        weights = dict(zip(module._flat_weights_names, flat))
        needs = ctx.needs_input_grad
        result = layers_backward(module, [front(v) for v in (x, *ctx.values)], None, h0_, c0_,
                                 (front(d_out), d_hn, d_cn[0] if d_cn else None), weights, set(ctx.tape.names),
                                 input_grads=needs[2], initial_grads=needs[3] or needs[4])
        ctx.tape.receive(result.forms)
        d_x = front(result.d_input) if needs[2] else None
        return (None, None, d_x, result.d_h0 if needs[3] else None, result.d_c0 if needs[4] else None,
                *([None] * len(flat)))


def _directions(module: nn.RNNBase) -> int:
    return 2 if module.bidirectional else 1


def _batch_first(module: nn.RNNBase):
    """``[n, T, …]`` of a tensor in the module's layout (a view), and back: transposition is its own inverse."""
    if module.batch_first:
        return lambda t: t
    return lambda t: None if t is None else t.transpose(0, 1)


def _initial_state(module: nn.RNNBase, x: Tensor, h0: Optional[Tensor],
                   c0: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """h_0 (and c_0 for an LSTM) ``[layers·directions, n, H]``: the given ones, zeros otherwise."""
    shape = (module.num_layers * _directions(module), x.shape[0 if module.batch_first else 1], module.hidden_size)
    h = h0 if h0 is not None else x.new_zeros(shape)
    if not isinstance(module, nn.LSTM):
        return h, None
    return h, (c0 if c0 is not None else x.new_zeros(shape))


def _state_ok(module: nn.RNNBase, x: Tensor, hx: Any) -> bool:
    """Whether ``hx`` is None or the module's initial state: ``[layers·directions, n, H]`` tensors of x's dtype and
    device (a tuple of two for an LSTM). Anything else keeps the module's own forward (and its own errors)."""
    if hx is None:
        return True
    shape = (module.num_layers * _directions(module), x.shape[0 if module.batch_first else 1], module.hidden_size)
    states = hx if isinstance(module, nn.LSTM) else (hx,)
    if not isinstance(states, (tuple, list)) or len(states) != (2 if isinstance(module, nn.LSTM) else 1):
        return False
    return all(isinstance(s, Tensor) and tuple(s.shape) == shape and s.dtype == x.dtype and s.device == x.device
               for s in states)


def _served(module: nn.RNNBase, x: Any, hx: Any) -> bool:
    """Whether :func:`taped_forward` serves this call (module docstring)."""
    if type(module) not in _SERVED or getattr(module, "proj_size", 0):
        return False
    if module.dropout and module.training and module.num_layers > 1:
        return False
    if not (isinstance(x, Tensor) and x.dim() == 3 and x.numel() and x.shape[-1] == module.input_size):
        return False
    if (not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active()
            or torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type)):
        return False
    flat = module._flat_weights
    if not all(isinstance(w, nn.Parameter) and w.dtype == x.dtype and w.device == x.device for w in flat):
        return False  # a functional_call's substitutes, or a dtype/device the module's own forward will refuse
    return any(w.requires_grad for w in flat) and _state_ok(module, x, hx)


def taped_forward(module: nn.RNNBase, args: tuple, kwargs: dict) -> Optional[tuple[Tensor, Any]]:
    """The module's call ``module(*args, **kwargs)`` by :class:`_TapedRNN`: ``(output, h_n)`` or
    ``(output, (h_n, c_n))`` as the module returns them; None where the call is not served (module docstring), and
    the caller runs the module's own forward. The module's list of weights must be up to date with its attributes
    (``_update_flat_weights``)."""
    if len(args) + len(kwargs) > 2 or not set(kwargs) <= {"input", "hx"}:
        return None
    x = args[0] if args else kwargs.get("input")
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    if not _served(module, x, hx):
        return None
    h0, c0 = (hx, None) if not isinstance(hx, (tuple, list)) else hx
    names = frozenset(name for name, w in zip(module._flat_weights_names, module._flat_weights) if w.requires_grad)
    res = _TapedRNN.apply(module, RecurrentTape(names), x, h0, c0, *module._flat_weights)
    return (res[0], (res[1], res[2])) if isinstance(module, nn.LSTM) else (res[0], res[1])
