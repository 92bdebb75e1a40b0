"""A differentially private imputer: missing values (NaN) filled with a per-column mean released by the Gaussian
mechanism, charged to the privacy ledger of the fit that trains on the filled features.

``np.where(np.isnan(x), np.nanmean(x, 0), x)`` or scikit-learn's ``SimpleImputer`` writes the exact mean (or
median) of a column's observed values into its missing cells: every filled cell depends on every record, no noise
covers it, and rule 11 of the release boundary refuses the training
(:mod:`lightning_dp.record_statistics.imputed_cells`). :class:`PrivateImputer` fills them with a DP mean instead,
by the machinery of :class:`~lightning_dp.data.PrivateStandardizer` (docs/algorithms.md, "A private standardiser"):
each observed value clipped to a public range [lo, hi] and mapped to u ∈ [−1, 1] (a missing cell counts 0), then

    S = Σ_i u_i           Δ_S = √D      (one record: a point of the cube [−1, 1]^D, its missing coordinates 0)
    n_j = observed cells of column j     Δ_n = √D      (one record adds at most 1 to each column's count)

each released once with Gaussian noise of standard deviation σ·Δ per coordinate: two Gaussian mechanisms of noise
multiplier σ, charged to the ledger as two full-batch releases (q = 1). The fill of column j is
``c + h · S̃_j / max(ñ_j, 1)``, kept in [lo, hi]. A constant or public fill (0, −1, a domain's default) costs no ε
and passes rule 11 as well.

With ``groups=G`` (a public number: the classes, a category's levels) the fill is a DP mean per group and column
(the class-conditional fill of :mod:`lightning_dp.record_statistics.grouped_fills`, done privately): each record's
group (an integer in [0, G), its own label) picks one row of the sums and counts [G, D], so one record still moves
them by at most √D each (parallel composition over disjoint groups), and the charge is the same two releases.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_dp.data.private_standardizer import Bound, _bound, _ledger_of, _pair, _sigma, centred_sums, \
    charge_releases, check_seeded, gaussian_noise
from lightning_dp.data.public_bounds import check_public_bounds
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.record_checks.released_transforms import note_transformed


class PrivateImputer:
    """Missing values filled with a DP mean per column (module docstring).

    Example:
        >>> from lightning_dp.accounting import PrivacyLedger
        >>> x = torch.rand(1000, 3) * 10
        >>> x[::7, 1] = float("nan")
        >>> ledger = PrivacyLedger()
        >>> imputer = PrivateImputer(lower=0.0, upper=10.0, noise_multiplier=5.0).fit(x, ledger)
        >>> bool(torch.isnan(imputer.transform(x)).any()), ledger.steps  # two Gaussian releases
        (False, 2)

    Args:
        lower, upper: the public range of each feature (a number, or one per feature); observed values outside are
            clipped to it for the mean (not in :meth:`transform`). Never computed from the private data (refused
            at :meth:`fit` when equal to the columns' extremes or tail percentiles: :mod:`.public_bounds`).
        noise_multiplier: σ, the noise standard deviation of each release over its sensitivity.
        generator: a ``torch.Generator`` for the noise (reproducible tests: a KnownSeedWarning, refused under
            ``secure_mode``); ``None``: the OS's CSPRNG.
        groups: a public number of groups G: :meth:`fit` and :meth:`transform` then take each record's group
            (``group``: integers in [0, G), the labels) and fill its cells with its group's DP mean.

    A fit that trains on the filled features must be charged this release (:meth:`fit` with the Trainer's strategy,
    or :meth:`charge`), else it is refused (:mod:`~lightning_dp.record_checks.released_transforms`).
    """

    releases = 2
    """Gaussian releases of noise multiplier σ that :meth:`fit` makes: the sums and the counts."""

    def __init__(self, lower: Bound, upper: Bound, noise_multiplier: float,
                 generator: Optional[torch.Generator] = None, groups: Optional[int] = None) -> None:
        self.lower, self.upper = _bound(lower, "lower"), _bound(upper, "upper")
        if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1):
            raise PrivacyConfigurationError("PrivateImputer: groups must be a public number of groups (an int ≥ 1).")
        self.groups = groups
        self.noise_multiplier, self.generator = _sigma(noise_multiplier), generator
        self.fill: Optional[Tensor] = None
        """The released per-column fill (float64, the features' shape after the first dimension; [G, ...] with
        ``groups``), after :meth:`fit`."""
        self.run: Optional[str] = None
        """The name its ledger entries carry, per fit."""

    def fit(self, features: Any, charge: Any, group: Any = None) -> "PrivateImputer":
        """Release the per-column mean of the observed values of ``features`` ([N, D]; a tensor or an array, NaN
        where missing) and charge its privacy to ``charge``: a
        :class:`~lightning_dp.accounting.ledger.PrivacyLedger`, or what holds one as ``.ledger`` (a
        :class:`~lightning_dp.DPStrategy` before its fit). ``group``: each record's group ([N] integers in [0, G)),
        with ``groups=G`` only: one mean per group and column."""
        ledger = _ledger_of(charge)
        x = _features(features)
        if x.shape[0] == 0:
            raise PrivacyConfigurationError("PrivateImputer: no records to fit on (empty features).")
        lower, upper = _pair(self.lower, self.upper, tuple(x.shape[1:]))
        check_public_bounds(x, lower, upper, (self.lower, self.upper), type(self).__name__)
        check_seeded(self.generator, charge, type(self).__name__)
        c, h = (lower + upper) / 2, (upper - lower) / 2
        missing = torch.isnan(x)
        one_hot = self._one_hot(group, x.shape[0])  # [N, G]: each record in its one group (all in one without)
        filled = torch.where(missing, c.expand_as(x), x)  # a missing cell: u = 0
        sums = torch.stack([centred_sums(filled[one_hot[:, k] > 0], lower, upper)[0] for k in range(len(one_hot.T))])
        counts = torch.einsum("ng,n...->g...", one_hot, (~missing).to(torch.float64))
        sigma = self.noise_multiplier = _sigma(self.noise_multiplier)
        scale = sigma * float(lower.numel()) ** 0.5
        noisy_sums = sums + scale * gaussian_noise(sums.numel(), self.generator).view_as(sums)
        noisy_counts = counts + scale * gaussian_noise(counts.numel(), self.generator).view_as(counts)
        self.run = f"PrivateImputer-{uuid.uuid4().hex[:16]}"
        charge_releases(ledger, self.run, sigma, self.releases)
        fill = torch.minimum(torch.maximum(c + h * noisy_sums / noisy_counts.clamp_min(1.0), lower), upper)
        self.fill = fill if self.groups is not None else fill[0]
        return self

    def charge(self, other: Any) -> None:
        """Charge this fit's releases to another ledger too (``other``: a ledger or what holds one as ``.ledger``):
        the fit that trains on the filled features spends them."""
        if self.fill is None:
            raise RuntimeError("PrivateImputer: fit() first.")
        charge_releases(_ledger_of(other), self.run, self.noise_multiplier, self.releases)

    def transform(self, features: Any, group: Any = None) -> Tensor:
        """``features`` with each NaN replaced by its column's released fill (its group's, with ``groups``); other
        values unchanged (a float tensor; float32 unless ``features`` are a float tensor)."""
        if self.fill is None:
            raise RuntimeError("PrivateImputer: fit() first.")
        x = _features(features)
        shape = tuple(self.fill.shape[1:] if self.groups is not None else self.fill.shape)
        if tuple(x.shape[1:]) != shape:
            raise ValueError(f"PrivateImputer: features of shape {tuple(x.shape[1:])} per record, fitted on {shape}")
        fill = self.fill if self.groups is None else torch.einsum("ng,g...->n...", self._one_hot(group, len(x)),
                                                                  self.fill)
        out = torch.where(torch.isnan(x), fill.expand_as(x), x)
        dtype = features.dtype if isinstance(features, Tensor) and features.dtype.is_floating_point else torch.float32
        out = out.to(dtype)
        note_transformed(self, features, out)  # a fit training on it is charged this release; its rows are the
        # input rows' records (record_checks/row_lineage.py)
        return out

    def fit_transform(self, features: Any, charge: Any, group: Any = None) -> Tensor:
        """:meth:`fit` then :meth:`transform` of the same features (and groups)."""
        return self.fit(features, charge, group).transform(features, group)

    def _one_hot(self, group: Any, n: int) -> Tensor:
        """[n, G] float64: each record's group as a one-hot row ([n, 1] of ones without ``groups``)."""
        if self.groups is None:
            if group is not None:
                raise ValueError("PrivateImputer: a group was given, but no groups= number at construction.")
            return torch.ones(n, 1, dtype=torch.float64)
        g = group.detach() if isinstance(group, Tensor) else torch.as_tensor(group) if group is not None else None
        if g is None or tuple(g.shape) != (n,) or g.dtype.is_floating_point or g.dtype == torch.bool:
            raise ValueError(f"PrivateImputer(groups={self.groups}): group must be [N] integers, one per record.")
        g = g.to("cpu", torch.int64)
        if n and (int(g.min()) < 0 or int(g.max()) >= self.groups):
            raise ValueError(f"PrivateImputer: groups must lie in [0, {self.groups}).")
        return torch.nn.functional.one_hot(g, self.groups).to(torch.float64)


def _features(features: Any) -> Tensor:
    x = features.detach() if isinstance(features, Tensor) else torch.as_tensor(features)
    if x.dim() < 2:
        raise ValueError("PrivateImputer: features must be [N, D] (one row per record).")
    return x.to("cpu", torch.float64)
