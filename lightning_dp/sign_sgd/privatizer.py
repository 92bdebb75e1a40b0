"""The DP-SignSGD release of one step under data parallelism (docs/algorithms.md §6).

Each rank is a worker: it clips its own Poisson batch per example, adds its OWN noise
σC to its sum, and sends only sign(·) as int8; the vote sign(Σ_m signs) is written to
``p.grad``. Unlike the noised-mean mechanism, every rank adds noise: privacy is per
worker, with respect to its local data, against an untrusted aggregator.

Same interface as :class:`~lightning_dp.privacy.privatizer.Privatizer` (the
:class:`~lightning_dp.privacy.privatizer.StepPrivatizer` protocol), so the private step
treats both alike; the noise comes from a :class:`~lightning_dp.privacy.noise.NoiseMechanism`
(one place draws noise).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.engine_api import ClippedBatch
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.privacy.csprng import SecureGaussianNoise
from lightning_dp.privacy.noise import GaussianNoise, NoiseMechanism
from lightning_dp.privacy.private_step import PRIVATIZERS, Distribution
from lightning_dp.privacy.release import DEFAULT_REQUEST, MechanismRequest, Release
from lightning_dp.release_reduce import raise_together
from lightning_dp.sign_sgd.vote import SIGN_DTYPE, all_reduce_votes


class SignVotePrivatizer:
    """Writes the majority vote of the workers' noisy signs into ``p.grad``.

    Args:
        all_reduce: in-place SUM all-reduce of one tensor (``None`` for one worker).
        world_size: number of workers (ranks).
        seed: seed of this worker's noise (tests only; default from the OS). Ignored when
            ``noise`` is given.
        noise: the worker's noise mechanism (default :class:`GaussianNoise`); every worker
            draws its own, so it must be independent across ranks.
    """

    def __init__(
        self,
        all_reduce: Optional[Callable[[Tensor], None]] = None,
        world_size: int = 1,
        seed: Optional[int] = None,
        noise: Optional[NoiseMechanism] = None,
    ) -> None:
        self.all_reduce = all_reduce
        self.world_size = world_size
        self.noise = noise if noise is not None else GaussianNoise(seed)

    def privatize(
        self,
        batch: ClippedBatch,
        params: Sequence[nn.Parameter],
        request: MechanismRequest,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
    ) -> Release:
        """p.grad ← sign(Σ_m sign(S_m + σ C z_m)) for every parameter (ties give 0).

        ``request`` must be the default one: a vote carries no scale, second moment or clean mean.
        The release's ``noise_std`` is the worker's noise on its mean estimate, σC/B, before the sign."""
        if request != DEFAULT_REQUEST:
            raise ValueError("DP-SignSGD releases a vote: it cannot serve scale, second-moment or clean-mean requests")
        noisy = [batch.sums[p].clone() for p in params]
        if noise_multiplier > 0:
            def noised() -> None:
                self.noise.add_noise_(noisy, noise_multiplier * max_grad_norm)
            if self.all_reduce is not None and self.world_size > 1:  # a refusal raises on every worker (no hang)
                raise_together(noised, self.all_reduce, noisy[0] if noisy else None)
            else:
                noised()
        signs = [torch.sign(s).to(SIGN_DTYPE) for s in noisy]
        if self.all_reduce is not None and self.world_size > 1:
            votes = all_reduce_votes(signs, all_reduce=self.all_reduce, world_size=self.world_size)
        else:
            votes = signs
        for p, vote in zip(params, votes):
            p.grad = vote.to(p.dtype)
        return Release(
            noise_std=noise_multiplier * max_grad_norm / expected_batch_size,
            expected_batch_size=expected_batch_size,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
        )


def for_step(noise: NoiseMechanism, where: Distribution) -> SignVotePrivatizer:
    """The release rule of a private step whose optimizer asks for ``mechanism = "sign_vote"``
    (:class:`~lightning_dp.optim.sign_sgd.DPSignSGD`), or the refusal of a setting the vote cannot serve."""
    if where.layout is not None:
        raise PrivacyConfigurationError("DP-SignSGD's vote needs every worker's whole noisy sum: it does not run on "
                                        "sharded parameters. Use DPStrategy with DP-SignSGD.")
    if getattr(noise, "bands", 1) > 1:
        raise PrivacyConfigurationError("DP-SignSGD adds noise per worker; it cannot use banded noise.")
    if isinstance(noise, SecureGaussianNoise):
        raise PrivacyConfigurationError("DP-SignSGD draws each worker's noise itself: secure_mode does not cover it "
                                        "yet; use DPStrategy(secure_mode=False) with DP-SignSGD.")
    return SignVotePrivatizer(where.all_reduce, where.world_size)  # a fresh OS-seeded generator per worker


PRIVATIZERS["sign_vote"] = for_step  # registered with the private step's release rules (privacy/private_step.py)
