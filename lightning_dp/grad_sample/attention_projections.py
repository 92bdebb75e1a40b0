"""``nn.MultiheadAttention`` self-attention without re-running it: its two projections read from autograd's record.

:mod:`.attention` re-runs the module's attention (forward and backward) to get what its linear maps saw and
received. For self-attention with packed projections (``nn.TransformerEncoderLayer``, a decoder's self-attention:
query, key and value one tensor) the module's own forward already made both linear maps as autograd nodes, found
right after the call by walking back from its output to the nodes that read ``in_proj_weight`` and
``out_proj.weight`` (through their transpose):

    in-projection   Y = X W_inᵀ + b_in     node input X ``[T·B, E]``, output gradient ∂Y ``[T·B, 3E]``
    out-projection  out = A W_oᵀ + b_o     node input A ``[T·B, E]``, output gradient δ ``[T·B, E]``

Their inputs are kept at the call (autograd saved them anyway) and their output gradients arrive by node pre-hooks
during the ordinary backward. Each is one linear form (:mod:`.linear_forms`): example i's gradients are
Σ_t ∂Y_{i,t} ⊗ X_{i,t}, Σ_t ∂Y_{i,t}, Σ_t δ_{i,t} ⊗ A_{i,t}, Σ_t δ_{i,t} (n undoes the mean's 1/n), with no
recomputation; attention dropout is the call's own.

The rows are time-major, row t·B + b (torch's code flattens ``[T, B, E]`` in both of its branches). That is
checked, not assumed, at every call: the in-projection's input must equal the call's query laid out ``[T, B, E]``
(recorded at the call), and its out-projection's output gradient must equal the gradient that reached the module's
output laid out the same way (at the clipping). A call that fails either check, or whose nodes are not found (exactly
one of each), keeps :mod:`.attention`'s replay.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.grad_sample.capture.attention_nodes import Projections
from lightning_dp.grad_sample.linear_forms import LinearForm, wanted_form


def _per_example(rows: Tensor, n: int) -> Tensor:
    """``[T·n, F]`` time-major rows as ``[n, T, F]``."""
    return rows.view(-1, n, rows.shape[-1]).transpose(0, 1)


def projection_forms(calls: Any, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> Optional[list[LinearForm]]:
    """The linear forms of the ``wanted`` parameters over the layer's calls (module docstring), or None unless every
    call was recorded with its projections and passes the output-gradient check (then :mod:`.attention` serves)."""
    module = calls.module
    if not calls.records or not all(rec.projections is not None for rec in calls.records):
        return None
    names = {name for name, _ in wanted}
    dtype = module.out_proj.weight.dtype
    forms: dict[tuple[str, ...], LinearForm] = {}
    for rec in calls.records:
        found: Projections = rec.projections
        d_in, d_out = found.grads
        if d_in is None and d_out is None:
            continue  # no gradient reached the call
        if d_in is None or d_out is None or rec.grad_out is None:
            return None
        delta = rec.grad_out if not module.batch_first else rec.grad_out.transpose(0, 1)  # [T, B, E]
        if not torch.equal(d_out.view(delta.shape), delta.to(d_out.dtype)):
            return None
        parts = [(found.x_in, d_in, "in_proj_weight", "in_proj_bias"), (found.x_out, d_out, "out_proj.weight",
                                                                          "out_proj.bias")]
        for x, d, weight, bias in parts:
            form = wanted_form(_per_example(x.to(dtype), n), _per_example(d.to(dtype), n) * n,
                               {weight: slice(None)}, (bias,), "", names)
            if form is not None:
                key = (*form.weights, *form.biases)
                forms[key] = form if key not in forms else forms[key].joined(form)
    return list(forms.values())
