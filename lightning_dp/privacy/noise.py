"""Noise mechanisms: where the one noise draw per logical step comes from.

A mechanism returns *unit* noise shaped like the gradients; the privatizer scales it
by σ·C. Today's mechanism draws independent standard Gaussians (docs/algorithms.md, "The
mechanism": z_t ~ N(0, I_d)); correlated-noise mechanisms (DP-MF, §7) implement the
same interface and keep their history in :meth:`state_dict`.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.privacy.seeding import secure_seed


_MIN_CHUNK = 1 << 16  # smallest scratch chunk of GaussianNoise.add_noise_ (256 KiB in float32)


class NoiseMechanism(ABC):
    """Source of the unit noise z_t added once per step."""

    @abstractmethod
    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        """Unit-variance noise tensors shaped like ``like`` for the current step."""

    def add_noise_(self, tensors: Sequence[Tensor], std: float, scale_by: float = 1.0) -> None:
        """t ← scale_by · t + std · z for every t, in place: z is this step's unit noise (:meth:`sample`).

        Mechanisms that can draw into a small scratch buffer override this (no full-size noise tensor)."""
        for t, z in zip(tensors, self.sample(tensors)):
            if scale_by != 1.0:
                t.mul_(scale_by)
            t.add_(z, alpha=std)

    def advance(self) -> None:
        """Count a step on a rank that does not add noise (keeps step-dependent state in sync)."""

    def rounds_at(self, step: int) -> int:
        """Sampled-Gaussian rounds the ledger is charged for 0-based ``step`` (1: independent noise)."""
        return 1

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


@dataclass
class _Bucket:
    """Pieces of tensors (flat, each ≤ the scratch) waiting for one shared draw of
    N(0, std²) into ``scratch`` (:meth:`GaussianNoise.add_noise_`): a full-size piece is drawn
    alone, small ones together."""

    scratch: Tensor
    generator: torch.Generator
    std: float
    scale_by: float
    pieces: list[Tensor] = field(default_factory=list)
    size: int = 0

    def add(self, piece: Tensor) -> None:
        """Queue ``piece``; first draw for the queued ones if it would not fit beside them."""
        if self.size + piece.numel() > self.scratch.numel():
            self.flush()
        self.pieces.append(piece)
        self.size += piece.numel()

    def flush(self) -> None:
        """piece ← scale_by · piece + N(0, std²) for every queued piece, from one draw."""
        if not self.pieces:
            return
        z = self.scratch[: self.size].normal_(0.0, self.std, generator=self.generator)
        if len(self.pieces) == 1:
            torch.add(z, self.pieces[0], alpha=self.scale_by, out=self.pieces[0])  # one fused pass
        else:
            if self.scale_by != 1.0:
                torch._foreach_mul_(self.pieces, self.scale_by)
            torch._foreach_add_(self.pieces, z.split([p.numel() for p in self.pieces]))
        self.pieces, self.size = [], 0


class GaussianNoise(NoiseMechanism):
    """Independent N(0, I) draws from a private generator per device.

    Args:
        seed: seed for the generators; ``None`` (the default, and the only safe choice
            in production) draws a fresh seed from the OS. A fixed seed is for tests.
        generator: draw from this generator on its device instead (reproducible research runs
            that share one generator for sampling and noise, e.g. ``VirtualWorkersSignSGD``);
            not with ``seed``.
    """

    def __init__(self, seed: Optional[int] = None, generator: Optional[torch.Generator] = None) -> None:
        if seed is not None and generator is not None:
            raise ValueError("give seed or generator, not both")
        self._seed = seed
        self._shared_generator = generator is not None
        self._generators: dict[torch.device, torch.Generator] = {}
        if generator is not None:
            self._generators[torch.device(generator.device)] = generator

    def for_rank(self, rank: int) -> "GaussianNoise":
        """A stream independent of every other rank's, for process ``rank`` of a sharded release (each rank
        noises the coordinates it owns: :mod:`~lightning_dp.privacy.sharded_privatizer`): a fresh OS seed,
        or for a fixed (test) seed one derived from (seed, rank). Never one seed on two ranks."""
        if self._shared_generator:
            raise ValueError("a GaussianNoise drawing from a given generator cannot be split into independent "
                             "per-rank streams: give seed= (tests) or nothing (production)")
        if self._seed is None:
            return GaussianNoise()
        digest = hashlib.sha256(f"lightning_dp.GaussianNoise/{self._seed}/rank{rank}".encode()).digest()
        return GaussianNoise(seed=int.from_bytes(digest[:8], "little") >> 1)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            seed = secure_seed() if self._seed is None else self._seed
            self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[device]

    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        """One standard-normal tensor per entry of ``like`` (same shape, dtype, device)."""
        return self._draw(like, 1.0)

    def add_noise_(self, tensors: Sequence[Tensor], std: float, scale_by: float = 1.0) -> None:
        """t ← scale_by · t + std · z in place, z ~ N(0, I) from this mechanism's private generator.

        Tensors are cut into pieces of at most the scratch size, min(d, max(2¹⁶, d/8)) numbers
        for d coordinates, so no noise tensor as large as the model is ever allocated. A
        full-size piece gets its own draw (``normal_(0, std)``: the scaling fused into the draw)
        added in one pass; smaller pieces (small tensors, tails) share one draw and two
        multi-tensor updates (few kernel launches for a model of many small tensors). Every
        coordinate gets its own fresh draw. A subclass that overrides :meth:`sample` gets
        the generic path (its samples, scaled).
        """
        if not std > 0:
            raise ValueError(f"std must be > 0, got {std!r}")
        if type(self).sample is not GaussianNoise.sample:
            super().add_noise_(tensors, std, scale_by)
            return
        total = sum(t.numel() for t in tensors)
        if total == 0:
            return
        step = min(max(_MIN_CHUNK, -(-total // 8)), total)
        buckets: dict[tuple[torch.device, torch.dtype], _Bucket] = {}
        for t in tensors:
            if not t.is_contiguous():  # rare (engines return contiguous sums): one full-size draw
                z = torch.empty(t.shape, device=t.device, dtype=t.dtype)
                torch.add(z.normal_(0.0, std, generator=self._generator(t.device)), t, alpha=scale_by, out=t)
                continue
            key = (t.device, t.dtype)
            if key not in buckets:
                scratch = torch.empty(step, device=t.device, dtype=t.dtype)
                buckets[key] = _Bucket(scratch, self._generator(t.device), std, scale_by)
            flat = t.view(-1)
            for start in range(0, flat.numel(), step):
                buckets[key].add(flat[start : start + step])
        for bucket in buckets.values():
            bucket.flush()

    def _draw(self, like: Sequence[Tensor], std: float) -> list[Tensor]:
        out: list[Optional[Tensor]] = [None] * len(like)
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(like):
            groups.setdefault((t.device, t.dtype), []).append(i)
        for (device, dtype), idx in groups.items():
            sizes = [like[i].numel() for i in idx]
            flat = torch.empty(sum(sizes), device=device, dtype=dtype)
            flat.normal_(0.0, std, generator=self._generator(device))
            for i, chunk in zip(idx, flat.split(sizes)):
                out[i] = chunk.view(like[i].shape)
        return out  # type: ignore[return-value]
