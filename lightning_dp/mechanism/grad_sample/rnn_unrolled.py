"""Per-example gradients of ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` from one unrolled pass.

The fused RNN kernels cannot run under ``torch.func.vmap``, and one small backward per example
(:func:`~lightning_dp.mechanism.grad_sample.functorch_vmap.loop_layer_grads`) costs n backward
passes. Here the recorded call is recomputed once, time step by time step with the cell equations
of the torch documentation, keeping each layer's gate pre-activations G_t = x_t W_ihᵀ + b_ih and
R_t = h_{t−1} W_hhᵀ + b_hh. One backward of Σ_k ⟨f_k(θ, x), δ_k⟩ (δ_k: the recorded output
gradients) gives ∂/∂G_t and ∂/∂R_t row by row: each row is one example's, since examples never
meet inside the recurrence. Then, per example i (Bu et al.'s book-keeping for linear maps),

    ∇W_ih = n Σ_t ∂G_{t,i} ⊗ x_{t,i},   ∇b_ih = n Σ_t ∂G_{t,i},
    ∇W_hh = n Σ_t ∂R_{t,i} ⊗ h_{t−1,i}, ∇b_hh = n Σ_t ∂R_{t,i}

(n undoes the mean's 1/n, as everywhere): the per-example loop's result, for one recomputation and
one einsum per weight.

Cells (torch.nn docs; gate order as in the weights):

* LSTM (i, f, g, o): c' = σ(f)·c + σ(i)·tanh(g), h' = σ(o)·tanh(c')
* GRU (r, z, n): n = tanh(G_n + σ(r)·R_n), h' = (1 − σ(z))·n + σ(z)·h
* RNN: h' = tanh or relu(G + R)

Served: any ``num_layers``, ``bidirectional``, ``bias``, ``batch_first``, a given initial state,
padded tensors (not ``PackedSequence``), no ``proj_size``, no inter-layer dropout in training
(those keep the loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.mechanism.capture import LayerCalls

Cell = Callable[[Tensor, Tensor, Tensor, Optional[Tensor], dict[str, Any]], tuple[Tensor, Optional[Tensor]]]
"""(x W_ihᵀ + b_ih, h W_hhᵀ + b_hh, h, c, options) → (h', c')."""


def _affine(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    """x Wᵀ + b with per-example (``[n, out, in]``) or shared (``[out, in]``) weights."""
    out = torch.einsum("ni,noi->no", x, w) if w.dim() == 3 else F.linear(x, w)
    return out if b is None else out + b


def _lstm(gi: Tensor, gh: Tensor, h: Tensor, c: Optional[Tensor], _: dict[str, Any]) -> tuple[Tensor, Optional[Tensor]]:
    assert c is not None
    i, f, g, o = (gi + gh).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _gru(gi: Tensor, gh: Tensor, h: Tensor, c: Optional[Tensor], _: dict[str, Any]) -> tuple[Tensor, Optional[Tensor]]:
    ir, iz, in_ = gi.chunk(3, dim=-1)
    hr, hz, hn = gh.chunk(3, dim=-1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
    new = torch.tanh(in_ + r * hn)
    return (1 - z) * new + z * h, None


def _rnn(gi: Tensor, gh: Tensor, h: Tensor, c: Optional[Tensor], opts: dict[str, Any]) -> tuple[Tensor, Optional[Tensor]]:
    pre = gi + gh
    return (torch.relu(pre) if opts["nonlinearity"] == "relu" else torch.tanh(pre)), None


_CELLS: dict[type, Cell] = {nn.LSTM: _lstm, nn.GRU: _gru, nn.RNN: _rnn}


def unrolled_supported(module: nn.Module, rec: Any) -> bool:
    """Whether :func:`unrolled_rnn_grads` serves this RNN and recorded call."""
    if type(module) not in _CELLS or getattr(module, "proj_size", 0):
        return False
    if module.dropout and module.training and module.num_layers > 1:
        return False  # random masks between layers: the loop path replays them
    x = rec.args[0] if rec.args else rec.kwargs.get("input")
    return isinstance(x, Tensor) and x.dim() == 3


def _initial(module: nn.RNNBase, rec: Any, n: int, like: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """h_0 (and c_0 for an LSTM), ``[layers·directions, n, H]``; zeros when not given."""
    hx = rec.args[1] if len(rec.args) > 1 else rec.kwargs.get("hx")
    shape = (module.num_layers * (2 if module.bidirectional else 1), n, module.hidden_size)
    if hx is None:
        zeros = like.new_zeros(shape)
        return zeros, (zeros if isinstance(module, nn.LSTM) else None)
    if isinstance(hx, (tuple, list)):
        return hx[0].detach(), hx[1].detach()
    return hx.detach(), None


@dataclass
class _Direction:
    """What one layer and direction saw: its input sequence, its previous hidden states, and the gate
    pre-activations (G: input part, [T, n, g·H]; R: recurrent part, one [n, g·H] per step)."""

    suffix: str
    inputs: Tensor
    previous: list[Tensor] = field(default_factory=list)
    recurrent: list[Tensor] = field(default_factory=list)
    gates: Optional[Tensor] = None


def _forward(module: nn.RNNBase, weights: dict[str, Tensor], x: Tensor, h0: Tensor, c0: Optional[Tensor]
             ) -> tuple[list[Tensor], list[_Direction]]:
    """The module's outputs (in its layout), recomputed cell by cell, and what each direction saw."""
    cell, opts = _CELLS[type(module)], {"nonlinearity": getattr(module, "nonlinearity", "tanh")}
    seq = x.transpose(0, 1) if module.batch_first else x  # [T, n, D]
    directions = 2 if module.bidirectional else 1
    finals_h, finals_c, seen = [], [], []
    for layer in range(module.num_layers):
        outs = []
        for d in range(directions):
            run = _Direction(f"_l{layer}" + ("_reverse" if d else ""), seq)
            run.gates = F.linear(seq, weights[f"weight_ih{run.suffix}"], weights.get(f"bias_ih{run.suffix}"))
            w_hh, b_hh = weights[f"weight_hh{run.suffix}"], weights.get(f"bias_hh{run.suffix}")
            k = layer * directions + d
            h, c = h0[k], (c0[k] if c0 is not None else None)
            hs: list[Tensor] = [seq.new_empty(0)] * seq.shape[0]
            for t in (range(seq.shape[0] - 1, -1, -1) if d else range(seq.shape[0])):
                run.previous.append(h)
                run.recurrent.append(F.linear(h, w_hh, b_hh))
                h, c = cell(run.gates[t], run.recurrent[-1], h, c, opts)
                hs[t] = h
            if d:  # steps were taken last-to-first: store them in time order
                run.previous.reverse()
                run.recurrent.reverse()
            outs.append(torch.stack(hs))
            finals_h.append(h)
            finals_c.append(c)
            seen.append(run)
        seq = torch.cat(outs, dim=-1)
    output = seq.transpose(0, 1) if module.batch_first else seq
    leaves = [output, torch.stack(finals_h)]
    if isinstance(module, nn.LSTM):
        leaves.append(torch.stack(finals_c))  # type: ignore[arg-type]
    return leaves, seen


def unrolled_rnn_grads(calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
    """Per-example grads ``[n, *p.shape]`` of ``wanted`` parameters of an RNN layer, summed over its calls
    (module docstring). Each call must satisfy :func:`unrolled_supported`."""
    module = calls.module
    assert isinstance(module, nn.RNNBase)
    names = {name for name, _ in wanted}
    total: dict[str, Tensor] = {}
    with torch.enable_grad():
        for rec in calls.records:
            weights = {name: p.detach().requires_grad_(True) for name, p in module.named_parameters()}  # in the graph
            x = (rec.args[0] if rec.args else rec.kwargs["input"]).detach()
            h0, c0 = _initial(module, rec, n, x)
            leaves, seen = _forward(module, weights, x, h0, c0)
            dot = sum((leaves[k] * g.to(leaves[k].dtype)).sum() for k, g in enumerate(rec.grad_outs) if g is not None)
            if not isinstance(dot, Tensor):
                continue
            pre = [t for run in seen for t in (run.gates, *run.recurrent)]
            grads = iter(torch.autograd.grad(dot * n, pre, allow_unused=True))
            for run in seen:
                d_gates = _or_zeros(next(grads), run.gates)  # [T, n, g·H]
                d_rec = torch.stack([_or_zeros(next(grads), r) for r in run.recurrent])  # [T, n, g·H]
                prev = torch.stack(run.previous)  # [T, n, H]
                parts = {f"weight_ih{run.suffix}": lambda: torch.einsum("tno,tni->noi", d_gates, run.inputs),
                         f"bias_ih{run.suffix}": lambda: d_gates.sum(0),
                         f"weight_hh{run.suffix}": lambda: torch.einsum("tno,tni->noi", d_rec, prev),
                         f"bias_hh{run.suffix}": lambda: d_rec.sum(0)}
                for name, compute in parts.items():
                    if name in names:
                        g = compute()
                        total[name] = g if name not in total else total[name] + g
    return total


def _or_zeros(g: Optional[Tensor], like: Optional[Tensor]) -> Tensor:
    assert like is not None
    return torch.zeros_like(like) if g is None else g
