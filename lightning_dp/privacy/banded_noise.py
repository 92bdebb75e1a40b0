"""Correlated noise: the banded-Toeplitz matrix-factorisation mechanism (DP-MF / BandMF), streamed.

docs/algorithms.md §7 (design-principles §2.1, §4.5). With a b-banded lower-triangular Toeplitz
strategy C (coefficients c_0..c_{b−1}, see :mod:`lightning_dp.accounting.banded_coefficients`)
the noise added to the clipped sum of step t is row t of C⁻¹ Z, computed one step at a time
from the last b − 1 outputs:

    w_t = ( z_t − Σ_{j=1}^{b−1} c_j w_{t−j} ) / c_0        z_t ~ N(0, I_d) fresh
    noise_t = σ · sens · C_clip · w_t                      sens = ‖c‖₂ (max column norm of C)

**Where sens goes.** :meth:`BandedToeplitzNoise.sample` returns u_t = sens · w_t, and the
privatizer multiplies it by σ·C_clip exactly as it does for independent noise. Equivalently
u_t is the recursion run with the column-normalised coefficients ĉ = c / ‖c‖₂ (that is what
the code does): the strategy Ĉ has columns of norm ≤ 1. Then the released gradients are

    ĝ_{1..T} = X + σ C_clip Ĉ⁻¹ Z = Ĉ⁻¹ ( Ĉ X + σ C_clip Z ),

a post-processing of the Gaussian mechanism on Ĉ X. One participation of an example at step
s changes Ĉ X by at most C_clip · ‖Ĉ e_s‖₂ ≤ C_clip, so each participation is a Gaussian
mechanism with noise multiplier σ; under b-min-separated participation the participations
touch disjoint rows of Ĉ and the privacy is that of ⌈T/b⌉ sampled Gaussian steps
(:mod:`lightning_dp.accounting.banded`). With b = 1 (c = [1]) this is independent Gaussian
noise, draw for draw.

**Memory**: (b − 1) · d extra numbers (b − 1 past outputs per parameter tensor, d = number of
parameters), in the gradients' dtype (float32 for half/bfloat16 gradients). Time: b − 1
axpy's per step. The recursion is stable for the supported coefficients
(:func:`~lightning_dp.accounting.banded_coefficients.is_stable`).

**Variance**: the noise of step t (0-based) has per-coordinate variance (σ C_clip)² · Φ-factor
with :meth:`BandedToeplitzNoise.phi_factor` (t) = sens² · Σ_j (C⁻¹)_{t,j}², so the Adam bias of
§7 is Φ_t = (σ C_clip / B)² · phi_factor(t). It starts at sens² (≥ 1) and grows with t to its limit
sens² · Σ_k r_k² (r the first column of C⁻¹): each step carries *more* noise than independent
noise with the same σ; the gain is that consecutive noises cancel in sums over steps.

**Checkpoints**: :meth:`~BandedToeplitzNoise.state_dict` carries the b − 1 past outputs and the
step count so a resumed run continues the same correlated stream. It never carries the RNG
state (replayed draws would cancel the noise, see :class:`GaussianNoise`). The history *is*
secret noise: a checkpoint with it must be kept as private as the training data (publish
weights, not full checkpoints).
"""

from __future__ import annotations

from typing import Any, ContextManager, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_dp.accounting.banded_coefficients import (
    check_bands,
    check_coefficients,
    column_norm,
    fichtenberger_coefficients,
    inverse_coefficients,
)
from lightning_dp.bound_torch import TB, VF
from lightning_dp.privacy.noise import GaussianNoise, NoiseMechanism
from lightning_dp.performance.noise_prefetch import Prefetch
from lightning_dp.sealed_noise import seal

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class BandedToeplitzNoise(NoiseMechanism):
    """Streamed b-banded Toeplitz DP-MF noise (docs/algorithms.md §7); returns sens · C⁻¹ z one row per step.

    Args:
        bands: b ≥ 1, the number of bands of the strategy C (b = 1: independent noise).
        coefficients: c_0..c_{b−1}; default the Fichtenberger coefficients binom(2j, j)/4^j
            (:func:`~lightning_dp.accounting.banded_coefficients.fichtenberger_coefficients`).
            Any scale: the mechanism normalises by ‖c‖₂.
        seed: seed of the fresh Gaussian draws z_t (as in :class:`GaussianNoise`; ``None``,
            the default and the only safe choice in production, draws it from the OS).
        source: the unit-noise source of z_t (default ``GaussianNoise(seed, prefetch=prefetch)``); for tests.
        prefetch: the default source draws z_{t+1} while step t runs (:mod:`~lightning_dp.performance.noise_prefetch`);
            the recursion itself stays at the release (it needs w_t).

    Call :meth:`sample` exactly once per logical step, always with the same list of tensors
    (the same shapes in the same order), and pair it with a b-min-separated sampler
    (:class:`~lightning_dp.privacy.min_sep_sampling.MinSepPoissonBatchSampler`).

    Example:
        >>> noise = BandedToeplitzNoise(bands=4, seed=0)
        >>> u = noise.sample([torch.zeros(3)])  # the privatizer adds σ·C·u
        >>> round(noise.phi_factor(0), 4)  # variance of step 0 relative to independent noise
        1.4883
    """

    def __init__(
        self,
        bands: int,
        coefficients: Optional[Sequence[float]] = None,
        seed: Optional[int] = None,
        source: Optional[NoiseMechanism] = None,
        prefetch: Prefetch = "auto",
    ) -> None:
        bands = check_bands(bands)
        c = check_coefficients(fichtenberger_coefficients(bands) if coefficients is None else coefficients)
        if c.size != bands:
            raise ValueError(f"got {c.size} coefficients for bands={bands}; pass exactly b coefficients c_0..c_(b-1)")
        if source is not None and seed is not None:
            raise ValueError("give either seed or source, not both (the seed belongs to the source)")
        self.bands = bands
        self.coefficients = c
        self.sensitivity = column_norm(c)
        self._normalised = c / self.sensitivity
        self._source = source if source is not None else GaussianNoise(seed, prefetch=prefetch)
        self._rings: list[_Ring] = []
        self._loaded: Optional[list[list[Tensor]]] = None  # history from a checkpoint, placed at the next sample
        self._weights: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._steps = 0
        self._phi_cumsum = np.zeros(0)

    @property
    def seeded(self) -> bool:
        """The fresh draws' source follows a given seed or generator."""
        return self._source.seeded

    @property
    def steps(self) -> int:
        """Number of rows streamed so far (calls to :meth:`sample`)."""
        return self._steps

    @property
    def memory_numel(self) -> int:
        """Numbers held for the history: (b − 1) · d once streaming (0 for b = 1)."""
        return sum(ring.buffer.numel() for ring in self._rings)

    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        """u_t = sens · w_t for the next step, one tensor per entry of ``like`` (shape, dtype, device)."""
        like = list(like)
        fresh = self._source.sample(like)
        if self.bands == 1:  # c = [c_0] normalises to [1]: the fresh draws themselves
            self._steps += 1
            return fresh
        self._prepare(like)
        out = [TB.to(TB.view(self._row(ring, z), ref.shape), ref.dtype)
               for ring, ref, z in zip(self._rings, like, fresh)]
        self._steps += 1
        return out

    def step(self) -> ContextManager[None]:
        """One release: the source's (its z_t may have been drawn during the previous step)."""
        return self._source.step()

    def discard_prefetched(self) -> None:
        """Drop the source's draws made ahead."""
        self._source.discard_prefetched()

    def close(self) -> None:
        """Join the source's worker."""
        self._source.close()

    def advance(self) -> None:
        """Count a step without drawing noise: for data-parallel ranks that do not add the noise.

        Keeps :meth:`variance_factor` (hence Φ_t and the optimizer state) equal on every rank.
        ``RuntimeError`` on a mechanism that streams noise (it would desynchronise the history).
        """
        if self._rings:
            raise RuntimeError("advance() is for ranks that never sample; this mechanism holds a noise history")
        self._steps += 1

    def rounds_at(self, step: int) -> int:
        """1 on the first step of each cycle of b steps, else 0 (Choquette-Choo et al. 2023, Thm. 5:
        :func:`~lightning_dp.accounting.banded.rounds_charged_at`)."""
        from lightning_dp.accounting.banded import rounds_charged_at  # accounting on first use

        return rounds_charged_at(step, self.bands)

    def _row(self, ring: "_Ring", z: Tensor) -> Tensor:
        """(z − Σ_j ĉ_j u_{t−j}) / ĉ_0 as one matrix-vector product over the ring buffer."""
        row = self._steps % (self.bands - 1)
        weights = VF.select(self._ring_weights(ring.buffer.device, ring.buffer.dtype), 0, row)
        u = VF.sub(TB.to(TB.reshape(z, -1), ring.buffer.dtype), VF.matmul(weights, ring.buffer))
        TB.div_(u, float(self._normalised[0]))
        TB.copy_(VF.select(ring.buffer, 0, row), u)
        return u

    def _ring_weights(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Row p: the weights of the buffer rows when t ≡ p (mod b − 1).

        Output t − j sits in row (t − j) mod (b − 1) and gets weight ĉ_j.
        """
        key = (device, dtype)
        if key not in self._weights:
            depth = self.bands - 1
            table = np.zeros((depth, depth))
            for p in range(depth):
                for j in range(1, self.bands):
                    table[p, (p - j) % depth] = self._normalised[j]
            self._weights[key] = torch.as_tensor(table, dtype=dtype, device=device)
        return self._weights[key]

    def _prepare(self, like: list[Tensor]) -> None:
        if not self._rings:
            self._rings = [_Ring(ref, self.bands - 1) for ref in like]
            if self._loaded is not None:
                self._place_loaded(self._loaded)
                self._loaded = None
            return
        if len(like) != len(self._rings):
            raise ValueError(
                f"BandedToeplitzNoise streams noise for {len(self._rings)} tensors but got {len(like)}: call sample() "
                "once per step with the same parameter list (independent moments / a changed parameter set "
                "are not supported with banded noise)"
            )
        for slot, (ref, ring) in enumerate(zip(like, self._rings)):
            if ring.shape != ref.shape:
                raise ValueError(f"tensor {slot} changed shape from {tuple(ring.shape)} to {tuple(ref.shape)}")

    def _place_loaded(self, history: list[list[Tensor]]) -> None:
        if len(history) != len(self._rings):
            raise ValueError(
                f"the checkpoint holds noise history for {len(history)} tensors, the model has {len(self._rings)}"
            )
        depth = self.bands - 1
        for ring, recent in zip(self._rings, history):
            for back, past in enumerate(recent, start=1):  # most recent first: output of step steps − back
                if past.shape != ring.shape:
                    raise ValueError(
                        f"checkpoint noise history has shape {tuple(past.shape)}, expected {tuple(ring.shape)}"
                    )
                ring.buffer[(self._steps - back) % depth] = past.reshape(-1).to(ring.buffer)

    def phi_factor(self, step: int) -> float:
        """sens² · Σ_j (C⁻¹)_{step,j}²: the noise variance of ``step`` (0-based) per unit (σ C_clip)².

        docs/algorithms.md §7: Φ_t = (σ · C_clip / B)² · phi_factor(t). Equal to 1 for every step
        when b = 1; for b > 1 it starts at sens² = ‖c‖² and increases towards its limit.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a whole number >= 0, got {step!r}")
        if step >= self._phi_cumsum.size:
            n = max(int(step) + 1, 2 * self._phi_cumsum.size, 64)
            r = inverse_coefficients(self.coefficients, n)
            self._phi_cumsum = self.sensitivity**2 * np.cumsum(r * r)
        return float(self._phi_cumsum[step])

    def variance_factor(self) -> float:
        """phi_factor of the last sampled step (1.0 before the first): what the privatizer's
        ``Release.noise_std`` must be multiplied by, squared (σ C_clip / B · √factor)."""
        return self.phi_factor(self._steps - 1) if self._steps else 1.0

    def state_dict(self) -> dict[str, Any]:
        """Coefficients, step count, the last b − 1 outputs per tensor (CPU, most recent first); never the RNG."""
        if self._loaded is not None:
            history = [[t.clone() for t in recent] for recent in self._loaded]
        else:
            history = [ring.recent(self._steps) for ring in self._rings]
        return {
            "kind": "banded_toeplitz",
            "coefficients": [float(x) for x in self.coefficients],
            "steps": self._steps,
            "history": history,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; an empty dict starts a fresh stream (safe, see below).

        A fresh stream after k rows is the block-diagonal strategy diag(C_k, C), still b-banded
        with column norms ≤ ‖c‖, so restarting never weakens privacy — only utility.
        Coefficients that differ from this mechanism's raise ``ValueError``.
        """
        self._rings = []
        self._source.discard_prefetched()  # a restored stream continues with fresh draws only
        if not state:
            self._steps, self._loaded = 0, None
            return
        saved = np.asarray(state["coefficients"], dtype=np.float64)
        if saved.shape != self.coefficients.shape or not np.allclose(saved, self.coefficients, rtol=1e-12, atol=0):
            raise ValueError(
                f"checkpoint noise state was written with coefficients {saved.tolist()}, this mechanism uses "
                f"{self.coefficients.tolist()}: resume with the same bands/coefficients"
            )
        self._steps = int(state["steps"])
        self._loaded = [[t.detach().clone() for t in recent] for recent in state["history"]]


class _Ring:
    """The last b − 1 outputs for one tensor: a (b − 1, numel) buffer, output t in row t mod (b − 1)."""

    def __init__(self, ref: Tensor, depth: int) -> None:
        self.shape = ref.shape
        self.buffer = VF.zeros((depth, TB.numel(ref)), dtype=_work_dtype(ref.dtype), device=ref.device)

    def recent(self, steps: int) -> list[Tensor]:
        """The stored outputs, most recent first, reshaped and copied to the CPU."""
        depth = self.buffer.shape[0]
        rows = [(steps - back) % depth for back in range(1, min(steps, depth) + 1)]
        return [self.buffer[row].view(self.shape).cpu().clone() for row in rows]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


seal(__name__)
