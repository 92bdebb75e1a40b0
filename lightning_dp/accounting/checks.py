"""Input checks shared by the accounting functions (clear errors, the fix named)."""

from __future__ import annotations

import math


def check_delta(delta: float) -> float:
    """Return δ as a float; raise ``ValueError`` unless 0 < δ < 1."""
    if not isinstance(delta, (int, float)) or math.isnan(delta) or not 0.0 < delta < 1.0:
        raise ValueError(
            f"delta must be in (0, 1), got {delta!r}; a sound choice is below 1/N for a dataset of N examples"
        )
    return float(delta)


def check_sample_rate(sample_rate: float) -> float:
    """Return q as a float; raise ``ValueError`` unless 0 < q ≤ 1."""
    if not isinstance(sample_rate, (int, float)) or math.isnan(sample_rate) or not 0.0 < sample_rate <= 1.0:
        raise ValueError(
            f"sample_rate must be in (0, 1], got {sample_rate!r}; it is the expected batch size divided by N"
        )
    return float(sample_rate)


def check_noise_multiplier(noise_multiplier: float) -> float:
    """Return σ as a float; raise ``ValueError`` unless σ is finite and > 0."""
    if (
        not isinstance(noise_multiplier, (int, float))
        or not math.isfinite(noise_multiplier)
        or noise_multiplier <= 0.0
    ):
        raise ValueError(
            f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}; "
            "σ = 0 is not private (use calibrate_noise to choose σ)"
        )
    return float(noise_multiplier)


def check_steps(steps: int) -> int:
    """Return the number of steps as an int; raise ``ValueError`` unless it is a whole number ≥ 0."""
    if isinstance(steps, bool) or not isinstance(steps, (int, float)) or steps < 0 or int(steps) != steps:
        raise ValueError(f"steps must be a whole number >= 0, got {steps!r}")
    return int(steps)


def check_target_epsilon(target_epsilon: float) -> float:
    """Return the target ε as a float; raise ``ValueError`` unless it is finite and > 0."""
    if (
        not isinstance(target_epsilon, (int, float))
        or not math.isfinite(target_epsilon)
        or target_epsilon <= 0.0
    ):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    return float(target_epsilon)
