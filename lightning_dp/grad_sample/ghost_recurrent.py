"""Ghost norms and book-keeping for torch's RNNs (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) in the ghost engine.

The unrolled rule (:mod:`.rnn_unrolled`) gives, for each layer and direction, the gate gradients ∂G ``[n, T, out]``
and what each weight multiplies, ``a`` ``[n, T, in]`` ([x_t, h_{t−1}] for an LSTM or RNN, whose W_ih and W_hh share
∂G; x_t and h_{t−1} with their own ∂G and ∂R for a GRU): example i's weight gradient is the linear form
G_i = Σ_t ∂G_{i,t} ⊗ a_{i,t}, whose norms and clipped sums :mod:`.linear_forms` takes as for a Linear layer. For an
LSTM one Gram of ∂G and one of [x_t, h_{t−1}] give the norm of W_ih and W_hh together, and b_ih and b_hh share the
per-example gradient Σ_t ∂G_t (counted once per bias in the norm). Before this rule, the ghost engine materialised
every RNN weight's per-example gradients ``[n, out, in]``. A call that ran the engine's taped forward
(:mod:`.recurrent_forward`) had its forms computed by its own backward; the rule reads them from the call's record.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from lightning_dp.grad_sample.capture.activations import LayerCalls
from lightning_dp.grad_sample.base import ParamMap
from lightning_dp.grad_sample.layer_stats import LayerStats
from lightning_dp.grad_sample.linear_forms import form_stats
from lightning_dp.grad_sample.rnn_unrolled import unrolled_rnn_forms, unrolled_supported

_SERVED = (nn.LSTM, nn.GRU, nn.RNN)


def recurrent_served(calls: LayerCalls) -> bool:
    """Whether :func:`recurrent_stats` serves this layer's calls (the unrolled rule serves every call)."""
    return (type(calls.module) in _SERVED and bool(calls.records)
            and all(unrolled_supported(calls.module, rec) for rec in calls.records))


def recurrent_stats(calls: LayerCalls, wanted: dict[str, Tensor], n: int, scale: Optional[ParamMap],
                    with_squares: bool) -> LayerStats:
    """The ghost engine's stats of an RNN layer served by :func:`recurrent_served` (module docstring)."""
    return form_stats(unrolled_rnn_forms(calls, list(wanted.items()), n), wanted, n, scale, with_squares)
