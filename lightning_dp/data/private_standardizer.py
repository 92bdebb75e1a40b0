"""A differentially private standardiser for tabular features: per-feature mean and standard deviation released by
the Gaussian mechanism, charged to the privacy ledger of the fit that trains on them.

scikit-learn's ``StandardScaler().fit(x_train)`` computes the private features' exact mean and standard deviation:
no noise covers them, and rule 11 of the release boundary refuses the training that uses them
(:mod:`lightning_dp.record_statistics.data_statistics`). :class:`PrivateStandardizer` estimates them privately
(docs/algorithms.md, "A private standardiser"): each feature clipped to a public range [lo, hi] given by the user
(never computed from the data) and mapped to [−1, 1] by that public range, u = (clip(x, lo, hi) − c) / h with
c = (lo + hi) / 2 and h = (hi − lo) / 2; for D features,

    S = Σ_i u_i               Δ_S = √D       (add/remove one record: one term, a point of the cube [−1, 1]^D)
    Q = Σ_i (u_i² − ½)        Δ_Q = ½ √D     (each coordinate of a term in [−½, ½])
    n                         Δ_n = 1

each released once with Gaussian noise of standard deviation σ·Δ per coordinate (n not released when it is given
as public): a Gaussian mechanism of noise multiplier σ per release, RDP α / (2σ²) each, charged to the ledger as that
many full-batch releases (q = 1, :meth:`~lightning_dp.accounting.ledger.PrivacyLedger.record`). Working in u keeps
each feature's noise in proportion to its own range (σ√D·h_j on its sum) instead of the widest feature's. Then

    mean = c + h · S̃ / ñ,    var = h² · (Q̃ / ñ + ½ − (S̃ / ñ)²)

post-processed: ñ at least 1, the mean kept in [lo, hi], the variance in [(min_std·(hi − lo))², h²] (the largest
variance a value in [lo, hi] can have).

The released mean, standard deviation and variance are noted as released by :meth:`~PrivateStandardizer.fit` itself
(:mod:`lightning_dp.record_statistics.released_statistics`; only that method of this class notes, after the noise and
the charge: a user's direct call is refused, a subclass's releases are not noted): a fit that keeps them is not
refused, its ledger counts their ε with the training's, and checkpoints carry the ledger. Features
:meth:`~PrivateStandardizer.transform` scales with them pass rule 11 by their noise (their columns are not exactly
standardised), not by a note.
"""

from __future__ import annotations

import math
import uuid
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.data.public_bounds import check_public_bounds
from lightning_dp.errors import KnownSeedWarning, PrivacyConfigurationError, warn_or_refuse
from lightning_dp.record_checks.released_transforms import note_transformed
from lightning_dp.record_statistics.released_statistics import note_released
from lightning_dp.secure_random import secure_gaussian

Bound = Union[float, Tensor, Any]


def centred_sums(features: Tensor, lower: Tensor, upper: Tensor) -> tuple[Tensor, Tensor]:
    """The noiseless S and Q of the module docstring for ``features`` [N, ...] clipped to [``lower``, ``upper``]
    (float64, in the units of u): what one record changes by at most Δ_S and Δ_Q in L2 norm."""
    c, h = (lower + upper) / 2, (upper - lower) / 2
    u = (torch.minimum(torch.maximum(features.to(torch.float64), lower), upper) - c) / h
    return u.sum(0), (u.square() - 0.5).sum(0)


def charge_releases(ledger: PrivacyLedger, run: Optional[str], sigma: float, releases: int) -> None:
    """Charge ``releases`` Gaussian mechanisms of multiplier σ to ``ledger``: RDP α/(2σ²) each, full-batch entries
    (q = 1) named by ``run`` (the same releases charged to two ledgers are one history when combined)."""
    kept, ledger.run = ledger.run, run
    try:
        ledger.record(sigma, 1.0, steps=releases)
    finally:
        ledger.run = kept


class PrivateStandardizer:
    """Per-feature mean and standard deviation of private features by the Gaussian mechanism (module docstring).

    Example:
        >>> from lightning_dp.accounting import PrivacyLedger
        >>> ledger = PrivacyLedger()
        >>> scaler = PrivateStandardizer(lower=0.0, upper=10.0, noise_multiplier=5.0).fit(torch.rand(1000, 3) * 10,
        ...                                                                              ledger)
        >>> ledger.entries[0].noise_multiplier, ledger.entries[0].sample_rate, ledger.steps  # 3 Gaussian releases
        (5.0, 1.0, 3)

    Args:
        lower, upper: the public range of each feature (a number, or one per feature: [D] or the features' shape
            after the first dimension); values outside are clipped to it. Never computed from the private data: a
            domain's known limits, or a generous round range (a wider one costs accuracy, not privacy). Bounds equal
            to the columns' extremes or tail percentiles are refused at :meth:`fit` (:mod:`.public_bounds`).
        noise_multiplier: σ, the noise standard deviation of each release over its sensitivity.
        count: the number of training records if it is public (then it is not released: two releases instead of
            three); ``None`` (the default): released with noise.
        min_std: the standard deviation's floor, as a fraction of hi − lo (a noisy variance can be ≤ 0).
        generator: a ``torch.Generator`` for the noise (reproducible tests: a
            :class:`~lightning_dp.errors.KnownSeedWarning`, refused under ``secure_mode``); ``None``: the OS's
            CSPRNG (:func:`~lightning_dp.secure_random.secure_gaussian`).

    A fit that trains on features :meth:`transform` computed must be charged this release: pass the Trainer's
    strategy to :meth:`fit`, or :meth:`charge` it; otherwise that fit is refused
    (:mod:`~lightning_dp.record_checks.released_transforms`).
    """

    def __init__(self, lower: Bound, upper: Bound, noise_multiplier: float, count: Optional[int] = None,
                 min_std: float = 0.01, generator: Optional[torch.Generator] = None) -> None:
        sigma = _sigma(noise_multiplier)
        if count is not None and (isinstance(count, bool) or int(count) != count or int(count) < 1):
            raise PrivacyConfigurationError("PrivateStandardizer: count must be a public number of records ≥ 1, or "
                                            "None to release a noised count.")
        if not 0 < float(min_std) < 0.5:
            raise PrivacyConfigurationError("PrivateStandardizer: min_std is a fraction of hi − lo in (0, 0.5).")
        self.lower, self.upper = _bound(lower, "lower"), _bound(upper, "upper")
        self.noise_multiplier, self.count, self.min_std, self.generator = sigma, count, float(min_std), generator
        self.mean: Optional[Tensor] = None
        """The released per-feature mean (float64, the features' shape after the first dimension), after :meth:`fit`."""
        self.std: Optional[Tensor] = None
        """The released per-feature standard deviation (float64), after :meth:`fit`."""
        self.noisy_sum: Optional[Tensor] = None
        """S̃: the released noisy sum of the clipped values mapped to [−1, 1] (u)."""
        self.noisy_squares: Optional[Tensor] = None
        """Q̃: the released noisy sum of u² − ½."""
        self.noisy_count: Optional[float] = None
        """ñ: the released noisy count, or the public ``count``."""
        self.run: Optional[str] = None
        """The name its ledger entries carry (:attr:`~lightning_dp.accounting.ledger.LedgerEntry.run`), per fit."""

    @property
    def releases(self) -> int:
        """Gaussian releases of noise multiplier σ that :meth:`fit` makes: S, Q, and n unless it is public."""
        return 2 if self.count is not None else 3

    @property
    def var(self) -> Optional[Tensor]:
        """The released per-feature variance (``std²``)."""
        return None if self.std is None else self.std.square()

    def sensitivities(self, shape: Optional[tuple[int, ...]] = None) -> tuple[float, float, float]:
        """(Δ_S, Δ_Q, Δ_n) = (√D, ½√D, 1): the L2 sensitivities of the releases (in the units of u) under adding
        or removing one record, for D features of ``shape`` after the first dimension (the bounds' own by default)."""
        lower, _ = _pair(self.lower, self.upper, shape)
        d = math.sqrt(lower.numel())
        return d, d / 2, 1.0

    def fit(self, features: Any, charge: Any) -> "PrivateStandardizer":
        """Release the mean and standard deviation of ``features`` ([N, D] or [N, ...]; a tensor or an array) and
        charge their privacy to ``charge``: a :class:`~lightning_dp.accounting.ledger.PrivacyLedger`, or what holds
        one as ``.ledger`` (a :class:`~lightning_dp.DPStrategy` before its fit: the fit's ε then counts them)."""
        ledger = _ledger_of(charge)
        x = _features(features)
        if self.count is not None and int(self.count) != x.shape[0]:
            raise PrivacyConfigurationError(
                "PrivateStandardizer: the public count differs from the number of rows given; pass the training "
                "records only, or count=None to release a noised count.")
        lower, upper = _pair(self.lower, self.upper, tuple(x.shape[1:]))
        check_public_bounds(x, lower, upper, (self.lower, self.upper), type(self).__name__)
        check_seeded(self.generator, charge, type(self).__name__)
        d_s, d_q, d_n = self.sensitivities(tuple(x.shape[1:]))
        s, q = centred_sums(x, lower, upper)
        sigma = self.noise_multiplier = _sigma(self.noise_multiplier)  # set to 0 after __init__: refused too
        self.noisy_sum = s + sigma * d_s * self._noise(s.numel()).view_as(s)
        self.noisy_squares = q + sigma * d_q * self._noise(q.numel()).view_as(q)
        self.noisy_count = float(self.count) if self.count is not None else \
            x.shape[0] + sigma * d_n * float(self._noise(1)[0])
        self.run = f"PrivateStandardizer-{uuid.uuid4().hex[:16]}"
        self._record(ledger)
        n = max(self.noisy_count, 1.0)
        c, h = (lower + upper) / 2, (upper - lower) / 2
        shift = self.noisy_sum / n
        var = h.square() * (self.noisy_squares / n + 0.5 - shift.square())
        floor = (self.min_std * (upper - lower)).square()
        self.mean = torch.minimum(torch.maximum(c + h * shift, lower), upper)
        self.std = torch.minimum(torch.maximum(var, floor), h.square()).sqrt()
        note_released(self)  # this object's releases, noised and charged: rule 11 lets them pass
        return self

    def charge(self, other: Any) -> None:
        """Charge this fit's releases to another ledger too (``other``: a ledger or what holds one as ``.ledger``):
        a second model trained on the same standardised features spends them as well."""
        if self.mean is None:
            raise RuntimeError("PrivateStandardizer: fit() first.")
        self._record(_ledger_of(other))

    def _record(self, ledger: PrivacyLedger) -> None:
        charge_releases(ledger, self.run, self.noise_multiplier, self.releases)

    def transform(self, features: Any) -> Tensor:
        """``(clip(x, lo, hi) − mean) / std`` per feature (a float tensor; float32 unless ``features`` are a float
        tensor). Each record is scaled alone, by released values: training or test features alike."""
        if self.mean is None or self.std is None:
            raise RuntimeError("PrivateStandardizer: fit() first.")
        x = _features(features, allow_empty=True)
        lower, upper = _pair(self.lower, self.upper, tuple(x.shape[1:]))
        if tuple(x.shape[1:]) != tuple(self.mean.shape):
            raise ValueError(f"PrivateStandardizer: features of shape {tuple(x.shape[1:])} per record, fitted on "
                             f"{tuple(self.mean.shape)}")
        out = (torch.minimum(torch.maximum(x.to(torch.float64), lower), upper) - self.mean) / self.std
        dtype = features.dtype if isinstance(features, Tensor) and features.dtype.is_floating_point else torch.float32
        out = out.to(dtype)
        note_transformed(self, features, out)  # a fit training on it is charged this release; its rows are the
        # input rows' records (record_checks/row_lineage.py)
        return out

    def fit_transform(self, features: Any, charge: Any) -> Tensor:
        """:meth:`fit` then :meth:`transform` of the same features."""
        return self.fit(features, charge).transform(features)

    def _noise(self, count: int) -> Tensor:
        return gaussian_noise(count, self.generator)


def gaussian_noise(count: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """``count`` standard normal draws (float64): from ``generator`` (reproducible tests), else the OS's CSPRNG
    (:func:`~lightning_dp.secure_random.secure_gaussian`)."""
    if generator is not None:
        return torch.randn(count, generator=generator, dtype=torch.float64)
    return secure_gaussian(count)


def check_seeded(generator: Optional[torch.Generator], charge: Any, name: str) -> None:
    """A ``generator`` given for the noise: refused when ``charge`` is a strategy in ``secure_mode``, else
    :class:`~lightning_dp.errors.KnownSeedWarning` (an error where the user made it one), as for DPStrategy's noise."""
    if generator is None:
        return
    if getattr(charge, "secure_mode", False):
        raise PrivacyConfigurationError(f"{name}: secure_mode draws the noise from the OS's CSPRNG: remove the "
                                        "generator (its seed would let anyone re-draw the noise).")
    warn_or_refuse(KnownSeedWarning, f"{name}: the noise follows the generator you gave: whoever knows its seed can "
                   "re-draw the noise and subtract it from the released statistics, leaving the exact ones (no ε "
                   "holds). Generators are for tests; give none in production (the OS's CSPRNG), as "
                   "DPStrategy(secure_mode=True) requires.", stacklevel=4)


def _sigma(value: Any) -> float:
    sigma = float(value)
    if not sigma > 0 or math.isinf(sigma):
        raise PrivacyConfigurationError(
            "PrivateStandardizer: noise_multiplier must be a finite number > 0 (σ = 0 releases the exact mean and "
            "standard deviation); calibrate it for the ε you can spend on the statistics.")
    return sigma


def _bound(value: Bound, name: str) -> Tensor:
    t = torch.as_tensor(value, dtype=torch.float64)
    if not bool(torch.isfinite(t).all()):
        raise PrivacyConfigurationError(f"PrivateStandardizer: {name} must be finite numbers (a public range).")
    return t


def _pair(lower: Tensor, upper: Tensor, shape: Optional[tuple[int, ...]]) -> tuple[Tensor, Tensor]:
    """The bounds broadcast to ``shape``; refused unless lo < hi everywhere."""
    try:
        lo, hi = torch.broadcast_tensors(lower, upper)
        if shape is not None:
            lo, hi = lo.expand(shape), hi.expand(shape)
    except RuntimeError as err:
        raise PrivacyConfigurationError(
            f"PrivateStandardizer: lower and upper must be numbers or one per feature (shape {shape}).") from err
    if not bool((lo < hi).all()):
        raise PrivacyConfigurationError("PrivateStandardizer: every feature's lower bound must be below its upper "
                                        "bound (lower < upper), both public.")
    return lo, hi


def _features(features: Any, allow_empty: bool = False) -> Tensor:
    x = features.detach() if isinstance(features, Tensor) else torch.as_tensor(features)
    if x.dim() < 2:
        raise ValueError("PrivateStandardizer: features must be [N, D] (one row per record).")
    x = x.to("cpu", torch.float64)
    if not allow_empty and x.shape[0] == 0:
        raise PrivacyConfigurationError("PrivateStandardizer: no records to fit on (empty features).")
    if bool(torch.isnan(x).any()):
        raise PrivacyConfigurationError(
            "PrivateStandardizer: the features hold NaN (missing values); impute them with a public value (a fixed "
            "constant, not the column's mean) before fitting.")
    return x


def _ledger_of(charge: Any) -> PrivacyLedger:
    ledger = charge if isinstance(charge, PrivacyLedger) else getattr(charge, "ledger", None)
    if not isinstance(ledger, PrivacyLedger):
        raise PrivacyConfigurationError(
            "PrivateStandardizer: charge must be the PrivacyLedger (or the DPStrategy holding it) that counts the "
            "release's ε with the training's.")
    if "user" in (getattr(ledger, "unit", "example"), getattr(charge, "privacy_unit", "example")):
        raise PrivacyConfigurationError(
            "PrivateStandardizer: its sensitivity is one record's; a ledger per user (privacy_unit=Users) would "
            "undercount it. Standardise with public constants for user-level DP.")
    return ledger
