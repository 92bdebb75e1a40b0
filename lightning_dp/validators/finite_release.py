"""The last check before the noise: every clipped sum is finite (docs/algorithms.md, "Non-finite gradients").

An example whose gradient holds an inf or a NaN gets the factor 0 and adds nothing (the engines keep 0·inf out of
their sums). Should an engine's sum still be non-finite, releasing it would show that such an example was sampled
(the weights turn NaN at that step): the release is refused instead, on every rank, naming the engine."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from lightning_dp.engine_api import ClippedBatch, sums_finite
from lightning_dp.errors import PrivacyConfigurationError


def check_finite_release(batch: ClippedBatch, params: Sequence[nn.Parameter], engine: str) -> None:
    """Refuse a release whose clipped sums hold an inf or a NaN (n norms checked first; the sums only when one is
    not finite)."""
    if not sums_finite(batch, params):
        raise PrivacyConfigurationError(
            f"an example's gradient was not finite (an inf or NaN feature, or an overflow in the forward) and the "
            f"{engine!r} engine could not leave it out of the clipped sum: releasing it would show that the example "
            "was sampled. Clean the non-finite records (torch.isfinite) or try per_sample='vmap'.")
