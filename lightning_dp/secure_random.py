"""Randomness the guarantee depends on, from the OS's CSPRNG: secret seeds, and the uniforms and Gaussians of secure
mode (docs/secure_mode.md). The one low room every sampler and noise source draws from."""

from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np
import torch
from torch import Tensor


def secure_seed() -> int:
    """A 63-bit seed from the operating system's entropy pool."""
    return int.from_bytes(os.urandom(8), "little") >> 1


SUMMED_DRAWS = 4
"""2n of Holohan & Braghin §5.1 (n = 2, as Opacus): Gaussians summed per coordinate."""


def secure_uniform(count: int) -> Tensor:
    """``count`` float64 uniforms in [0, 1), 53 bits each from ``os.urandom``."""
    if count <= 0:
        return torch.zeros(0, dtype=torch.float64)
    bits = np.frombuffer(os.urandom(8 * count), dtype=np.uint64) >> np.uint64(11)
    return torch.from_numpy(bits.astype(np.float64) * 2.0 ** -53)


def secure_standard_normal(count: int) -> Tensor:
    """``count`` float64 N(0, 1) samples: Box–Muller on :func:`secure_uniform` (1 − u ∈ (0, 1] for the log)."""
    pairs = (count + 1) // 2
    u = secure_uniform(2 * pairs).view(2, pairs)
    radius = torch.sqrt(-2.0 * torch.log1p(-u[0]))
    angle = 2.0 * math.pi * u[1]
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:count]


def secure_gaussian(count: int, normal: Callable[[int], Tensor] = secure_standard_normal) -> Tensor:
    """``count`` float64 N(0, 1) samples, each the sum of :data:`SUMMED_DRAWS` secure draws / √SUMMED_DRAWS
    (Holohan & Braghin 2021, §5.1); ``normal``: the source of the draws (:func:`secure_standard_normal`)."""
    draws = normal(SUMMED_DRAWS * count).view(SUMMED_DRAWS, count)
    return draws.sum(0) / math.sqrt(SUMMED_DRAWS)
