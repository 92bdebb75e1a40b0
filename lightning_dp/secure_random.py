"""Randomness the guarantee depends on, from the OS's CSPRNG: secret seeds, and the uniforms and Gaussians of secure
mode (docs/secure_mode.md). The one low room every sampler and noise source draws from."""

from __future__ import annotations

import math
from os import urandom
from typing import Callable

from numpy import float64, frombuffer, uint64
import torch
from torch import Tensor

from lightning_dp.bound_torch import TB, VF
from lightning_dp.sealed_noise import seal


def secure_seed() -> int:
    """A 63-bit seed from the operating system's entropy pool."""
    return int.from_bytes(urandom(8), "little") >> 1


SUMMED_DRAWS = 4
"""2n of Holohan & Braghin §5.1 (n = 2, as Opacus): Gaussians summed per coordinate."""


def secure_uniform(count: int) -> Tensor:
    """``count`` float64 uniforms in [0, 1), 53 bits each from ``os.urandom``."""
    if count <= 0:
        return VF.zeros(0, dtype=torch.float64)
    bits = frombuffer(urandom(8 * count), dtype=uint64) >> uint64(11)
    return VF.from_numpy(bits.astype(float64) * 2.0 ** -53)


def secure_standard_normal(count: int) -> Tensor:
    """``count`` float64 N(0, 1) samples: Box–Muller on :func:`secure_uniform` (1 − u ∈ (0, 1] for the log)."""
    pairs = (count + 1) // 2
    u = TB.view(secure_uniform(2 * pairs), 2, pairs)
    radius = VF.sqrt(VF.mul(VF.log1p(VF.neg(VF.select(u, 0, 0))), -2.0))
    angle = VF.mul(VF.select(u, 0, 1), 2.0 * math.pi)
    return VF.narrow(VF.cat([VF.mul(radius, VF.cos(angle)), VF.mul(radius, VF.sin(angle))]), 0, 0, count)


def secure_gaussian(count: int, normal: Callable[[int], Tensor] = secure_standard_normal) -> Tensor:
    """``count`` float64 N(0, 1) samples, each the sum of :data:`SUMMED_DRAWS` secure draws / √SUMMED_DRAWS
    (Holohan & Braghin 2021, §5.1); ``normal``: the source of the draws (:func:`secure_standard_normal`)."""
    draws = TB.view(normal(SUMMED_DRAWS * count), SUMMED_DRAWS, count)
    return VF.div(VF.sum(draws, 0), math.sqrt(SUMMED_DRAWS))


seal(__name__)
