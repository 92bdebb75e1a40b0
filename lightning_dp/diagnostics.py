"""Opt-in, NON-PRIVATE diagnostics of one step, computed from un-noised data.

These numbers (the clean clipped mean, per-example norms, the clip fraction) are not
covered by the DP guarantee: logging them publishes information about individual
examples. The model's parameters stay private, the logs do not. The strategy computes
them only after :meth:`DPStrategy.enable_non_private_diagnostics` and hands them out
read-only, so callbacks never touch per-example tensors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Protocol

import torch
import torch.distributed as dist
from torch import Tensor



@dataclass(frozen=True)
class StepDiagnostics:
    """Un-noised statistics of one logical step (NOT differentially private).

    Attributes:
        clean_mean: S_t / B per parameter: the clipped mean without noise (global over ranks).
        norms: per-example gradient norms before clipping (every rank's examples under DDP,
            :func:`gathered`).
        clip_fraction: share of those examples whose norm exceeded C (nan if none).
        batch_size: how many examples that is.
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


class ClippedSums(Protocol):
    """What :func:`diagnose` reads of a :class:`~lightning_dp.engine_api.ClippedBatch` (named by its shape, so
    this module needs nothing of the core)."""

    sums: dict[Tensor, Tensor]
    norms: Tensor
    batch_size: int


def diagnose(batch: ClippedSums, params: list[Tensor], expected_batch_size: float,
             max_grad_norm: float) -> StepDiagnostics:
    """Build :class:`StepDiagnostics` from a batch's clipped sums, before noise is added."""
    clean = {p: batch.sums[p].detach().clone() / expected_batch_size for p in params}
    norms = batch.norms.detach().clone()
    return StepDiagnostics(clean, norms, _clip_fraction(norms, max_grad_norm), batch.batch_size, max_grad_norm)


def gathered(diagnostics: StepDiagnostics) -> StepDiagnostics:
    """The same diagnostics with every rank's per-example norms (concatenated in rank order),
    the clip fraction and the batch size over all of them. A collective: every rank calls it.
    The clean mean is left as it is (the strategy all-reduces it with the clipped sums)."""
    norms = _all_gather_variable(diagnostics.norms)
    fraction = _clip_fraction(norms, diagnostics.max_grad_norm)
    return replace(diagnostics, norms=norms, clip_fraction=fraction, batch_size=int(norms.numel()))


def _clip_fraction(norms: Tensor, max_grad_norm: float) -> float:
    return float((norms > max_grad_norm).float().mean()) if norms.numel() else float("nan")


def _all_gather_variable(values: Tensor) -> Tensor:
    """Concatenate a 1-D tensor of a different length on each rank (Poisson batches): the
    lengths first, then the values padded to the longest."""
    world = dist.get_world_size()
    count = torch.tensor([values.numel()], dtype=torch.long, device=values.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    lengths = [int(c.item()) for c in counts]
    padded = values.new_zeros(max(lengths))
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, lengths)])
