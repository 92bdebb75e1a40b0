"""Noise mechanisms: where the one noise draw per logical step comes from.

A mechanism returns *unit* noise shaped like the gradients; the privatizer scales it
by σ·C. Today's mechanism draws independent standard Gaussians (docs/algorithms.md, "The
mechanism": z_t ~ N(0, I_d)); correlated-noise mechanisms (DP-MF, §7) implement the
same interface and keep their history in :meth:`state_dict`.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.bound_torch import TB, VF, Generator
from lightning_dp.validators.noise_added import checked_noise_methods
from lightning_dp.sealed_noise import seal
from lightning_dp.secure_random import secure_seed
from lightning_dp.performance.noise_prefetch import DrawsAhead, Prefetch


_MIN_CHUNK = 1 << 16  # smallest scratch chunk of GaussianNoise.add_noise_ (256 KiB in float32)


class NoiseMechanism(ABC):
    """Source of the unit noise z_t added once per step."""
    __init_subclass__ = checked_noise_methods("sample", "add_noise_", "_draw_key")  # add_noise_ checked; not a user's
    # torch mode's to answer (validators/noise_added.py, mode_free.py)

    @abstractmethod
    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        """Unit-variance noise tensors shaped like ``like`` for the current step."""

    def add_noise_(self, tensors: Sequence[Tensor], std: float, scale_by: float = 1.0) -> None:
        """t ← scale_by · t + std · z for every t, in place: z is this step's unit noise (:meth:`sample`).

        Mechanisms that can draw into a small scratch buffer override this (no full-size noise tensor)."""
        for t, z in zip(tensors, self.sample(tensors)):
            if scale_by != 1.0:
                TB.mul_(t, scale_by)
            TB.add_(t, z, alpha=std)

    def advance(self) -> None:
        """Count a step on a rank that does not add noise (keeps step-dependent state in sync)."""

    @property
    def seeded(self) -> bool:
        """Whether the draws follow a seed or a generator the caller gave (reproducible by whoever knows it: the
        guarantee then holds only while it stays secret, :class:`~lightning_dp.errors.KnownSeedWarning`)."""
        return False

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

    @contextmanager
    def step(self) -> Iterator[None]:
        """One release's noise calls (the privatizer's). A mechanism that draws ahead
        (:mod:`~lightning_dp.performance.noise_prefetch`) hands the calls inside the draws it made during the
        previous step, draws the same calls ahead for the next on a normal exit, and drops every draw held on an
        exception. This one draws at every call."""
        yield

    def discard_prefetched(self) -> None:
        """Drop the noise drawn ahead, if any (a step that will not be released: it is never reused)."""

    def close(self) -> None:
        """Stop drawing ahead and join the worker, if any (detach, teardown)."""


@dataclass(frozen=True)
class _Draw:
    """One draw of ``size`` numbers on ``device`` in ``dtype`` (a flat N(0, std²) tensor)."""

    device: torch.device
    dtype: torch.dtype
    size: int


Plan = list[tuple[_Draw, list[Tensor]]]
"""The draws of one :meth:`GaussianNoise.add_noise_` call, in order, each with the pieces of tensors it noises."""


def noise_plan(tensors: Sequence[Tensor]) -> Plan:
    """How :meth:`GaussianNoise.add_noise_` cuts ``tensors`` into draws (see there), in the order they are drawn.

    Contiguous tensors are cut into flat pieces of at most ``step`` = min(d, max(2¹⁶, ⌈d/8⌉)) numbers (d the total);
    pieces of one (device, dtype) are gathered into one draw until the next would not fit beside them (a full-size
    piece is drawn alone); the open gatherings are drawn at the end, in the order their (device, dtype) first
    appeared. A non-contiguous tensor (rare: engines return contiguous sums) gets one full-size draw of its own
    where it stands."""
    total = sum(TB.numel(t) for t in tensors)
    if total == 0:
        return []
    step = min(max(_MIN_CHUNK, -(-total // 8)), total)
    plan: Plan = []
    open_: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}

    def close(key: tuple[torch.device, torch.dtype]) -> None:
        if open_[key]:
            plan.append((_Draw(key[0], key[1], sizes[key]), open_[key]))
            open_[key], sizes[key] = [], 0

    for t in tensors:
        if not TB.is_contiguous(t):
            plan.append((_Draw(t.device, t.dtype, TB.numel(t)), [t]))
            continue
        key = (t.device, t.dtype)
        open_.setdefault(key, [])
        sizes.setdefault(key, 0)
        flat, numel = TB.view(t, -1), TB.numel(t)
        for start in range(0, numel, step):
            size = min(step, numel - start)
            piece = flat if numel <= step else VF.narrow(flat, 0, start, size)  # (no slice for a tensor in one piece)
            if sizes[key] + size > step:
                close(key)
            open_[key].append(piece)
            sizes[key] += size
    for key in list(open_):
        close(key)
    return plan


def _apply(z: Tensor, pieces: list[Tensor], scale_by: float) -> None:
    """piece ← scale_by · piece + z for the pieces of one draw z (already scaled by std): one fused pass for a
    single piece, two multi-tensor updates for several."""
    if len(pieces) == 1:
        t = pieces[0]
        VF.add(TB.view(z, t.shape), t, alpha=scale_by, out=t)
        return
    if scale_by != 1.0:
        VF._foreach_mul_(pieces, scale_by)
    VF._foreach_add_(pieces, VF.split_with_sizes(z, [TB.numel(p) for p in pieces]))


class GaussianNoise(DrawsAhead, NoiseMechanism):
    """Independent N(0, I) draws from a private generator per device.

    Args:
        seed: seed for the generators; ``None`` (the default, and the only safe choice
            in production) draws a fresh seed from the OS. A fixed seed is for tests.
        generator: draw from this generator on its device instead (reproducible research runs
            that share one generator for sampling and noise, e.g. ``VirtualWorkersSignSGD``);
            not with ``seed``. Such a mechanism never draws ahead (the generator is not its alone).
        prefetch: draw the next release's noise while the current step runs
            (:mod:`~lightning_dp.performance.noise_prefetch`; a worker thread on CPU, a side stream on CUDA):
            ``"auto"`` (default: on CPU only while a CPU is free for the worker), ``True``, ``False``. The same
            draws from the same generators in the same order: a seeded stream is the same sequence either way.
            Costs d numbers held between releases (d = the number of noised coordinates).
    """

    def __init__(self, seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 prefetch: Prefetch = "auto") -> None:
        if seed is not None and generator is not None:
            raise ValueError("give seed or generator, not both")
        self._seed = seed
        self._shared_generator = generator is not None
        self._generators: dict[torch.device, torch.Generator] = {}
        if generator is not None:
            self._generators[torch.device(generator.device)] = generator
        self._init_ahead(prefetch if generator is None else False)

    @property
    def seeded(self) -> bool:
        """A ``seed`` or a ``generator`` was given."""
        return self._seed is not None or self._shared_generator

    def for_rank(self, rank: int) -> "GaussianNoise":
        """A stream independent of every other rank's, for process ``rank`` of a sharded release (each rank
        noises the coordinates it owns: :mod:`~lightning_dp.sharding.privatizer`): a fresh OS seed,
        or for a fixed (test) seed one derived from (seed, rank). Never one seed on two ranks."""
        if self._shared_generator:
            raise ValueError("a GaussianNoise drawing from a given generator cannot be split into independent "
                             "per-rank streams: give seed= (tests) or nothing (production)")
        if self._seed is None:
            return GaussianNoise(prefetch=self.prefetch)
        digest = hashlib.sha256(f"lightning_dp.GaussianNoise/{self._seed}/rank{rank}".encode()).digest()
        return GaussianNoise(seed=int.from_bytes(digest[:8], "little") >> 1, prefetch=self.prefetch)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            seed = secure_seed() if self._seed is None else self._seed
            self._generators[device] = Generator(device=device).manual_seed(seed)
        return self._generators[device]

    def _normal(self, draw: _Draw, std: float) -> Tensor:
        """One draw's N(0, std²) numbers, from its device's generator."""
        return TB.normal_(VF.empty(draw.size, device=draw.device, dtype=draw.dtype), 0.0, std,
                          generator=self._generator(draw.device))

    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        """One standard-normal tensor per entry of ``like`` (same shape, dtype, device)."""
        return self._draw(like, 1.0)

    def add_noise_(self, tensors: Sequence[Tensor], std: float, scale_by: float = 1.0) -> None:
        """t ← scale_by · t + std · z in place, z ~ N(0, I) from this mechanism's private generator.

        Tensors are cut into pieces of at most the scratch size, min(d, max(2¹⁶, d/8)) numbers
        for d coordinates (:func:`noise_plan`), so no noise tensor as large as the model is ever allocated
        when drawing at the call. A full-size piece gets its own draw (``normal_(0, std)``: the scaling fused
        into the draw) added in one pass; smaller pieces (small tensors, tails) share one draw and two
        multi-tensor updates (few kernel launches for a model of many small tensors). Every
        coordinate gets its own fresh draw. Inside :meth:`step` the draws may have been made ahead, during the
        previous step (the same draws, held until now: :mod:`~lightning_dp.performance.noise_prefetch`). A subclass
        that overrides :meth:`sample` gets the generic path (its samples, scaled).
        """
        if not std > 0:
            raise ValueError(f"std must be > 0, got {std!r}")
        if type(self).sample is not GaussianNoise.sample:
            super().add_noise_(tensors, std, scale_by)
            return
        plan = noise_plan(tensors)
        if not plan:
            return
        ahead = self._ahead(("add", float(std), tuple(draw for draw, _ in plan)))
        draws = iter(ahead) if ahead is not None else self._drawn_now(plan, float(std))
        for (_, pieces), z in zip(plan, draws):
            _apply(z, pieces, scale_by)

    def _drawn_now(self, plan: Plan, std: float) -> Iterator[Tensor]:
        """The plan's draws made now, one at a time into one scratch buffer per (device, dtype) (each used before
        the next is drawn over it); a draw larger than the scratch (a non-contiguous tensor) into its own tensor."""
        scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        largest = max(draw.size for draw, pieces in plan if TB.is_contiguous(pieces[0])) if any(
            TB.is_contiguous(pieces[0]) for _, pieces in plan) else 0
        for draw, pieces in plan:
            if TB.is_contiguous(pieces[0]):
                key = (draw.device, draw.dtype)
                if key not in scratch:
                    scratch[key] = VF.empty(largest, device=draw.device, dtype=draw.dtype)
                z = VF.narrow(scratch[key], 0, 0, draw.size)
            else:
                z = VF.empty(draw.size, device=draw.device, dtype=draw.dtype)
            yield TB.normal_(z, 0.0, std, generator=self._generator(draw.device))

    def _draw_key(self, key: Hashable) -> list[Tensor]:
        """The draws of one call key, made as the call makes them (:class:`~.noise_prefetch.DrawsAhead`)."""
        kind, std, draws = key  # type: ignore[misc]
        return [self._normal(d, std) for d in draws]

    def _numel(self, keys: Sequence[Hashable]) -> int:
        return sum(d.size for _, _, draws in keys for d in draws)  # type: ignore[misc]

    def _stream_device(self, keys: Sequence[Hashable]) -> Optional[torch.device]:
        devices = [d.device for _, _, draws in keys for d in draws]  # type: ignore[misc]
        return next((d for d in devices if d.type == "cuda"), None)

    def _draw(self, like: Sequence[Tensor], std: float) -> list[Tensor]:
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(like):
            groups.setdefault((t.device, t.dtype), []).append(i)
        plan = [(_Draw(device, dtype, sum(TB.numel(like[i]) for i in idx)), idx)
                for (device, dtype), idx in groups.items()]
        ahead = self._ahead(("sample", float(std), tuple(draw for draw, _ in plan)))
        if ahead is None:
            ahead = [self._normal(d, std) for d, _ in plan]
        out: list[Optional[Tensor]] = [None] * len(like)
        for (_, idx), flat in zip(plan, ahead):
            for i, chunk in zip(idx, VF.split_with_sizes(flat, [TB.numel(like[i]) for i in idx])):
                out[i] = TB.view(chunk, like[i].shape)
        return out  # type: ignore[return-value]


seal(__name__, tunable=("_MIN_CHUNK",))
