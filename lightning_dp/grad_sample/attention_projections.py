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

Both engines take the forms (:class:`AttentionProjectionsRule`): the ghost engine their ghost norms and book-keeping,
the vmap engine their materialised sums (under the calls' autocast, as its replay would run).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.capture.activations import LayerCalls
from lightning_dp.grad_sample.capture.attention_nodes import Projections
from lightning_dp.grad_sample.layer_stats import LayerStats
from lightning_dp.grad_sample.linear_forms import LinearForm, form_grads, form_stats, wanted_form
from lightning_dp.grad_sample.rules import LayerRule, register_rule


def _per_example(rows: Tensor, n: int) -> Tensor:
    """``[T·n, F]`` time-major rows as ``[n, T, F]``."""
    return rows.view(-1, n, rows.shape[-1]).transpose(0, 1)


def projections_served(calls: Any) -> bool:
    """Whether every call of the layer was recorded with its projections and, where a gradient reached it, passes the
    output-gradient check (module docstring); else :mod:`.attention` serves (or the replay)."""
    module = calls.module
    if not calls.records or not all(rec.projections is not None for rec in calls.records):
        return False
    for rec in calls.records:
        d_in, d_out = rec.projections.grads
        if d_in is None and d_out is None:
            continue  # no gradient reached the call
        if d_in is None or d_out is None or rec.grad_out is None:
            return False
        delta = rec.grad_out if not module.batch_first else rec.grad_out.transpose(0, 1)  # [T, B, E]
        if not torch.equal(d_out.view(delta.shape), delta.to(d_out.dtype)):
            return False
    return True


def _forms(calls: Any, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> list[LinearForm]:
    """The linear forms of the ``wanted`` parameters over the calls of a layer :func:`projections_served` serves."""
    names = {name for name, _ in wanted}
    dtype = calls.module.out_proj.weight.dtype
    forms: dict[tuple[str, ...], LinearForm] = {}
    for rec in calls.records:
        found: Projections = rec.projections
        d_in, d_out = found.grads
        if d_in is None and d_out is None:
            continue  # no gradient reached the call
        parts = [(found.x_in, d_in, "in_proj_weight", "in_proj_bias"), (found.x_out, d_out, "out_proj.weight",
                                                                          "out_proj.bias")]
        for x, d, weight, bias in parts:
            form = wanted_form(_per_example(x.to(dtype), n), _per_example(d.to(dtype), n) * n,
                               {weight: slice(None)}, (bias,), "", names)
            if form is not None:
                key = (*form.weights, *form.biases)
                forms[key] = form if key not in forms else forms[key].joined(form)
    return list(forms.values())


def projection_forms(calls: Any, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> Optional[list[LinearForm]]:
    """The linear forms of the ``wanted`` parameters over the layer's calls (module docstring), or None unless every
    call was recorded with its projections and passes the output-gradient check (then :mod:`.attention` serves)."""
    return _forms(calls, wanted, n) if projections_served(calls) else None


@register_rule
class AttentionProjectionsRule(LayerRule):
    """``nn.MultiheadAttention`` whose calls' projections were read from autograd's record (module docstring)."""

    name = "attention_projections"
    vmap_autocast = True  # as the vmap engine took these forms before the registry

    def serves(self, m: nn.Module) -> bool:
        """``nn.MultiheadAttention`` (and subclasses: the check of each call is what serves them)."""
        return isinstance(m, nn.MultiheadAttention)

    def serves_calls(self, calls: LayerCalls) -> bool:
        """:func:`projections_served`."""
        return self.serves(calls.module) and projections_served(calls)

    def stats(self, calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
              with_squares: bool) -> LayerStats:
        """The forms' ghost norms and book-keeping (:func:`~.linear_forms.form_stats`)."""
        return form_stats(_forms(calls, list(wanted.items()), n), wanted, n, scale, with_squares)

    def grads(self, calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
        """The forms' per-example gradients (:func:`~.linear_forms.form_grads`)."""
        return form_grads(_forms(calls, wanted, n), wanted, n)
