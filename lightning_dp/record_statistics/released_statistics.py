"""Statistics of the training data released by a DP mechanism before training, which rule 11 lets through.

:class:`~lightning_dp.data.PrivateStandardizer` releases per-feature means and standard deviations with the Gaussian
mechanism and charges a privacy ledger for them (docs/algorithms.md, "A private standardiser"). What it releases is
noted here at release (:func:`note_released`: by that object's own ``fit``, after the noise and the charge, and by
nothing else — a direct call from the user's code is refused and notes nothing, so no exact statistic is laundered
as released), and the check of :mod:`.data_statistics` does not refuse a buffer equal to a noted vector (a copy,
cast to float32 or moved to another device, still matches, to a relative 1e-6; float32 rounding is 6e-8). A value
computed by the user is not noted: the features' exact mean differs from a released one by the noise (σ·Δ/n per
feature), so it stays refused. A fit lets through only the releases its own ledger was charged (by the run their
entries carry): one charged to a ledger thrown away still counts as unreleased. Only a release whose noise is below
that tolerance (a σ so small that the ledger's ε is meaningless) would let the exact statistics pass for it. The
notes live in this process (the last :data:`KEPT`).

Features *scaled* by released statistics are not noted: with any σ worth its ε their columns' means and deviations
are off 0 and 1 by the noise, which the check's "standardised with its own statistics" test (to 1e-4) does not take
for the exact ones; noting the standardiser's outputs let a caller launder exactly standardised features through
``transform`` (zoo25 s1: ``transform(x_std * std + mean)`` returns ``x_std``).
"""

from __future__ import annotations

import sys
from typing import Any, Collection, Optional

import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError

KEPT = 64
"""How many released vectors are remembered (the oldest are forgotten)."""

_RTOL, _ATOL = 1e-6, 1e-9
_RELEASED: list[tuple[str, Tensor]] = []  # (the release's run, the vector)
_SCALES: list[tuple[str, Tensor]] = []  # (the release's run, [4, D]: its mean, std, public lower and upper bounds)
_RELEASER = ("lightning_dp.data.private_standardizer", "PrivateStandardizer")  # whose fit notes (data: a room above)


def note_released(releaser: Any, *values: Any) -> None:
    """Note what ``releaser`` released — a :class:`~lightning_dp.data.PrivateStandardizer` in its own ``fit``, once
    the noise is drawn and its ledger charged: its mean, standard deviation and variance, under its run
    (:attr:`~lightning_dp.accounting.ledger.LedgerEntry.run`). Bound to that object and that method: called from
    anywhere else (a user's code noting an exact mean "released") it is refused and notes nothing; a subclass's
    releases are not noted (it may draw other noise, or none). ``values`` are refused (the releaser's are noted)."""
    caller = sys._getframe(1)
    base = next((k for k in type(releaser).__mro__ if (k.__module__, k.__qualname__) == _RELEASER), None)
    fit = vars(base).get("fit") if base is not None else None
    if values or caller.f_code is not getattr(fit, "__code__", None) or caller.f_locals.get("self") is not releaser:
        raise PrivacyConfigurationError(
            "note_released is PrivateStandardizer.fit's own: it notes the statistics that fit released with noise and "
            "charged to a ledger. A value noted from elsewhere would pass rule 11 un-noised; release statistics with "
            "lightning_dp.data.PrivateStandardizer (or declare a public value: DPStrategy(public_state=[name])).")
    if type(releaser) is not base:
        return  # a subclass of the standardiser: its releases are not noted
    std = releaser.std
    for value in (releaser.mean, std, std.square()):
        _RELEASED.append((releaser.run, value.detach().to("cpu", torch.float64).reshape(-1).clone()))
    del _RELEASED[:-KEPT]
    mean, std = releaser.mean.detach().to("cpu", torch.float64), std.detach().to("cpu", torch.float64)
    lower, upper = (b.detach().to("cpu", torch.float64).expand_as(mean) for b in (releaser.lower, releaser.upper))
    _SCALES.append((releaser.run, torch.stack([mean.reshape(-1), std.reshape(-1), lower.reshape(-1),
                                               upper.reshape(-1)]).clone()))
    del _SCALES[:-KEPT]


def is_released(candidate: Any, charged: Optional[Collection[str]] = None) -> bool:
    """Whether the tensor ``candidate`` is, to float32 precision, a noted released vector — of a release whose run is
    in ``charged`` (the runs of the fit's ledger: a release charged to another ledger does not count), or of any
    release when ``charged`` is ``None``."""
    if not isinstance(candidate, Tensor) or not _RELEASED:
        return False
    c = candidate.detach().to("cpu", torch.float64).reshape(-1)
    return any(r.numel() == c.numel() and (charged is None or run in charged)
               and bool(torch.allclose(c, r, rtol=_RTOL, atol=_ATOL)) for run, r in _RELEASED)


def released_end(value: float, charged: Optional[Collection[str]] = None) -> bool:
    """Whether a column's tie at ``value`` is one a :class:`~lightning_dp.data.PrivateStandardizer` release in
    ``charged`` (``None``: any) explains: for one of its features, ``value · std + mean`` (undoing its transform by the
    released, noised statistics) is its public lower or upper bound, or a number of at most two significant digits
    (a public clip before it: ``x.clamp(-4.5, 4.5)``), to a relative 1e-6. Its output ties there, and stays so with
    its columns reordered or selected (:mod:`.clipped_columns`). A clip at the data's own percentiles lands there by
    chance with probability about 1e-4 per released feature and end."""
    for run, scales in _SCALES:
        if charged is not None and run not in charged:
            continue
        mean, std, lower, upper = scales
        pre = float(value) * std + mean
        tol = _TIE_RTOL * pre.abs().clamp(min=1.0)
        if bool(((pre - lower).abs() <= tol).any()) or bool(((pre - upper).abs() <= tol).any()):
            return True
        if any(abs(p - float(f"{p:.2g}")) <= t for p, t in zip(pre.tolist(), tol.tolist())):
            return True
    return False


def released_vectors(charged: Optional[Collection[str]] = None) -> list[Tensor]:
    """The noted released vectors (float64) of the runs ``charged`` (``None``: any): a held vector that is one of
    them rounded is not taken for a statistic near the exact one (:mod:`.near_statistics`)."""
    return [r for run, r in _RELEASED if charged is None or run in charged]


_TIE_RTOL = 1e-6
