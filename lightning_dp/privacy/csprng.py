"""Secure mode: noise and Poisson sampling from the operating system's CSPRNG.

torch's generators (Mersenne Twister on CPU, Philox on CUDA) are statistically sound but
predictable from their state, and a floating-point Gaussian is not the continuous one the
proofs assume: Mironov (2012, "On significance of the least significant bits for differential
privacy") showed that the low bits of floating-point Laplace samples reveal the unnoised value,
and Jin et al. (2021, arXiv 2112.05307) attacked Gaussian samplers, Opacus' among them, the
same way. ``DPStrategy(secure_mode=True)`` draws instead:

- **uniforms** from ``os.urandom`` (the kernel's CSPRNG): 53 random bits per double;
- **Gaussians** by the Box–Muller transform of those uniforms, in float64, then the mitigation of
  Holohan & Braghin (2021, "Secure random sampling in differential privacy", arXiv 2107.10138,
  §5.1) that Opacus' ``secure_mode`` also uses: each coordinate is the sum of 2n = 4 independent
  N(0, σ²) draws divided by √(2n) = 2. The variance stays σ²; an attacker who wants to invert
  the low bits must now search 2^{p(2n−1)} combinations (p = 53) instead of one sample's.

This is a mitigation, not a proof: the noise is still a sum of floating-point samples. Costs
(measured by ``benchmarks/secure_mode.py``) are in docs/secure_mode.md. Every draw is fresh; no state is
kept, so nothing can be checkpointed or replayed.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch
from torch import Tensor

from lightning_dp.bound_torch import TB, VF
from lightning_dp.privacy.noise import NoiseMechanism
from lightning_dp.sealed_noise import seal
import lightning_dp.secure_random as secure_random
from lightning_dp.secure_random import SUMMED_DRAWS, secure_standard_normal, secure_uniform  # noqa: F401  (re-exported)
from lightning_dp.performance.noise_prefetch import DrawsAhead, Prefetch

CHUNK = 1 << 16
"""Coordinates per secure draw in :meth:`SecureGaussianNoise.add_noise_` (≈ 10 MiB of float64 temporaries)."""


def secure_gaussian(count: int) -> Tensor:
    """:func:`lightning_dp.secure_random.secure_gaussian`, its draws from this module's
    :func:`secure_standard_normal` (the one the noise below uses)."""
    return secure_random.secure_gaussian(count, secure_standard_normal)


class SecureGaussianNoise(DrawsAhead, NoiseMechanism):
    """Independent N(0, I) noise from :func:`secure_gaussian` (drawn on the CPU in float64, then cast and
    moved to each tensor's device: on a GPU every step copies a model-sized tensor to the device).

    Args:
        prefetch: draw the next release's noise (on the CPU, cast to the tensors' dtype) in a worker thread while
            the current step runs (:mod:`~lightning_dp.performance.noise_prefetch`; ``"auto"``, the default: while a
            CPU is free for the worker); the same function draws it, so the same distribution. Costs d numbers held
            between releases.
    """

    def __init__(self, prefetch: Prefetch = "auto") -> None:
        self._init_ahead(prefetch)

    def add_noise_(self, tensors: Sequence[Tensor], std: float, scale_by: float = 1.0) -> None:
        """t ← scale_by · t + std · z in place, z from :func:`secure_gaussian`, :data:`CHUNK` coordinates at a
        time: the float64 temporaries (≈ 100 bytes per coordinate) never exceed one chunk's, and every
        coordinate gets its own fresh draw. Inside :meth:`step` the draws may have been made ahead, during the
        previous step (:mod:`~lightning_dp.performance.noise_prefetch`)."""
        if not std > 0:
            raise ValueError(f"std must be > 0, got {std!r}")
        pieces = _pieces(tensors)
        ahead = self._ahead(("add", tuple((p.dtype, TB.numel(p)) for p in pieces)))
        for piece, z in zip(pieces, ahead if ahead is not None else (_unit(p.dtype, TB.numel(p)) for p in pieces)):
            z = TB.to(TB.view(z, piece.shape), device=piece.device)
            if scale_by != 1.0:
                TB.mul_(piece, scale_by)
            TB.add_(piece, z, alpha=std)

    def for_rank(self, rank: int) -> "SecureGaussianNoise":
        """This mechanism: every draw reads ``os.urandom`` afresh, so the ranks' streams are independent."""
        return self

    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        """One standard-normal tensor per entry of ``like`` (same shape, dtype, device)."""
        sizes = [TB.numel(t) for t in like]
        ahead = self._ahead(("sample", tuple(sizes)))
        flat = ahead[0] if ahead is not None else secure_gaussian(sum(sizes))
        return [TB.to(TB.view(chunk, t.shape), device=t.device, dtype=t.dtype)
                for chunk, t in zip(VF.split_with_sizes(flat, sizes), like)]

    def _draw_key(self, key: Hashable) -> list[Tensor]:
        """The draws of one call key, on the CPU (:class:`~.noise_prefetch.DrawsAhead`)."""
        kind, shapes = key  # type: ignore[misc]
        if kind == "sample":
            return [secure_gaussian(sum(shapes))]
        return [_unit(dtype, size) for dtype, size in shapes]

    def _numel(self, keys: Sequence[Hashable]) -> int:
        return sum(sum(shapes) if kind == "sample" else sum(size for _, size in shapes)  # type: ignore[misc]
                   for kind, shapes in keys)  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        """Nothing: there is no generator state (and none may ever be saved)."""
        return {}


def _pieces(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The pieces :meth:`SecureGaussianNoise.add_noise_` draws for, in order: a non-contiguous tensor whole (rare:
    engines return contiguous sums), a contiguous one in flat chunks of :data:`CHUNK` coordinates."""
    out: list[Tensor] = []
    for t in tensors:
        if not TB.is_contiguous(t):
            out.append(t)
            continue
        flat, numel = TB.view(t, -1), TB.numel(t)
        out.extend(VF.narrow(flat, 0, start, min(CHUNK, numel - start)) for start in range(0, numel, CHUNK))
    return out


def _unit(dtype: torch.dtype, size: int) -> Tensor:
    """``size`` coordinates of :func:`secure_gaussian`, cast to ``dtype`` (on the CPU)."""
    return TB.to(secure_gaussian(size), dtype=dtype)


seal(__name__)
