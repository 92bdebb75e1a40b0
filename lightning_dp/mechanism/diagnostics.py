"""Opt-in, NON-PRIVATE diagnostics of one step, computed from un-noised data.

These numbers (the clean clipped mean, per-example norms, the clip fraction) are not
covered by the DP guarantee: logging them publishes information about individual
examples. The model's parameters stay private, the logs do not. The strategy computes
them only after :meth:`DPStrategy.enable_non_private_diagnostics` and hands them out
read-only, so callbacks never touch per-example tensors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor

from lightning_dp.mechanism.grad_sample.base import ClippedBatch


@dataclass(frozen=True)
class StepDiagnostics:
    """Un-noised statistics of one logical step (NOT differentially private).

    Attributes:
        clean_mean: S_t / B per parameter: the clipped mean without noise (global over ranks).
        norms: per-example gradient norms before clipping (this rank's examples).
        clip_fraction: share of this rank's examples whose norm exceeded C (nan if none).
        batch_size: examples in this rank's batch.
        max_grad_norm: C.
    """

    clean_mean: Mapping[Tensor, Tensor]
    norms: Tensor
    clip_fraction: float
    batch_size: int
    max_grad_norm: float

    @property
    def clean_mean_norm_over_c(self) -> float:
        """‖ḡ‖ / C, with ḡ the clean clipped mean (design-principles Fig. 5)."""
        sq = sum(float(t.pow(2).sum()) for t in self.clean_mean.values())
        return sq**0.5 / self.max_grad_norm

    def norm_quantiles(self, qs: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)) -> list[float]:
        """Quantiles of the per-example norms (nan for an empty batch)."""
        if self.norms.numel() == 0:
            return [float("nan")] * len(qs)
        return torch.quantile(self.norms.float(), torch.tensor(qs)).tolist()


def diagnose(batch: ClippedBatch, params: list[Tensor], expected_batch_size: float, max_grad_norm: float) -> StepDiagnostics:
    """Build :class:`StepDiagnostics` from a batch's clipped sums, before noise is added."""
    clean = {p: batch.sums[p].detach().clone() / expected_batch_size for p in params}
    norms = batch.norms.detach().clone()
    clipped = float((norms > max_grad_norm).float().mean()) if norms.numel() else float("nan")
    return StepDiagnostics(clean, norms, clipped, batch.batch_size, max_grad_norm)
