"""Per-example gradients of ``nn.MultiheadAttention`` from one batched forward and one ordinary backward.

Every parameter of the unit enters through a linear map: the in-projection Y = X W_inᵀ + b_in
(packed ``in_proj_weight`` rows for q, k, v, or the separate ``q/k/v_proj_weight`` when
``kdim``/``vdim`` differ from ``embed_dim``) and the out-projection out = A W_oᵀ + b_o, with A the
attention output. Examples never meet in between, so with the recorded output gradient δ (of
the mean loss; n undoes its 1/n) the per-example gradients are Bu et al.'s book-keeping outer
products,

    ∇W_o = n Σ_t δ_{i,t} ⊗ A_{i,t},    ∇b_o = n Σ_t δ_{i,t},
    ∇W_in = n Σ_t ∂Y_{i,t} ⊗ X_{i,t},  ∇b_in = n Σ_t ∂Y_{i,t},

and ∂Y, example i's in row i, comes from ONE ordinary backward of ⟨A, nδ W_o⟩ (+ the attention
weights' gradient, when they are used) over the whole batch.

To get A and ∂Y without re-implementing torch's attention (masks, ``is_causal``, ``need_weights``,
``add_zero_attn``, dropout, both layouts), the module's own forward is re-run with the
projections moved out: the projections Y are computed here (leaves of the graph) and handed to
the module as its query, key and value, with identity matrices and zero biases in place of its
projection parameters. The module then computes exactly its attention of Y (a product with the
identity adds only exact zeros) and returns A instead of out. Attention dropout draws its masks
inside that forward from the random state recorded before the original call (restored here,
:class:`~lightning_dp.grad_sample.capture.activations.Record`), with the same shapes in the same order, so
the masks are the original ones.

Served: torch's ``nn.MultiheadAttention`` forward (not a subclass that overrides it), batched
inputs, any masks, ``need_weights`` / ``average_attn_weights``, ``add_zero_attn``, ``bias=False``,
``kdim``/``vdim``. ``add_bias_kv`` (its ``bias_k``/``bias_v`` rows are shared by the whole batch)
keeps the batched-over-examples replay of :func:`~.functorch_vmap.replayed_layer_grads`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten

from lightning_dp.grad_sample.capture.activations import LayerCalls


def attention_supported(module: nn.Module, rec: Any) -> bool:
    """Whether :func:`attention_grads` serves this module and recorded call."""
    if not isinstance(module, nn.MultiheadAttention) or type(module).forward is not nn.MultiheadAttention.forward:
        return False
    if module.bias_k is not None or module.bias_v is not None:
        return False
    args = rec.args
    return (args is not None and len(args) >= 3 and not rec.kwargs.keys() & {"query", "key", "value"}
            and all(isinstance(a, Tensor) and a.dim() == 3 for a in args[:3]))


def _same(a: Tensor, b: Tensor) -> bool:
    """The same values: one tensor, or two views of the same memory with the same layout."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)


def _outer_sum(d: Tensor, a: Tensor) -> Tensor:
    """Σ_t d_{i,t} ⊗ a_{i,t} for every example i: ``[n, out, in]`` from ``[n, T, out]`` and ``[n, T, in]``."""
    return torch.bmm(d.transpose(1, 2), a)


def _record_grads(m: nn.MultiheadAttention, rec: Any, names: set[str], n: int) -> dict[str, Tensor]:
    """Per-example grads ``[n, *p.shape]`` of the ``names`` parameters for one recorded call
    (the random state must already be the call's)."""
    E = m.embed_dim
    w_o = m.out_proj.weight.detach()
    dtype, device = w_o.dtype, w_o.device
    ex = 0 if m.batch_first else 1  # where the examples are in query/key/value and in the output
    inputs = [a.detach() for a in rec.args[:3]]
    packed = m._qkv_same_embed_dim
    b_in = None if m.in_proj_bias is None else m.in_proj_bias.detach()
    # projections, grouped where one input feeds consecutive packed rows (self-attention: one group)
    groups: list[tuple[Tensor, int, int]] = []  # (input, first of q/k/v, how many)
    for j, x in enumerate(inputs):
        if packed and groups and _same(groups[-1][0], x):
            groups[-1] = (x, groups[-1][1], groups[-1][2] + 1)
        else:
            groups.append((x, j, 1))
    qkv: list[Tensor] = []  # Q, K, V: contiguous leaves (a strided view would make every product a bmm)
    with torch.no_grad():
        for x, j, count in groups:
            rows = slice(j * E, (j + count) * E)
            w = m.in_proj_weight[rows] if packed else getattr(m, "qkv"[j] + "_proj_weight")
            y = F.linear(x, w.detach(), None if b_in is None else b_in[rows])
            qkv.extend(t.contiguous() for t in y.chunk(count, -1))
    for y in qkv:
        y.requires_grad_(True)
    eye = torch.eye(E, dtype=dtype, device=device)
    identity: dict[str, Tensor] = {"out_proj.weight": eye}
    if packed:
        identity["in_proj_weight"] = eye.repeat(3, 1)
    else:
        identity.update({"q_proj_weight": eye, "k_proj_weight": eye, "v_proj_weight": eye})
    if b_in is not None:
        identity["in_proj_bias"] = torch.zeros_like(b_in)
    if m.out_proj.bias is not None:
        identity["out_proj.bias"] = torch.zeros(E, dtype=dtype, device=device)
    grads = [None if g is None else g.detach().to(dtype) * n for g in rec.grad_outs]
    delta = grads[0].movedim(ex, 0) if grads and grads[0] is not None else None  # [n, T, E]
    out: dict[str, Tensor] = {}
    want_in = any(not name.startswith("out_proj.") for name in names)
    with torch.enable_grad():
        result = tree_flatten(functional_call(m, identity, (*qkv, *rec.args[3:]), rec.kwargs))[0]
        attn = result[0].detach().movedim(ex, 0)  # A, [n, T, E]
        if delta is not None:
            if "out_proj.weight" in names:
                out["out_proj.weight"] = _outer_sum(delta, attn)
            if "out_proj.bias" in names:
                out["out_proj.bias"] = delta.sum(1)
        outputs, seeds = [], []  # ⟨A, nδ W_o⟩ and ⟨weights, nδ_w⟩: their gradient reaches Q, K, V
        for k, g in enumerate(grads):
            if g is not None and k < len(result) and isinstance(result[k], Tensor) and result[k].requires_grad:
                outputs.append(result[k])
                seeds.append(g @ w_o if k == 0 else g)
        d_qkv: Sequence[Optional[Tensor]] = [None] * 3
        if want_in and outputs:
            d_qkv = torch.autograd.grad(outputs, qkv, seeds, allow_unused=True)
    if want_in:
        weight_parts, bias_parts = [], []
        d_qkv = [torch.zeros_like(y) if d is None else d for y, d in zip(qkv, d_qkv)]
        for x, j, count in groups:
            d = d_qkv[j] if count == 1 else torch.cat(d_qkv[j:j + count], -1)
            d, x = d.movedim(ex, 0), x.to(dtype).movedim(ex, 0)  # [n, T, count·E], [n, T, D]
            weight_parts.append(_outer_sum(d, x))
            bias_parts.append(d.sum(1))
        if packed:
            if "in_proj_weight" in names:
                out["in_proj_weight"] = torch.cat(weight_parts, 1) if len(weight_parts) > 1 else weight_parts[0]
        else:
            for j, g in enumerate(weight_parts):
                if "qkv"[j] + "_proj_weight" in names:
                    out["qkv"[j] + "_proj_weight"] = g
        if "in_proj_bias" in names:
            out["in_proj_bias"] = torch.cat(bias_parts, 1) if len(bias_parts) > 1 else bias_parts[0]
    return out


def attention_grads(calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
    """Per-example grads ``[n, *p.shape]`` of ``wanted`` parameters of an ``nn.MultiheadAttention``, summed
    over its calls (module docstring); a call that drew random numbers is replayed from its recorded
    random state. Each call must satisfy :func:`attention_supported`."""
    module = calls.module
    assert isinstance(module, nn.MultiheadAttention)
    params = dict(wanted)
    names = set(params)
    total: dict[str, Tensor] = {}
    device = module.out_proj.weight.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for rec in calls.records:
            if rec.rng is not None:
                cpu_state, cuda_state = rec.rng
                torch.set_rng_state(cpu_state)
                if cuda_state is not None:
                    torch.cuda.set_rng_state(cuda_state, device)
            for name, g in _record_grads(module, rec, names, n).items():
                total[name] = g if name not in total else total[name] + g
    for name in names - total.keys():
        p = params[name]
        total[name] = torch.zeros(n, *p.shape, dtype=p.dtype, device=p.device)
    return total
