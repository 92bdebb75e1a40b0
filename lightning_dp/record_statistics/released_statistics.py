"""Statistics of the training data released by a DP mechanism before training, which rule 11 lets through.

:class:`~lightning_dp.data.PrivateStandardizer` releases per-feature means and standard deviations with the Gaussian
mechanism and charges a privacy ledger for them (docs/algorithms.md, "A private standardiser"). What it releases, and
the features it scales with them, are noted here at release (:func:`note_released`, :func:`note_scaled`), and the
check of :mod:`.data_statistics` does not refuse them: a buffer equal to a noted vector, a feature tensor whose
columns have the noted means and standard deviations.

By content, not by object: a noted value copied, cast to float32 or moved to another device still matches, to a
relative 1e-6 (float32 rounding is 6e-8), and so do noted features (their columns' means to 1e-7, their deviations to
a relative 1e-6). A value computed by the user is not noted: the features' exact mean differs
from a released one by the noise (σ·Δ/n per feature), so it stays refused, and so do features standardised again with
their own statistics. A fit lets through only the releases its own ledger was
charged (by the run their entries carry): one charged to a ledger thrown away still counts as unreleased. Only a
release whose noise is below that tolerance (a σ so small that the ledger's ε is
meaningless) would let the exact statistics pass for it. The notes live in this process (the last
:data:`KEPT` of each kind).
"""

from __future__ import annotations

from typing import Any, Collection, Optional

import torch
from torch import Tensor

KEPT = 64
"""How many released vectors and scaled tensors are remembered (the oldest are forgotten)."""

_RTOL, _ATOL = 1e-6, 1e-9
_RELEASED: list[tuple[str, Tensor]] = []  # (the release's run, the vector)
_SCALED: list[tuple[str, tuple[int, ...], Tensor, Tensor]] = []  # (run, shape, columns' means, columns' deviations)


def note_released(run: str, *values: Tensor) -> None:
    """Note ``values`` as released statistics: released by a DP mechanism whose ledger entries carry ``run``
    (:attr:`~lightning_dp.accounting.ledger.LedgerEntry.run`)."""
    for value in values:
        _RELEASED.append((run, value.detach().to("cpu", torch.float64).reshape(-1).clone()))
    del _RELEASED[:-KEPT]


def note_scaled(run: str, features: Tensor) -> None:
    """Note ``features`` (scaled by the statistics released as ``run``) by their shape and columns' means and
    deviations."""
    _SCALED.append((run, tuple(features.shape), *_columns(features)))
    del _SCALED[:-KEPT]


def is_released(candidate: Any, charged: Optional[Collection[str]] = None) -> bool:
    """Whether the tensor ``candidate`` is, to float32 precision, a noted released vector — of a release whose run is
    in ``charged`` (the runs of the fit's ledger: a release charged to another ledger does not count), or of any
    release when ``charged`` is ``None``."""
    if not isinstance(candidate, Tensor) or not _RELEASED:
        return False
    c = candidate.detach().to("cpu", torch.float64).reshape(-1)
    return any(r.numel() == c.numel() and (charged is None or run in charged)
               and bool(torch.allclose(c, r, rtol=_RTOL, atol=_ATOL)) for run, r in _RELEASED)


def is_released_scaling(features: Tensor, charged: Optional[Collection[str]] = None) -> bool:
    """Whether ``features`` are, to float32 precision, features noted as scaled by released statistics (of a run in
    ``charged``, as :func:`is_released`)."""
    shape = tuple(features.shape)
    if not any(s == shape for _, s, _, _ in _SCALED):
        return False
    means, stds = _columns(features)
    return any(s == shape and (charged is None or run in charged) and bool(torch.allclose(means, m, rtol=0, atol=1e-7))
               and bool(torch.allclose(stds, d, rtol=_RTOL, atol=1e-7)) for run, s, m, d in _SCALED)


def _columns(features: Tensor) -> tuple[Tensor, Tensor]:
    flat = features.detach().to("cpu", torch.float64).reshape(features.shape[0], -1)
    return flat.mean(0), flat.std(0, correction=0)
