"""How close two gradients of the same examples must be when only the batch around them changed.

The probe and the batch check compute the same examples' gradients in batches of different composition. Without an
interaction the two differ by rounding only: another matrix-product blocking, another reduction order. Measured here
(CPU, batch 64 against its halves and single examples, ghost and vmap, an MLP, a CNN and an LSTM) rounding moved no
norm by more than 1.1 units in the last place of the largest; the tolerance is :data:`TOLERANCE_ULPS` of them, in the
precision the forward really computes in.
"""

from __future__ import annotations

import torch

TOLERANCE_ULPS = 64.0
"""τ in units of the compute precision's machine epsilon. Measured here (CPU, batch 64 against its halves and single
examples, ghost and vmap, an MLP, a CNN and an LSTM): rounding moved no norm by more than 1.1 ulps of the largest;
a coupling that moves an example's gradient by more than 64 ulps (float32: 7.6e-6 of the largest norm) is refused."""

NEAR_MISS = 16.0
"""The largest distance, in τ, of a float32 refusal the batch check (and the first probe, batch against alone)
judges again in float64 (1,024 ulps: farther is
no round-off; :mod:`lightning_dp.wide_replay`). Measured here (CPU, Hugging Face wav2vec2 from a tiny config, ghost and
vmap, batches of up to 128 and signals of up to 4,000 samples): no norm moved by more than 2.5 ulps."""

REJUDGED_ULPS = 1.0
"""The tolerance of the comparison judged again in float64, in float32 ulps of the largest norm: float64's round-off
is 2^-29 of one (measured on wav2vec2: 4e-9 of it), and an interaction float32 refused (over 64 ulps, less round-off)
stays above it."""

LOW_PRECISION_TOLERANCE = 3e-2
"""bf16/fp16 autocast computes in ~3 significant digits (as the first probe)."""


def batch_tolerance(dtype: torch.dtype, device: torch.device, low_precision: bool = False) -> float:
    """τ of the module docstring for a model computing in ``dtype`` on ``device``: :data:`TOLERANCE_ULPS` ulps of the
    precision its matrix products really run in (float32 under TF32 or a reduced float32 matmul precision: 10 bits;
    bfloat16 products: 7 bits). ``dtype`` is the lowest floating dtype the first probe saw the forward compute in
    (:class:`~lightning_dp.validators.probe.LowestFloat`): a float64 model whose rotary embedding is
    computed in float32 (Llama, Qwen) is held to float32's τ — measured there: 3e-8 of the largest norm."""
    if low_precision:
        return LOW_PRECISION_TOLERANCE
    return TOLERANCE_ULPS * _compute_epsilon(dtype, device)


def _compute_epsilon(dtype: torch.dtype, device: torch.device) -> float:
    eps = float(torch.finfo(dtype).eps)
    if dtype != torch.float32:
        return eps
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":
        return 2.0 ** -7
    tf32 = device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
    return 2.0 ** -10 if precision == "high" or tf32 else eps
