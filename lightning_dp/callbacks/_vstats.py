"""Summary statistics of a per-coordinate quantity spread over many tensors (pure torch).

The seed's Table 1 (dp-adam-bias-correction.txt) summarises v by min, Q1, median,
Q3, max and mean. :class:`Summary` accumulates those over parameters one at a
time: min, max, mean and the share of negative values exactly over every
coordinate; the quartiles over the (possibly subsampled, see
:mod:`lightning_dp.callbacks._subsample`) coordinates handed to it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_dp.callbacks._monitor_tags import QUANTILE_LEVELS, STATS


class Summary:
    """Running min / max / sum / count / #negative, plus samples for the quartiles.

    Non-finite values are counted in nothing but ``nonfinite`` (they would poison
    every statistic); a summary with no finite value reports ``nan``.
    """

    def __init__(self) -> None:
        self.min = math.inf
        self.max = -math.inf
        self.total = 0.0
        self.count = 0
        self.negative = 0
        self.nonfinite = 0
        self._samples: list[Tensor] = []
        self._stats: dict[str, float] | None = None

    def add(self, full: Tensor, sample: Tensor) -> None:
        """Fold in all coordinates ``full`` (exact stats) and ``sample`` (for quartiles)."""
        self._stats = None
        full = full.detach().reshape(-1)
        finite = torch.isfinite(full)
        n_finite = int(finite.sum())
        self.nonfinite += full.numel() - n_finite
        if n_finite == 0:
            return
        values = full if n_finite == full.numel() else full[finite]
        self.min = min(self.min, float(values.min()))
        self.max = max(self.max, float(values.max()))
        self.total += float(values.sum(dtype=torch.float64))
        self.count += n_finite
        self.negative += int((values < 0).sum())
        sample = sample.detach().reshape(-1)
        if n_finite != full.numel():
            sample = sample[torch.isfinite(sample)]
        self._samples.append(sample.float().cpu())

    @classmethod
    def merged(cls, parts: "list[Summary]") -> "Summary":
        """One summary of the union of ``parts`` (e.g. the whole model from its groups)."""
        if len(parts) == 1:
            return parts[0]
        out = cls()
        for part in parts:
            out.min, out.max = min(out.min, part.min), max(out.max, part.max)
            out.total += part.total
            out.count += part.count
            out.negative += part.negative
            out.nonfinite += part.nonfinite
            out._samples.extend(part._samples)
        return out

    @property
    def samples(self) -> Tensor:
        """The finite sampled values seen so far, concatenated (float32, CPU)."""
        return torch.cat(self._samples) if self._samples else torch.empty(0)

    @property
    def frac_negative(self) -> float:
        """Share of finite coordinates below zero (nan if none)."""
        return self.negative / self.count if self.count else math.nan

    def stats(self) -> dict[str, float]:
        """``{"min", "q1", "median", "q3", "max", "mean"}`` (all nan when empty; computed once)."""
        if self._stats is None:
            self._stats = self._compute()
        return dict(self._stats)

    def _compute(self) -> dict[str, float]:
        samples = self.samples
        if self.count == 0 or samples.numel() == 0:
            return {name: math.nan for name in STATS}
        levels = torch.tensor(list(QUANTILE_LEVELS.values()), dtype=samples.dtype)
        quartiles = torch.quantile(samples, levels).tolist()
        out = {"min": self.min, "max": self.max, "mean": self.total / self.count}
        out.update(zip(QUANTILE_LEVELS, quartiles))
        return {name: out[name] for name in STATS}
