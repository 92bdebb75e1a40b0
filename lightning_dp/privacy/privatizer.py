"""The mechanism of one logical step: clipped sums -> noise once -> / B -> p.grad.

docs/algorithms.md, "The mechanism":

    S_t = Σ_i clip_C(g_{t,i})            (the engine's ClippedBatch)
    ĝ_t = (S_t + σ C z_t) / B            (here; B the expected global batch)

with the two documented extensions the variants ask for through a
:class:`~lightning_dp.privacy.release.MechanismRequest`:

* scale-then-privatize (§4): the engine clipped s ⊙ g_i; the noisy mean is divided by s;
* independent moments (§3): a second statistic (Σ_i clip_C(g_i)² + σ₂ C² z₂) / B is
  released, and both releases use σ√2 so that together they cost one σ-step.

Under data parallelism ``reduce`` sums the tensors across ranks in place and only the
rank with ``adds_noise=True`` adds noise, before the reduction: noise enters the global
sum exactly once; a refused noise raises on every rank (:mod:`lightning_dp.release_reduce`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Protocol, Sequence

from torch import Tensor, nn

from lightning_dp.engine_api import ClippedBatch
from lightning_dp.privacy.noise import NoiseMechanism
from lightning_dp.privacy.release import MechanismRequest, Release
from lightning_dp.release_reduce import reduce_after_noise
from lightning_dp.sealed_noise import seal

Reduce = Callable[[list[Tensor]], None]


def validate_privacy_params(noise_multiplier: float, max_grad_norm: float) -> None:
    """Raise ``ValueError`` unless σ > 0 and C > 0 (both finite)."""
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(
            f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}. σ = 0 is not private; "
            "for a non-private baseline train without DPStrategy (or use AdamVariant('noiseless'))."
        )
    if not (isinstance(max_grad_norm, (int, float)) and math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm (the clipping norm C) must be a finite number > 0, got {max_grad_norm!r}.")


class StepPrivatizer(Protocol):
    """What the private step asks of a release rule: the noised mean (:class:`Privatizer`) and the
    DP-SignSGD vote (:class:`~lightning_dp.sign_sgd.privatizer.SignVotePrivatizer`) both fit."""

    noise: NoiseMechanism

    def privatize(
        self,
        batch: ClippedBatch,
        params: Sequence[nn.Parameter],
        request: MechanismRequest,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
    ) -> Release:
        """Write the step's private gradient into ``p.grad`` and describe it."""
        ...


class Privatizer:
    """Turns per-rank clipped sums into the private gradient, adding noise once.

    Args:
        noise: the noise mechanism (unit noise z_t).
        reduce: in-place cross-rank sum of a list of tensors (``None`` for one process).
        adds_noise: whether this rank adds the noise (exactly one rank must).
    """

    def __init__(self, noise: NoiseMechanism, reduce: Optional[Reduce] = None, adds_noise: bool = True) -> None:
        self.noise = noise
        self.reduce = reduce
        self.adds_noise = adds_noise

    def privatize(
        self,
        batch: ClippedBatch,
        params: Sequence[nn.Parameter],
        request: MechanismRequest,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
    ) -> Release:
        """Write ĝ_t into ``p.grad`` for every parameter and describe the release.

        The clipped sums of ``batch`` are noised and divided in place and become ``p.grad``
        (read anything else from them before calling this)."""
        sigma = noise_multiplier * math.sqrt(request.noise_split)
        if request.second_moment and batch.square_sums is None:
            raise RuntimeError("the engine returned no square sums although the variant asked for them")
        sums = [batch.sums[p] for p in params]
        squares = [batch.square_sums[p] for p in params] if request.second_moment else []
        clean = [s.clone() for s in sums] if request.clean_mean else []
        if self.adds_noise and self.reduce is None:
            # One pass: S ← S/B + (σC/B)·z (the same N(0, (σC/B)²) per coordinate as (S + σCz)/B).
            with self.noise.step():  # this release's draws (made during the step when drawn ahead)
                self.noise.add_noise_(sums, sigma * max_grad_norm / expected_batch_size, 1.0 / expected_batch_size)
                self._add_noise(squares, sigma * max_grad_norm**2)
            grads = sums
        else:
            def noise() -> None:  # this rank's noise, or its stream advanced
                if self.adds_noise:
                    with self.noise.step():
                        self._add_noise(sums, sigma * max_grad_norm)
                        self._add_noise(squares, sigma * max_grad_norm**2)
                else:
                    self.noise.advance()
            if self.reduce is None:
                noise()
            else:  # a refused noise raises on every rank, none left waiting in the sum (release_reduce.py)
                reduce_after_noise(noise, self.reduce, sums + squares + clean)
            grads = [s.div_(expected_batch_size) for s in sums]
        if request.scale is not None:
            grads = [g.div_(request.scale[p]) for p, g in zip(params, grads)]
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        return Release(
            noise_std=sigma * max_grad_norm / expected_batch_size * math.sqrt(self.noise.variance_factor()),
            expected_batch_size=expected_batch_size,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            scale=request.scale,
            second_moment=_per_param(params, squares, expected_batch_size),
            second_moment_noise_std=sigma * max_grad_norm**2 / expected_batch_size if squares else 0.0,
            clean_mean=_per_param(params, clean, expected_batch_size),
        )

    def _add_noise(self, tensors: list[Tensor], std: float) -> None:
        """tensors += std · z, in place (z: this step's draw of the noise mechanism)."""
        if tensors:
            self.noise.add_noise_(tensors, std)


def _per_param(params: Sequence[nn.Parameter], tensors: list[Tensor], divisor: float) -> Optional[dict[Tensor, Tensor]]:
    if not tensors:
        return None
    return {p: t / divisor for p, t in zip(params, tensors)}


seal(__name__)
