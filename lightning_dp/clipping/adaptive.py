"""Adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially Private Learning with Adaptive
Clipping", NeurIPS; Algorithm 1 and Theorem 1): the bound follows a quantile γ of the units' gradient norms.

Each step clips at the current bound C_t (flat clipping, sensitivity C_t) and also releases a noisy count of
the units it did not clip. With b_u = 1[‖g_u‖ ≤ C_t] and B the expected number of units per step,

    b̃_t = (Σ_u (b_u − ½) + N(0, σ_b²)) / B + ½                 (the centred count, sensitivity ½)
    C_{t+1} = C_t · exp(−η (b̃_t − γ))                          (the geometric update, §2.2, eq. 4)

b̃_t estimates the fraction of units left unclipped; the update shrinks C while more than γ of them are
below it and grows it otherwise, so C tracks the γ-quantile of the norms.

Accounting: the count is a second release of the same sampled units. Together with the gradient's
Gaussian (sensitivity C_t, std σ_Δ C_t) it is one Gaussian mechanism on the pair, whose noise multiplier z
satisfies z⁻² = σ_Δ⁻² + (2σ_b)⁻² (Theorem 1; the count's sensitivity is ½). The ledger records z, the
multiplier asked for (``noise_multiplier``, or the one ``target_epsilon`` calibrates), and the gradient's
own noise is raised to σ_Δ = (z⁻² − (2σ_b)⁻²)^(−½) > z: the count's cost is inside every ledger entry,
so ε, ``target_epsilon``'s ceiling and :class:`~lightning_dp.callbacks.PrivacyBudget` all count it with no
second code path, and a run is charged exactly what a flat run at the same z is (never less). This needs
2σ_b > z; σ_b defaults to max(B/20, z) (B/20 is the paper's recommendation, §3; at σ_b = z the gradient's
noise is 15.5 % above z).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.clipping.flat import flat_factors
from lightning_dp.clipping.policy import ClippingPolicy, positive
from lightning_dp.secure_random import secure_gaussian, secure_seed


def raised_noise_multiplier(sigma: float, count_std: float) -> float:
    """σ_Δ = (z⁻² − (2σ_b)⁻²)^(−½): the gradient's multiplier that, with the count's noise σ_b, makes the pair one
    Gaussian mechanism of multiplier z = ``sigma`` (Andrew et al. 2021, Theorem 1). Needs 2σ_b > z."""
    rest = sigma ** -2 - (2.0 * count_std) ** -2
    if rest <= 0:
        raise PrivacyConfigurationError(
            f"AdaptiveClipping: the count's noise σ_b = {count_std:.4g} is too small for the noise multiplier "
            f"z = {sigma:.4g}: the noisy count alone would spend the whole budget (Andrew et al. 2021, Theorem 1 needs "
            f"2σ_b > z). Give count_noise_multiplier > {sigma / 2:.4g} (or leave it None: max(B/20, z)).")
    return rest ** -0.5


class AdaptiveClipping(ClippingPolicy):
    """Clip at a bound that follows the ``target_quantile`` of the units' norms (Andrew et al. 2021).

    Args:
        initial_norm: C_0, the first bound.
        target_quantile: γ in (0, 1), the fraction of units to leave unclipped (0.5: the median norm).
        learning_rate: η > 0 of the geometric update C ← C·exp(−η(b̃ − γ)).
        count_noise_multiplier: σ_b, the standard deviation of the Gaussian noise on the count of unclipped units
            (their number changes by at most 1 when one unit is added or removed). ``None``: max(B/20, z) with B
            the expected units per step and z the accounted noise multiplier. Must exceed z/2.

    The ledger records z; the gradient's noise multiplier is raised to (z⁻² − (2σ_b)⁻²)^(−½) (module docstring).
    """

    moved_by_releases = ("last_fraction", "updates")

    def __init__(self, initial_norm: float, target_quantile: float = 0.5, learning_rate: float = 0.2,
                 count_noise_multiplier: Optional[float] = None) -> None:
        self.initial_norm = positive(initial_norm, "initial_norm (C_0)")
        if not 0.0 < float(target_quantile) < 1.0:
            raise ValueError(f"target_quantile must be in (0, 1), got {target_quantile!r}")
        self.target_quantile = float(target_quantile)
        self.learning_rate = positive(learning_rate, "learning_rate (η)")
        self.count_noise_multiplier = (None if count_noise_multiplier is None
                                       else positive(count_noise_multiplier, "count_noise_multiplier (σ_b)"))
        self._bound = self.initial_norm
        self.secure = False
        """Draw the count's noise from the OS's CSPRNG (set by the private step in secure mode)."""
        self.last_fraction: Optional[float] = None
        """b̃ of the last update (a function of the noisy release only)."""
        self.updates = 0
        self._generator = torch.Generator().manual_seed(secure_seed())

    @property
    def configured_bound(self) -> float:
        """C_0."""
        return self.initial_norm

    def factors(self, norms: Tensor) -> Tensor:
        """min(1, C_t/‖g_u‖): flat clipping at the current bound."""
        return flat_factors(norms, self._bound)

    def count_std(self, sigma: float, expected_units: float) -> float:
        """σ_b: the given ``count_noise_multiplier``, or max(B/20, z)."""
        if self.count_noise_multiplier is not None:
            return self.count_noise_multiplier
        return max(expected_units / 20.0, sigma)

    def gradient_noise_multiplier(self, sigma: float, expected_units: float) -> float:
        """σ_Δ for the accounted z = ``sigma`` (:func:`raised_noise_multiplier`)."""
        return raised_noise_multiplier(sigma, self.count_std(sigma, expected_units))

    def after_release(self, norms: Tensor, expected_units: float, sigma: float,
                      reduce: Optional[Callable[[Tensor], None]] = None, rank: int = 0, world_size: int = 1) -> None:
        """Release the noisy centred count of this step's unclipped units and update the bound (module docstring).
        With several ranks each adds N(0, σ_b²/W) to its own count and one all-reduce sums them: every rank then
        holds the same b̃ (noise N(0, σ_b²) in all)."""
        std = self.count_std(sigma, expected_units) / math.sqrt(world_size)
        unclipped = float((norms.double() <= self._bound).sum()) - 0.5 * norms.numel()
        value = torch.tensor([unclipped + std * float(self._unit_gaussian())], dtype=torch.float64,
                             device=norms.device)
        if reduce is not None:
            reduce(value)
        fraction = float(value[0]) / expected_units + 0.5
        self._bound *= math.exp(-self.learning_rate * (fraction - self.target_quantile))
        self.last_fraction, self.updates = fraction, self.updates + 1

    def _unit_gaussian(self) -> float:
        if self.secure:
            return float(secure_gaussian(1)[0])
        return float(torch.randn(1, generator=self._generator, dtype=torch.float64)[0])

    def describe(self) -> str:
        """One line for the log."""
        sb = "max(B/20, z)" if self.count_noise_multiplier is None else f"{self.count_noise_multiplier:g}"
        return (f"adaptive clipping from C_0 = {self.initial_norm:g} towards the {self.target_quantile:g}-quantile "
                f"(η = {self.learning_rate:g}, count noise σ_b = {sb})")

    def state_dict(self) -> dict[str, Any]:
        """The current bound and the number of updates (never the count's generator)."""
        return {**super().state_dict(), "bound": self._bound, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's bound."""
        super().load_state_dict(state)
        if "bound" in state:
            self._bound = float(state["bound"])
            self.updates = int(state.get("updates", 0))

    def refusal(self, *, bands: int, **settings: Any) -> Optional[str]:
        """Also refused: banded (correlated) noise, whose accounting does not cover a fresh count each step."""
        if bands > 1:
            return ("AdaptiveClipping releases an independent noisy count each step, which banded noise's accounting "
                    "does not cover: use noise='gaussian' with it")
        return super().refusal(bands=bands, **settings)
