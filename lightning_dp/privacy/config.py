"""The privacy configuration: what the guarantee depends on, decided once before training and handed down unchanged.

The strategies turn their keyword arguments (the convenient front) into one :class:`PrivacyConfig` (what the
released ε depends on) and one :class:`ExecutionConfig` (how a step runs: never what is released or charged), and
hand both, frozen, to :meth:`~lightning_dp.privacy.private_step.PrivateStep.from_config`; a plain PyTorch loop builds
them through ``PrivateStep``'s keyword arguments. The σ a run trains at is state, not configuration: calibrated from
the target before the first step (:meth:`~lightning_dp.privacy.private_step.PrivateStep.calibrate`), checkpointed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lightning_dp.errors import KnownSeedWarning
from lightning_dp.privacy.noise import GaussianNoise, NoiseMechanism

NOISES = ("gaussian", "banded")
"""The noise mechanisms named by a string (or give a :class:`~lightning_dp.privacy.noise.NoiseMechanism`)."""


def check_target(target_epsilon: Optional[float], target_delta: Optional[float]) -> None:
    """A target ε, when given, is finite and > 0, with δ in (0, 1); raises ``ValueError``."""
    if target_epsilon is not None:
        if not (math.isfinite(target_epsilon) and target_epsilon > 0):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
        if target_delta is None or not 0 < target_delta < 1:
            raise ValueError(f"target_epsilon needs target_delta in (0, 1), got {target_delta!r}")


def warn_known_seeds(sampler_seed: Optional[int], noise: Any) -> None:
    """Warn (:class:`~lightning_dp.errors.KnownSeedWarning`) when the Poisson sampling or the noise follows a seed
    the caller chose: a known noise seed lets anyone re-draw z_t and subtract it (no privacy at all); a known sampler
    seed tells which steps sampled a record, so the amplification by sampling the ε counts on does not hold."""
    risks = []
    if getattr(noise, "seeded", False):
        risks.append("the noise follows a seed or generator you gave: whoever knows it can re-draw z_t and subtract "
                     "it, leaving the clipped sum itself (no ε holds)")
    if sampler_seed is not None:
        risks.append("the Poisson sampling follows sampler_seed: whoever knows it knows which steps sampled each "
                     "record, and the amplification by sampling the reported ε counts on does not hold")
    if risks:
        said = "; ".join(risks)
        warnings.warn(
            said[0].upper() + said[1:] + ". The guarantee holds only while the seed stays secret: seeds are for "
            "tests and reproducible research; give none in production (OS-seeded generators).",
            KnownSeedWarning, stacklevel=5)


@dataclass(frozen=True)
class PrivacyConfig:
    """What the guarantee depends on (module docstring). Field names are the strategies' keyword arguments.

    Attributes:
        noise_multiplier: σ; ``None``: calibrated from ``target_epsilon`` (or, without one, a non-private
            baseline that adds no noise: :class:`~lightning_dp.optim.sign_sgd.VirtualWorkersSignSGD`'s).
        max_grad_norm: C; ``None``: the clipping policy's bound, else the Trainer's ``gradient_clip_val``, else 1.0.
        target_epsilon, target_delta: the target (ε, δ) when σ is not given; also a ceiling on the ledger.
        accountant: ``"rdp"``, ``"prv"`` or ``"pld"`` (:mod:`lightning_dp.accounting`).
        noise: ``"gaussian"``, ``"banded"`` (with ``bands``) or a noise mechanism.
        bands: b of banded noise (docs/algorithms.md §7).
        secure_mode: sampling and noise from the OS's CSPRNG (docs/secure_mode.md).
        sampler_seed: the Poisson sampler's seed (tests only; default from the OS).
        clipping: the clipping policy (:mod:`lightning_dp.clipping`); ``None``: flat clipping at C.
        privacy_unit: :class:`~lightning_dp.units.Users` for user-level DP; ``None``: the example.
        public_state: state declared public (the release boundary does not refuse its changes).
        on_budget_short: ``"refuse"`` or ``"recalibrate"`` when the ledger leaves too little budget for the plan.
    """

    noise_multiplier: Optional[float] = None
    max_grad_norm: Optional[float] = None
    target_epsilon: Optional[float] = None
    target_delta: Optional[float] = None
    accountant: str = "rdp"
    noise: Union[str, NoiseMechanism, None] = "gaussian"
    bands: int = 1
    secure_mode: bool = False
    sampler_seed: Optional[int] = None
    clipping: Any = None
    privacy_unit: Any = None
    public_state: tuple[str, ...] = field(default=())
    on_budget_short: str = "refuse"

    def __post_init__(self) -> None:
        check_target(self.target_epsilon, self.target_delta)  # the strategies also ask for exactly one of σ, ε
        object.__setattr__(self, "public_state", tuple(self.public_state))
        if not (isinstance(self.noise, NoiseMechanism) or self.noise is None or self.noise in NOISES):
            raise ValueError(f"noise must be 'gaussian', 'banded' or a NoiseMechanism, got {self.noise!r}")
        if self.noise in (None, "gaussian") and self.bands != 1:
            raise ValueError(f"bands={self.bands} needs noise='banded' (independent Gaussian noise has one band)")
        if isinstance(self.noise, NoiseMechanism) and self.bands not in (1, getattr(self.noise, "bands", 1)):
            raise ValueError(f"bands={self.bands} conflicts with the given noise mechanism ({self.noise!r})")
        warn_known_seeds(self.sampler_seed, self.noise)

    def noise_mechanism(self) -> NoiseMechanism:
        """The noise mechanism z_t these settings name (a given mechanism is used as it is)."""
        if isinstance(self.noise, NoiseMechanism):
            return self.noise
        if self.noise == "banded":
            from lightning_dp.privacy.banded_noise import BandedToeplitzNoise

            return BandedToeplitzNoise(self.bands)
        if self.secure_mode:
            from lightning_dp.privacy.csprng import SecureGaussianNoise

            return SecureGaussianNoise()
        return GaussianNoise()


@dataclass(frozen=True)
class ExecutionConfig:
    """How a private step runs; nothing here changes what is released or what the ledger is charged.

    Attributes:
        engine: the per-example gradient engine by name, or ``"auto"`` (:mod:`lightning_dp.engine_api`).
        views_per_example: K, augmentation multiplicity (each example's K views, clipped once as their mean).
        max_physical_batch_size: the most examples one forward and backward holds (``1``: every example alone).
        fixed_batch_size: F: every physical batch exactly F rows (:mod:`lightning_dp.performance.fixed_batch`).
        verify: when the batch check runs: ``"sampled"``, ``"every_step"`` or ``"first_step"``.
        verify_budget: the share of training time the later batch checks may take.
        retain_cpu_memory: on CPU, keep freed memory for the next step instead of re-faulting it every step
            (:mod:`lightning_dp.performance.cpu_memory`: glibc's malloc thresholds, once per process).
    """

    engine: str = "auto"
    views_per_example: int = 1
    max_physical_batch_size: Optional[int] = None
    fixed_batch_size: Optional[int] = None
    verify: str = "sampled"
    verify_budget: float = 0.02
    retain_cpu_memory: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.views_per_example, int) and self.views_per_example >= 1):
            raise ValueError(f"views_per_example must be an integer >= 1, got {self.views_per_example!r}")
        if self.max_physical_batch_size is not None and self.max_physical_batch_size < 1:
            raise ValueError(
                f"max_physical_batch_size must be a positive integer, got {self.max_physical_batch_size!r}")
        if self.fixed_batch_size is not None and self.max_physical_batch_size is not None:
            raise ValueError("give fixed_batch_size or max_physical_batch_size, not both (with fixed_batch_size every "
                             "physical batch has exactly that many rows)")
