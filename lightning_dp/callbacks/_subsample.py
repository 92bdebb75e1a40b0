"""A fixed-size random subsample of a model's coordinates, for quantiles of large models.

``torch.quantile`` sorts its input (and refuses more than 16M elements), so the
monitor computes quantiles and histograms on at most ``max_coordinates``
coordinates drawn once, uniformly with replacement, and reused at every logged
step (so successive steps are comparable). The draw is independent of the data
and of the noise, so it is post-processing and costs no privacy.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


class CoordinateSample:
    """Per-parameter index sets whose sizes add up to about ``max_coordinates``.

    A model with at most ``max_coordinates`` coordinates is used whole
    (:meth:`indices` returns ``None``). A larger one gets, per parameter,
    ``max(1, round(max_coordinates · numel / total))`` indices, so each parameter is
    represented in proportion to its size.

    Args:
        max_coordinates: the cap (≥ 1).
        seed: seed of the draw (public; reproducible plots).
    """

    def __init__(self, max_coordinates: int = 1_000_000, seed: int = 0) -> None:
        if int(max_coordinates) != max_coordinates or max_coordinates < 1:
            raise ValueError(f"max_coordinates must be an integer >= 1, got {max_coordinates!r}.")
        self.max_coordinates = int(max_coordinates)
        self.seed = int(seed)
        self._key: tuple[tuple[int, int], ...] = ()
        self._indices: dict[int, Optional[Tensor]] = {}

    def plan(self, params: Sequence[Tensor]) -> None:
        """Draw the index sets for ``params`` (no-op when already drawn for the same tensors)."""
        key = tuple((id(p), p.numel()) for p in params)
        if key == self._key:
            return
        self._key = key
        total = sum(p.numel() for p in params)
        generator = torch.Generator().manual_seed(self.seed)
        self._indices = {}
        for p in params:
            if total <= self.max_coordinates:
                self._indices[id(p)] = None
                continue
            k = max(1, round(self.max_coordinates * p.numel() / total))
            idx = torch.randint(p.numel(), (k,), generator=generator).sort().values
            self._indices[id(p)] = idx.to(p.device)

    def indices(self, p: Tensor) -> Optional[Tensor]:
        """Flat indices of ``p``'s sampled coordinates, or ``None`` for all of them."""
        if id(p) not in self._indices:
            raise KeyError("parameter not in the planned sample: call plan(params) with it first.")
        return self._indices[id(p)]

    def take(self, p: Tensor, values: Tensor) -> Tensor:
        """The sampled coordinates of ``values`` (shaped like ``p``), flattened."""
        flat = values.reshape(-1)
        idx = self.indices(p)
        return flat if idx is None else flat[idx]
