"""Per-example gradients of ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` from one recomputation and a hand-written
backward through time.

The fused RNN kernels cannot run under ``torch.func.vmap``, and one small backward per example
(:func:`~lightning_dp.grad_sample.functorch_vmap.loop_layer_grads`) costs n backward
passes. Here the recorded call is recomputed once, layer by layer with torch's own fused kernel (all
hidden states h_t of the layer in one call; the last layer's are the call's own recorded output, so only
the layers below it run again), and from them, for all time steps at once, the gate pre-activations
G_t = x_t W_ihᵀ + b_ih and R_t = h_{t−1} W_hhᵀ + b_hh (for an LSTM or RNN, whose cell reads only their
sum, G_t + R_t = [x_t, h_{t−1}] [W_ih, W_hh]ᵀ + b_ih + b_hh in one product). The gradients ∂/∂G_t and
∂/∂R_t of Σ_k ⟨f_k(θ, x), δ_k⟩ (δ_k: the recorded output gradients) then come from the cell's
derivative written out by hand (below): everything that depends only on the forward values is
computed for all steps in a few vectorised operations, and only the recurrence itself (the carried
∂/∂h_{t−1}, and ∂/∂c_{t−1} for an LSTM) stays a loop over time, two to five small kernels per step
instead of the dozens of autograd nodes of an unrolled graph. Each row is one example's, since
examples never meet inside the recurrence. Then, per example i (Bu et al.'s book-keeping for
linear maps),

    ∇W_ih = n Σ_t ∂G_{t,i} ⊗ x_{t,i},   ∇b_ih = n Σ_t ∂G_{t,i},
    ∇W_hh = n Σ_t ∂R_{t,i} ⊗ h_{t−1,i}, ∇b_hh = n Σ_t ∂R_{t,i}

(n undoes the mean's 1/n, as everywhere): the per-example loop's result, for one recomputation and
one batched matrix product per weight. A lower layer's output gradient is the upper layer's input gradient
Σ_directions ∂G W_ih.

Cells (torch.nn docs; gate order as in the weights) and their derivatives (dh: the total gradient
reaching h_t, the step's output gradient plus what h_{t+1} carries back):

* LSTM (i, f, g, o): c = σ(f)·c₋ + σ(i)·tanh(g), h = σ(o)·tanh(c).
  dc = dh·σ(o)·(1 − tanh²c) + dc₊·σ(f₊); ∂(i, f, g, o) = (dc·tanh(g)·σ'(i), dc·c₋·σ'(f),
  dc·σ(i)·(1 − tanh²g), dh·tanh(c)·σ'(o)); ∂R = ∂G; dh₋ = ∂R W_hh.
* GRU (r, z, n): n = tanh(G_n + σ(r)·R_n), h = (1 − σ(z))·n + σ(z)·h₋.
  ∂G_n = dh·(1 − z)(1 − n²), ∂R_n = ∂G_n·r, ∂G_r = ∂R_r = ∂G_n·R_n·σ'(r),
  ∂G_z = ∂R_z = dh·(h₋ − n)·σ'(z); dh₋ = dh·z + ∂R W_hh.
* RNN: h = tanh or relu(G + R); ∂G = ∂R = dh·act'; dh₋ = ∂R W_hh.

A call on a ``PackedSequence`` (``pack_padded_sequence``, sorted or not) is recomputed on the packed
data with the fused kernel's packed form, and everything is then brought to padded ``[n, T, …]`` rows in
the batch's own order (``unsorted_indices``), zeros past each example's length ℓ_i, output gradients
too. Example i's recurrence runs over t < ℓ_i only; the padded steps after it are made inert rather than
masked: the gradient of h_n (and c_n) enters at step ℓ_i − 1, where the packed state stops, instead of at
T − 1, so ∂/∂h_t = ∂/∂c_t = 0 for every t ≥ ℓ_i and the gates there get exactly zero gradient (the values
computed on the padding multiply only these zeros). The reverse direction of a bidirectional layer reads
example i from ℓ_i − 1 down to 0: each row is reversed within its own length,

    rev_i(t) = ℓ_i − 1 − t for t < ℓ_i, t otherwise,

which makes it a forward recurrence of the same shape; its input gradient is reversed back by the same
index (rev_i is its own inverse).

The same backward through time (:func:`layers_backward`), carried one layer further down, gives the call's input
gradient Σ_directions ∂G W_ih and its initial state's, ∂/∂h_{−1} = ∂R_0 W_hh (GRU: + dh_0·z_0) and an LSTM's
∂/∂c_{−1} = dc_0·σ(f_0): the ghost engine's forward of these modules (:mod:`.recurrent_forward`) uses it as the
call's whole backward, and its forms reach the clipping without this recomputation.

An LSTM with ``proj_size`` P (h_t = W_hr m_t, m_t = σ(o)·tanh(c_t)) carries dh_t ``[n, P]`` through W_hh ``[4H, P]``
and gives the cell dm_t = dh_t W_hr; W_hr's per-example gradient is one more form, n Σ_t dh_t ⊗ m_t.

Served: any ``num_layers``, ``bidirectional``, ``bias``, ``batch_first``, ``proj_size``, a given initial state,
padded tensors and ``PackedSequence``; no inter-layer dropout in training (that keeps one small backward per
example; on a ``PackedSequence`` training dropout is refused by the capture,
:func:`~lightning_dp.validators.example_dim.packed_sequence_error`).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from lightning_dp.grad_sample.capture.activations import LayerCalls
from lightning_dp.grad_sample.linear_forms import LinearForm, form_grads, wanted_form

_SERVED = (nn.LSTM, nn.GRU, nn.RNN)


def recorded_input(rec: Any) -> Any:
    """The input sequence of a recorded RNN call: a tensor or a ``PackedSequence``."""
    return rec.args[0] if rec.args else rec.kwargs.get("input")


def unrolled_supported(module: nn.Module, rec: Any) -> bool:
    """Whether :func:`unrolled_rnn_grads` serves this RNN and recorded call."""
    if type(module) not in _SERVED:
        return False
    if module.dropout and module.training and module.num_layers > 1:
        return False  # random masks between layers: the loop path replays them
    x = recorded_input(rec)
    if isinstance(x, PackedSequence):
        return x.data.dim() == 2 and not rec.flattened
    return isinstance(x, Tensor) and x.dim() == 3 and (module.batch_first or not rec.flattened)


def state_shapes(module: nn.RNNBase, n: int) -> list[tuple[int, int, int]]:
    """The shapes ``[layers·directions, n, ·]`` of the module's initial state over n examples: h_0's (``proj_size``
    wide for an LSTM with projections, else ``hidden_size``), then an LSTM's c_0 (``hidden_size``)."""
    layers = module.num_layers * (2 if module.bidirectional else 1)
    h = (layers, n, getattr(module, "proj_size", 0) or module.hidden_size)
    return [h, (layers, n, module.hidden_size)] if isinstance(module, nn.LSTM) else [h]


def initial_state(module: nn.RNNBase, n: int, like: Tensor, h0: Optional[Tensor] = None,
                  c0: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """h_0 (and c_0 for an LSTM) over n examples: the given ones, zeros of :func:`state_shapes` otherwise."""
    shapes = state_shapes(module, n)
    h = h0 if h0 is not None else like.new_zeros(shapes[0])
    if len(shapes) == 1:
        return h, None
    return h, (c0 if c0 is not None else like.new_zeros(shapes[1]))


def _initial(module: nn.RNNBase, rec: Any, n: int, like: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """h_0 (and c_0 for an LSTM) of a recorded call, in the batch's order; zeros when not given."""
    hx = rec.args[1] if len(rec.args) > 1 else rec.kwargs.get("hx")
    if hx is None:
        return initial_state(module, n, like)
    if isinstance(hx, (tuple, list)):
        return hx[0].detach().to(like.dtype), hx[1].detach().to(like.dtype)
    return hx.detach().to(like.dtype), None


def layer_weights(module: nn.RNNBase, weights: dict[str, Tensor]) -> list[list[Tensor]]:
    """Each layer's weights (every direction) in torch's own order (``_flat_weights_names``: what its fused kernel
    takes for one layer, ``weight_hr`` included with projections)."""
    names = module._flat_weights_names
    per = len(names) // module.num_layers
    return [[weights[name] for name in names[layer * per:(layer + 1) * per]] for layer in range(module.num_layers)]


def _fused_layer(module: nn.RNNBase, inp: Tensor, h0: Tensor, c0: Optional[Tensor], flat: list[Tensor],
                 batch_sizes: Optional[Tensor] = None) -> Tensor:
    """One layer, every direction, by torch's fused kernel (what the module's own forward runs):
    its outputs ``[n, T, directions·H]`` from ``[n, T, D]`` inputs or, with ``batch_sizes``, the packed
    outputs ``[rows, directions·H]`` from a ``PackedSequence``'s data ``[rows, D]`` (h0, c0 in its sorted order)."""
    return fused_layer_call(module, inp, h0, c0, flat, batch_sizes)[0]


def fused_layer_call(module: nn.RNNBase, inp: Tensor, h0: Tensor, c0: Optional[Tensor], flat: list[Tensor],
                     batch_sizes: Optional[Tensor] = None, batch_first: bool = True) -> tuple[Tensor, ...]:
    """torch's fused kernel on one layer's ``flat`` weights (every direction): (outputs, h_n, c_n for an LSTM), on
    ``inp`` laid out ``[n, T, D]`` (``[T, n, D]`` with ``batch_first`` False) or, with ``batch_sizes``, a
    ``PackedSequence``'s data. One layer's weights are never cuDNN's single flattened chunk (the whole module's):
    cuDNN compacts them for the call, and its warning about that, which would name this file and not the user's
    module, is silenced here."""
    if batch_sizes is None:
        lead, tail = (inp,), (flat, module.bias, 1, 0.0, False, module.bidirectional, batch_first)
    else:
        lead, tail = (inp, batch_sizes), (flat, module.bias, 1, 0.0, False, module.bidirectional)
    with warnings.catch_warnings():
        if inp.is_cuda:
            warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous chunk")
        if isinstance(module, nn.LSTM):
            assert c0 is not None
            return tuple(torch.lstm(*lead, (h0, c0), *tail))
        if isinstance(module, nn.GRU):
            return tuple(torch.gru(*lead, h0, *tail))
        kernel = torch.rnn_relu if module.nonlinearity == "relu" else torch.rnn_tanh
        return tuple(kernel(*lead, h0, *tail))


def padded_rows(packed: PackedSequence, data: Tensor) -> tuple[Tensor, Tensor]:
    """``data``, laid out as ``packed``'s rows, as padded ``[n, T, …]`` in the batch's own order (zeros past each
    example's length), and the lengths ℓ ``[n]``."""
    out, lengths = pad_packed_sequence(packed._replace(data=data), batch_first=True)
    return out, lengths.to(data.device)


def _sorted(t: Optional[Tensor], order: Optional[Tensor]) -> Optional[Tensor]:
    """An initial state ``[layers·directions, n, H]`` in a ``PackedSequence``'s sorted order."""
    return t if t is None or order is None else t.index_select(1, order)


def _layer_values(module: nn.RNNBase, x: Any, h0: Tensor, c0: Optional[Tensor], flats: list[list[Tensor]],
                  top: Optional[Tensor]) -> tuple[list[Tensor], Optional[Tensor]]:
    """Each layer's input and the last layer's output, batch-first ``[n, T, ·]`` in the batch's order: the layers
    below the last recomputed by the fused kernel, the last one the call's own recorded output ``top`` (recomputed
    too where none was recorded); for a ``PackedSequence`` padded with zeros past each length, and the lengths ℓ
    ``[n]`` (``None`` for a padded call: every example runs all T steps)."""
    dirs = 2 if module.bidirectional else 1
    spans = [slice(layer * dirs, (layer + 1) * dirs) for layer in range(module.num_layers)]
    recomputed = flats if top is None else flats[:-1]
    if not isinstance(x, PackedSequence):
        values = [x if module.batch_first else x.transpose(0, 1)]
        for flat, span in zip(recomputed, spans):
            values.append(_fused_layer(module, values[-1], h0[span], None if c0 is None else c0[span], flat))
        if top is not None:
            values.append(top if module.batch_first else top.transpose(0, 1))
        return values, None
    h0s, c0s = _sorted(h0, x.sorted_indices), _sorted(c0, x.sorted_indices)
    data = [x.data]
    for flat, span in zip(recomputed, spans):
        data.append(_fused_layer(module, data[-1], h0s[span], None if c0s is None else c0s[span], flat,
                                 x.batch_sizes))
    if top is not None:
        data.append(top)
    padded = [padded_rows(x, d) for d in data]
    return [p for p, _ in padded], padded[0][1]


def _reversal(lengths: Tensor, T: int) -> Tensor:
    """rev_i(t) ``[n, T]`` (module docstring): ℓ_i − 1 − t for t < ℓ_i, t on the padding after it."""
    t = torch.arange(T, device=lengths.device)
    ell = lengths.unsqueeze(1)
    return torch.where(t < ell, ell - 1 - t, t)


def _reverse(t: Tensor, rev: Optional[Tensor]) -> Tensor:
    """``[n, T, …]`` with time reversed: all T steps (``rev`` None), or row i within its own length (rev_i)."""
    if rev is None:
        return t.flip(1)
    return t.gather(1, rev.view(*rev.shape, *([1] * (t.dim() - 2))).expand_as(t))


def _at_last_step(seq: Optional[Tensor], last: Tensor, final: Optional[Tensor], T: int) -> Optional[Tensor]:
    """``seq`` ``[n, T, H]`` plus the final state's gradient ``final`` ``[n, H]`` at each example's last step
    ``last_i`` = ℓ_i − 1 (where its packed state stops); ``seq`` unchanged without ``final``."""
    if final is None:
        return seq
    base = final.new_zeros(final.shape[0], T, final.shape[1]) if seq is None else seq
    rows = torch.arange(final.shape[0], device=final.device)
    return base.index_put((rows, last), final, accumulate=True)


def _steps(t: Optional[Tensor]) -> Optional[tuple[Tensor, ...]]:
    """The per-step views of an ``[n, T, …]`` tensor, made once (indexing in the loop costs a dispatch per step)."""
    return None if t is None else t.unbind(1)


class _LSTMGrads(NamedTuple):
    """:func:`_lstm_backward`'s result: ∂G = ∂R ``[n, T, 4H]``; the initial state's gradients (or None); and with a
    projection W_hr, the gradients reaching each projected h_t ``[n, T, P]`` and what W_hr multiplies,
    m_t = σ(o_t)·tanh(c_t) ``[n, T, H]``."""

    d_g: Tensor
    dh0: Optional[Tensor] = None
    dc0: Optional[Tensor] = None
    dh: Optional[Tensor] = None
    m: Optional[Tensor] = None


def _lstm_backward(pre: Tensor, c0: Tensor, dh_seq: Optional[Tensor], dh_last: Optional[Tensor],
                   dc_last: Optional[Tensor], w_hh: Tensor, dc_seq: Optional[Tensor] = None,
                   initial: bool = False, w_hr: Optional[Tensor] = None) -> _LSTMGrads:
    """∂G = ∂R ``[n, T, 4H]`` of an LSTM direction from its pre-activations G + R (module docstring), and with
    ``initial`` the initial state's gradients ∂/∂h_{−1} = ∂G_0 W_hh, ∂/∂c_{−1} = dc_0·σ(f_0) (else None);
    ``dc_seq``: gradients reaching c_t from outside the recurrence (c_n's, at each example's last step). With
    ``proj_size`` (``w_hr`` ``[P, H]``: h_t = W_hr m_t, m_t = σ(o)·tanh(c_t)), the cell's own gradient is
    dm_t = dh_t W_hr, and dh_t ``[n, T, P]`` with m_t are returned for W_hr's form."""
    n, T, H4 = pre.shape
    H = H4 // 4
    act = torch.sigmoid(pre)
    g = torch.tanh(pre[..., 2 * H:3 * H])
    gates = act.view(n, T, 4, H)
    i, f, o = gates[:, :, 0], gates[:, :, 1], gates[:, :, 3]
    ig = i * g
    cs = pre.new_empty(n, T + 1, H)  # c_{t−1} at step t, c_t at step t + 1
    c_rows, ig_rows, fs = cs.unbind(1), ig.unbind(1), f.unbind(1)
    c_rows[0].copy_(c0)
    for t in range(T):
        torch.addcmul(ig_rows[t], fs[t], c_rows[t], out=c_rows[t + 1])
    tc = torch.tanh(cs[:, 1:])
    to_c = torch.addcmul(o, o * tc, tc, value=-1).unbind(1)  # ∂c/∂m through m = σ(o)·tanh(c)
    m = o * tc if w_hr is not None else None
    # per gate, ∂gate/∂(its multiplier): i: tanh(g)σ'(i), f: c₋σ'(f), g: σ(i)(1 − tanh²g), o: tanh(c)σ'(o);
    # the buffer then becomes ∂G in place, step by step (i, f, g times dc; o times dm)
    d_gates = torch.addcmul(act, act, act, value=-1).view(n, T, 4, H)  # σ' everywhere first
    d_gates[:, :, 0].mul_(g)
    d_gates[:, :, 1].mul_(cs[:, :-1])
    torch.addcmul(i, ig, g, value=-1, out=d_gates[:, :, 2])
    d_gates[:, :, 3].mul_(tc)
    rows, ifg, o_rows = d_gates.view(n, T, H4).unbind(1), d_gates[:, :, :3].unbind(1), d_gates[:, :, 3].unbind(1)
    d_seq = _steps(dh_seq)
    P = w_hh.shape[1]  # H, or proj_size
    dh_all = pre.new_empty(n, T, P) if w_hr is not None else None
    dh_rows = None if dh_all is None else dh_all.unbind(1)
    dh = dh_last if dh_last is not None else pre.new_zeros(n, P)
    dh = dh if d_seq is None else d_seq[T - 1] + dh
    dc = dc_last if dc_last is not None else pre.new_zeros(n, H)
    dc_rows = _steps(dc_seq)
    for t in range(T - 1, -1, -1):
        if t < T - 1:  # dh_t = δ_t + ∂G_{t+1} W_hh, dc_t = dc_{t+1}·σ(f_{t+1}) + dm_t·∂c/∂m
            dh = torch.mm(rows[t + 1], w_hh) if d_seq is None else torch.addmm(d_seq[t], rows[t + 1], w_hh)
            dc = dc * fs[t + 1]
        if dc_rows is not None:
            dc = dc + dc_rows[t]
        dm = dh
        if dh_rows is not None:
            dh_rows[t].copy_(dh)
            dm = torch.mm(dh, w_hr)
        dc = torch.addcmul(dc, dm, to_c[t])
        ifg[t].mul_(dc.unsqueeze(1))
        o_rows[t].mul_(dm)
    d = d_gates.view(n, T, H4)
    if not initial:
        return _LSTMGrads(d, dh=dh_all, m=m)
    return _LSTMGrads(d, torch.mm(rows[0], w_hh), dc * fs[0], dh_all, m)


def _gru_backward(gi: Tensor, gh: Tensor, h_prev: Tensor, dh_seq: Optional[Tensor], dh_last: Optional[Tensor],
                  w_hh: Tensor, initial: bool = False) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(∂G, ∂R), both ``[n, T, 3H]``, of a GRU direction (module docstring), and with ``initial`` the initial
    state's gradient ∂/∂h_{−1} = dh_0·z_0 + ∂R_0 W_hh (else None)."""
    n, T, H3 = gi.shape
    H = H3 // 3
    g_r, g_z, g_n = gi.view(n, T, 3, H).unbind(2)
    r_r, r_z, r_n = gh.view(n, T, 3, H).unbind(2)
    r, z = torch.sigmoid(g_r + r_r), torch.sigmoid(g_z + r_z)
    new = torch.tanh(torch.addcmul(g_n, r, r_n))
    a_n = (1 - z) * (1 - new * new)
    a_z = (h_prev - new) * z * (1 - z)
    a_r = a_n * r_n * r * (1 - r)
    to_r = torch.stack([a_r, a_z, a_n * r], dim=2)  # ∂R per dh
    to_r_rows, zs = _steps(to_r), _steps(z)
    dh_all = gi.new_empty(n, T, H)
    d_rec = gi.new_empty(n, T, 3, H)
    dh_rows, rec_rows = dh_all.unbind(1), d_rec.unbind(1)
    d_seq = _steps(dh_seq)
    dh = dh_last if dh_last is not None else gi.new_zeros(n, H)
    dh_rows[T - 1].copy_(dh if d_seq is None else d_seq[T - 1] + dh)
    for t in range(T - 1, -1, -1):
        if t < T - 1:  # dh_t = δ_t + dh_{t+1}·z_{t+1} + ∂R_{t+1} W_hh
            carried = (dh_rows[t + 1] * zs[t + 1] if d_seq is None
                       else torch.addcmul(d_seq[t], dh_rows[t + 1], zs[t + 1]))
            dh_rows[t].copy_(torch.addmm(carried, rec_rows[t + 1].reshape(n, H3), w_hh))
        torch.mul(dh_rows[t].unsqueeze(1), to_r_rows[t], out=rec_rows[t])
    d_in = (dh_all.unsqueeze(2) * torch.stack([a_r, a_z, a_n], dim=2)).view(n, T, H3)
    dh0 = torch.addmm(dh_rows[0] * zs[0], rec_rows[0].reshape(n, H3), w_hh) if initial else None
    return d_in, d_rec.view(n, T, H3), dh0


def _rnn_backward(pre: Tensor, relu: bool, dh_seq: Optional[Tensor], dh_last: Optional[Tensor],
                  w_hh: Tensor, initial: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """∂G = ∂R ``[n, T, H]`` of a plain RNN direction, and with ``initial`` ∂/∂h_{−1} = ∂G_0 W_hh (else None)."""
    n, T, H = pre.shape
    if relu:
        slope = (pre > 0).to(pre.dtype)
    else:
        h = torch.tanh(pre)
        slope = 1 - h * h
    slopes, d_seq = _steps(slope), _steps(dh_seq)
    d = pre.new_empty(n, T, H)
    rows = d.unbind(1)
    dh = dh_last if dh_last is not None else pre.new_zeros(n, H)
    dh = dh if d_seq is None else d_seq[T - 1] + dh
    for t in range(T - 1, -1, -1):
        if t < T - 1:
            dh = torch.mm(rows[t + 1], w_hh) if d_seq is None else torch.addmm(d_seq[t], rows[t + 1], w_hh)
        torch.mul(dh, slopes[t], out=rows[t])
    return d, (torch.mm(rows[0], w_hh) if initial else None)


def _joined(x: Tensor, h0: Tensor, h: Tensor) -> Tensor:
    """[x_t, h_{t−1}] ``[n, T, D + H]`` from the inputs x ``[n, T, D]`` and states h ``[n, T, H]`` (h_{−1} = h0):
    each step's input next to the state it reads, so that G + R is one product."""
    n, T, D = x.shape
    xh = x.new_empty(n, T, D + h.shape[-1])
    xh[..., :D] = x
    xh[:, 0, D:] = h0
    xh[:, 1:, D:] = h[:, :-1]
    return xh


class _Direction(NamedTuple):
    """One direction of one layer, backward: ∂G ``[n, T, gates·H]``, the forms of its wanted weights, and (when
    asked for) its initial state's gradients ∂/∂h_{−1}, ∂/∂c_{−1} ``[n, H]``."""

    d_g: Tensor
    forms: list[LinearForm]
    dh0: Optional[Tensor] = None
    dc0: Optional[Tensor] = None


def _direction_forms(module: nn.RNNBase, x: Tensor, h: Tensor, h0: Tensor, c0: Optional[Tensor],
                     dh_seq: Optional[Tensor], finals: tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]],
                     params: dict[str, Optional[Tensor]], suffix: str, wanted: set[str],
                     initial: bool = False) -> _Direction:
    """One direction of one layer, time running forward: ∂G and the forms of its ``wanted`` per-example grads
    (``weight_ih``, ``weight_hh``, ``bias_ih``, ``bias_hh`` + ``suffix``; module docstring), from its inputs x, states
    h, initial state, and output gradients ``dh_seq`` and ``finals`` = (∂/∂h_n, ∂/∂c_n, ∂/∂c_t from outside); with
    ``initial``, the initial state's gradients too."""
    w_ih, w_hh, b_ih, b_hh = (params[k] for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
    dh_last, dc_last, dc_seq = finals
    if isinstance(module, nn.GRU):
        h_prev = torch.cat([h0.unsqueeze(1), h[:, :-1]], dim=1)
        d_g, d_r, dh0 = _gru_backward(F.linear(x, w_ih, b_ih).contiguous(), F.linear(h_prev, w_hh, b_hh), h_prev,
                                      dh_seq, dh_last, w_hh, initial)
        every = slice(None)
        forms = [wanted_form(x, d_g, {"weight_ih": every}, ("bias_ih",), suffix, wanted),
                 wanted_form(h_prev, d_r, {"weight_hh": every}, ("bias_hh",), suffix, wanted)]
        return _Direction(d_g, [f for f in forms if f is not None], dh0)
    xh = _joined(x, h0, h)  # LSTM and RNN: ∂R = ∂G, and G + R = [x_t, h_{t−1}] [W_ih, W_hh]ᵀ + b_ih + b_hh
    w = torch.cat([w_ih, w_hh], dim=1).t()
    flat = xh.view(-1, xh.shape[-1])
    pre = (torch.mm(flat, w) if b_ih is None else torch.addmm(b_ih + b_hh, flat, w)).view(*xh.shape[:2], -1)
    lstm = None
    if isinstance(module, nn.LSTM):
        assert c0 is not None
        lstm = _lstm_backward(pre, c0, dh_seq, dh_last, dc_last, w_hh, dc_seq, initial, params.get("weight_hr"))
        d_g, dh0, dc0 = lstm.d_g, lstm.dh0, lstm.dc0
    else:
        (d_g, dh0), dc0 = _rnn_backward(pre, module.nonlinearity == "relu", dh_seq, dh_last, w_hh, initial), None
    D = x.shape[-1]
    forms = [wanted_form(xh, d_g, {"weight_ih": slice(None, D), "weight_hh": slice(D, None)},
                         ("bias_ih", "bias_hh") if b_ih is not None else (), suffix, wanted)]
    if lstm is not None and lstm.m is not None and lstm.dh is not None:  # proj_size: ∇W_hr = n Σ_t dh_t ⊗ m_t
        forms.append(wanted_form(lstm.m, lstm.dh, {"weight_hr": slice(None)}, (), suffix, wanted))
    return _Direction(d_g, [f for f in forms if f is not None], dh0, dc0)


def _record_forms(module: nn.RNNBase, rec: Any, names: set[str], n: int) -> list[LinearForm]:
    """The forms of the ``names`` parameters' per-example grads for one recorded call, over n examples (batch-first
    inside; a ``PackedSequence`` padded in the batch's order, its final states' gradients entering at each
    example's last step; a call on n·m flattened rows has each example's m rows joined in time: module docstring).
    A call that ran :mod:`.recurrent_forward` already holds them, left by its backward."""
    taped = None if rec.tape is None else rec.tape.forms_of(names)
    if taped is not None:
        return [f.scaled(n).per_example(n) for f in taped]
    weights = {name: p.detach() for name, p in module.named_parameters()}
    dtype = next(iter(weights.values())).dtype
    x = recorded_input(rec)
    packed = isinstance(x, PackedSequence)
    x = x._replace(data=x.data.detach().to(dtype)) if packed else x.detach().to(dtype)
    rows = n if not rec.flattened else x.shape[0]
    return [f.per_example(n) for f in _record_forms_of_rows(module, rec, names, n, x, rows, weights)]


def _record_forms_of_rows(module: nn.RNNBase, rec: Any, names: set[str], n: int, x: Any, batch: int,
                          weights: dict[str, Tensor]) -> list[LinearForm]:
    """:func:`_record_forms` for a call on ``batch`` rows (n, or n·m flattened), scaled by n (the mean loss)."""
    dtype = next(iter(weights.values())).dtype
    packed = isinstance(x, PackedSequence)
    h0, c0 = _initial(module, rec, batch, x.data if packed else x)
    grads = list(rec.grad_outs) + [None] * (3 - len(rec.grad_outs))
    d_out, d_hn, d_cn = (None if g is None else g.detach().to(dtype) * n for g in grads[:3])
    if d_out is None and d_hn is None and d_cn is None:
        return []
    if d_out is not None:
        d_out = padded_rows(x, d_out)[0] if packed else d_out if module.batch_first else d_out.transpose(0, 1)
    top = None if rec.output is None else rec.output.detach().to(dtype)
    inputs, lengths = _layer_values(module, x, h0, c0, layer_weights(module, weights), top)
    return layers_backward(module, inputs, lengths, h0, c0, (d_out, d_hn, d_cn), weights, names).forms


def _suffixes(module: nn.RNNBase) -> list[list[str]]:
    """Each layer's parameter-name suffixes, one per direction (``_l1``, ``_l1_reverse``)."""
    dirs = 2 if module.bidirectional else 1
    return [[f"_l{layer}" + ("_reverse" if d else "") for d in range(dirs)] for layer in range(module.num_layers)]


class LayersBackward(NamedTuple):
    """:func:`layers_backward`'s result: the forms, and (when asked for) the gradients of the call's input
    ``[n, T, D]`` (batch-first) and of its initial state ``[layers·directions, n, H]`` (h_0; c_0 for an LSTM)."""

    forms: list[LinearForm]
    d_input: Optional[Tensor] = None
    d_h0: Optional[Tensor] = None
    d_c0: Optional[Tensor] = None


def layers_backward(module: nn.RNNBase, inputs: list[Tensor], lengths: Optional[Tensor], h0: Tensor,
                    c0: Optional[Tensor], grads: tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]],
                    weights: dict[str, Tensor], names: set[str], input_grads: bool = False,
                    initial_grads: bool = False) -> LayersBackward:
    """The backward through time of one call, top layer first (module docstring): ``inputs`` are each layer's
    input and the last layer's output, batch-first ``[n, T, ·]`` (padded past the ``lengths``, or ``None``: all T
    steps); ``grads`` = (∂/∂output ``[n, T, directions·H]`` batch-first, ∂/∂h_n, ∂/∂c_n), any of them None. Returns
    the forms of the ``names`` parameters and, with ``input_grads`` / ``initial_grads``, the gradients of the call's
    input (padded batch-first rows) and initial state (in the rows' order)."""
    d_out, d_hn, d_cn = grads
    dirs, H = (2 if module.bidirectional else 1), state_shapes(module, 0)[0][2]
    suffixes = _suffixes(module)
    T = inputs[0].shape[1]
    last = None if lengths is None else lengths - 1
    rev = None if lengths is None or dirs == 1 else _reversal(lengths, T)
    out: list[LinearForm] = []
    dh0s: list[Optional[Tensor]] = [None] * (module.num_layers * dirs)
    dc0s: list[Optional[Tensor]] = [None] * (module.num_layers * dirs)
    for layer in range(module.num_layers - 1, -1, -1):
        d_x: Optional[Tensor] = None
        for d, suffix in enumerate(suffixes[layer]):
            k = layer * dirs + d
            part = slice(d * H, (d + 1) * H)  # this direction's half of the layer's outputs (h_t: H, or proj_size)
            x_d, h_d, dh_seq = inputs[layer], inputs[layer + 1][..., part], None if d_out is None else d_out[..., part]
            if d:  # the reverse direction runs last-to-first: reverse time, and its input gradient back
                x_d, h_d = _reverse(x_d, rev), _reverse(h_d, rev)
                dh_seq = None if dh_seq is None else _reverse(dh_seq, rev)
            dh_last, dc_last = None if d_hn is None else d_hn[k], None if d_cn is None else d_cn[k]
            dc_seq: Optional[Tensor] = None
            if last is not None:  # packed: example i's state stops at ℓ_i − 1; the final gradients enter there
                dh_seq, dh_last = _at_last_step(dh_seq, last, dh_last, T), None
                dc_seq, dc_last = _at_last_step(None, last, dc_last, T), None
            params = {key: weights.get(key + suffix)
                      for key in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")}
            step = _direction_forms(module, x_d, h_d, h0[k], None if c0 is None else c0[k], dh_seq,
                                    (dh_last, dc_last, dc_seq), params, suffix, names, initial_grads)
            out.extend(step.forms)
            dh0s[k], dc0s[k] = step.dh0, step.dc0
            if layer > 0 or input_grads:
                dx = step.d_g @ weights["weight_ih" + suffix]
                dx = _reverse(dx, rev) if d else dx
                d_x = dx if d_x is None else d_x + dx
        d_out = d_x
    if not initial_grads:
        return LayersBackward(out, d_out)
    d_c0 = torch.stack(dc0s) if isinstance(module, nn.LSTM) else None  # type: ignore[arg-type]
    return LayersBackward(out, d_out, torch.stack(dh0s), d_c0)  # type: ignore[arg-type]


def unrolled_rnn_forms(calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> list[LinearForm]:
    """The forms (:class:`LinearForm`) of the per-example grads of ``wanted`` parameters of an RNN layer over its
    calls, one per layer and direction (a form's calls joined in time). Each call must satisfy
    :func:`unrolled_supported`."""
    module = calls.module
    assert isinstance(module, nn.RNNBase)
    names = {name for name, _ in wanted}
    forms: dict[tuple[str, ...], LinearForm] = {}
    with torch.no_grad():
        for rec in calls.records:
            for form in _record_forms(module, rec, names, n):
                key = (*form.weights, *form.biases)
                forms[key] = form if key not in forms else forms[key].joined(form)
    return list(forms.values())


def unrolled_rnn_grads(calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
    """Per-example grads ``[n, *p.shape]`` of ``wanted`` parameters of an RNN layer, summed over its calls
    (module docstring). Each call must satisfy :func:`unrolled_supported`."""
    return form_grads(unrolled_rnn_forms(calls, wanted, n), wanted, n)
