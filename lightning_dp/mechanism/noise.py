"""Noise mechanisms: where the one noise draw per logical step comes from.

A mechanism returns *unit* noise shaped like the gradients; the privatizer scales it
by σ·C. Today's mechanism draws independent standard Gaussians (ALGORITHMS.md, "The
mechanism": z_t ~ N(0, I_d)); correlated-noise mechanisms (DP-MF, §7) implement the
same interface and keep their history in :meth:`state_dict`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.mechanism.seeding import secure_seed


class NoiseMechanism(ABC):
    """Source of the unit noise z_t added once per step."""

    @abstractmethod
    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        """Unit-variance noise tensors shaped like ``like`` for the current step."""

    def advance(self) -> None:
        """Count a step on a rank that does not add noise (keeps step-dependent state in sync)."""

    def variance_factor(self) -> float:
        """Per-coordinate variance of the last step's unit noise (1 for independent noise).

        Correlated noise (§7) returns Σ_j (C⁻¹)²_{t,j}·sens²; the privatizer scales the
        release's ``noise_std`` by its square root, so Φ_t follows it.
        """
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (never the RNG: replayed noise would leak gradients)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


class GaussianNoise(NoiseMechanism):
    """Independent N(0, I) draws from a private generator per device.

    Args:
        seed: seed for the generators; ``None`` (the default, and the only safe choice
            in production) draws a fresh seed from the OS. A fixed seed is for tests.
    """

    def __init__(self, seed: Optional[int] = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            seed = secure_seed() if self._seed is None else self._seed
            self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[device]

    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        """One standard-normal tensor per entry of ``like`` (same shape, dtype, device)."""
        return [
            torch.randn(t.shape, generator=self._generator(t.device), device=t.device, dtype=t.dtype) for t in like
        ]
