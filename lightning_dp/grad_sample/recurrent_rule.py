"""torch's RNNs (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): ghost norms and book-keeping on ``ghost``, the unrolled rule's
per-example gradients on ``vmap``.

The unrolled rule (:mod:`.rnn_unrolled`) gives, for each layer and direction, the gate gradients ∂G ``[n, T, out]``
and what each weight multiplies, ``a`` ``[n, T, in]`` ([x_t, h_{t−1}] for an LSTM or RNN, whose W_ih and W_hh share
∂G; x_t and h_{t−1} with their own ∂G and ∂R for a GRU): example i's weight gradient is the linear form
G_i = Σ_t ∂G_{i,t} ⊗ a_{i,t}, whose norms and clipped sums :mod:`.linear_forms` takes as for a Linear layer. For an
LSTM one Gram of ∂G and one of [x_t, h_{t−1}] give the norm of W_ih and W_hh together, and b_ih and b_hh share the
per-example gradient Σ_t ∂G_t (counted once per bias in the norm). Before this rule, the ghost engine materialised
every RNN weight's per-example gradients ``[n, out, in]``. A call that ran the engine's taped forward
(:mod:`.recurrent_forward`) had its forms computed by its own backward; the rule reads them from the call's record.

The vmap engine takes the forms' materialised sums (:func:`~.rnn_unrolled.unrolled_rnn_grads`, under the calls'
autocast as its replay would run). Calls the unrolled rule does not cover (training-mode inter-layer dropout, a
call on flattened examples time-major) keep the engines' replays (:func:`~.functorch_vmap.vmap_layer_grads`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.capture.activations import LayerCalls
from lightning_dp.grad_sample.layer_stats import LayerStats
from lightning_dp.grad_sample.linear_forms import form_stats
from lightning_dp.grad_sample.recurrent_forward import taped_forward
from lightning_dp.grad_sample.rnn_unrolled import unrolled_rnn_forms, unrolled_rnn_grads, unrolled_supported
from lightning_dp.grad_sample.rules import LayerRule, register_rule

_SERVED = (nn.LSTM, nn.GRU, nn.RNN)


def recurrent_served(calls: LayerCalls) -> bool:
    """Whether :func:`recurrent_stats` serves this layer's calls (the unrolled rule serves every call)."""
    return (type(calls.module) in _SERVED and bool(calls.records)
            and all(unrolled_supported(calls.module, rec) for rec in calls.records))


def recurrent_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
                    with_squares: bool) -> LayerStats:
    """The ghost engine's stats of an RNN layer served by :func:`recurrent_served` (module docstring)."""
    return form_stats(unrolled_rnn_forms(calls, list(wanted.items()), n), wanted, n, scale, with_squares)


def _rnn_forward(self: nn.RNNBase, *args, **kwargs):
    """Served calls (:mod:`.recurrent_forward`): torch's fused forward whose backward is the unrolled rule's, the
    weights' forms left for the clipping. Otherwise the module's own forward on its weights detached: the kernel's
    backward then computes only the input and initial-state gradients (the weights' clipped sums come from
    :func:`recurrent_stats`). Only the registered ``nn.Parameter`` objects are detached: a replay that substitutes
    plain tensors (``functional_call`` in the per-example loop or the dropout replay) differentiates them as usual;
    and nothing is detached where no input of the call requires grad (an RNN on the data itself: its output would
    not require grad, and no gradient would reach the hooks). The module's list of weights is first brought up to
    date with its attributes (as its own forward does): restored afterwards, it then matches the references torch
    keeps to tell a later ``functional_call`` apart."""
    update = getattr(self, "_update_flat_weights", None)
    if update is not None:
        update()
    taped = taped_forward(self, args, kwargs)
    if taped is not None:
        return taped
    inputs = [t for a in (*args, *kwargs.values()) for t in tree_flatten(a)[0] if isinstance(t, Tensor)]
    if not any(t.requires_grad for t in inputs):
        return type(self).forward(self, *args, **kwargs)
    flat = self._flat_weights
    self._flat_weights = [w.detach() if isinstance(w, nn.Parameter) else w for w in flat]
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        self._flat_weights = flat


@register_rule
class RecurrentRule(LayerRule):
    """``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` (the classes themselves) whose every call the unrolled rule covers (module
    docstring)."""

    name = "recurrent"
    vmap_autocast = True  # as the vmap engine's replay of these layers ran before the registry

    def serves(self, m: nn.Module) -> bool:
        """torch's three RNN classes (not subclasses)."""
        return type(m) in _SERVED

    def serves_calls(self, calls: LayerCalls) -> bool:
        """:func:`recurrent_served`: every call is one the unrolled rule covers."""
        return recurrent_served(calls)

    def stats(self, calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
              with_squares: bool) -> LayerStats:
        """:func:`recurrent_stats`: ghost norms and book-keeping of the linear forms."""
        return recurrent_stats(calls, wanted, n, scale, with_squares)

    def grads(self, calls: LayerCalls, wanted: Sequence[tuple[str, nn.Parameter]], n: int) -> dict[str, Tensor]:
        """:func:`~.rnn_unrolled.unrolled_rnn_grads`."""
        return unrolled_rnn_grads(calls, wanted, n)

    def input_grad_only_forward(self, m: nn.Module) -> Optional[Callable]:
        """:func:`_rnn_forward` (every call: one the rule does not cover detaches the weights only)."""
        return _rnn_forward
