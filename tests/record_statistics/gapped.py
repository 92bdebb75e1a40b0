"""Tables with missing cells, for the tests of record_statistics/' fills (imputed_cells, grouped_fills,
neighbour_copies)."""

from __future__ import annotations

import numpy as np


def with_gaps(x: np.ndarray, share: float = 0.1, seed: int = 1) -> np.ndarray:
    """A float64 copy of ``x`` with about ``share`` of its cells NaN (a fixed pseudo-random choice per ``seed``)."""
    x = x.astype(np.float64).copy()
    x[np.random.default_rng(seed).random(x.shape) < share] = np.nan
    return x
