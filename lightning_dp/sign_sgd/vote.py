"""DP-SignSGD's mechanism: each worker privatises its own sign, the server votes.

docs/algorithms.md §6 (seed: dp-sign-sgd-heavy-tailed.txt, Algorithms 1 and 2). Per step,
for every worker m holding its own local dataset:

    S_m    = Σ_{i in batch_m} clip_C(g_i)          # per-example clipping, Poisson batch
    out_m  = sign(S_m + σ C z_m)                    # the worker's OWN noise, z_m ~ N(0, I)
    vote   = sign(Σ_m out_m)                        # ties (and exact zeros) give 0
    θ     -= η · vote                               # done by ``lightning_dp.optim.DPSignSGD``

Each ``out_m`` is a post-processing of the sampled Gaussian mechanism on worker m's
local data with sensitivity C (add/remove one example changes S_m by at most C), so
the guarantee is per worker, against an untrusted server and untrusted peers. The
seed clips the *averaged* subsample gradient instead, whose add/remove sensitivity is
2C; see :mod:`lightning_dp.accounting.sign_sgd_calibration`.

Everything here is pure torch (no Lightning). Signs travel as ``int8``: one byte per
coordinate instead of four, and a lossless encoding of {-1, 0, +1}.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.privacy.noise import GaussianNoise

SIGN_DTYPE = torch.int8
"""The dtype of every sign and vote produced here."""

INT8_MAX_WORLD_SIZE = 127
"""Largest number of workers whose int8 signs can be summed in int8 without overflow."""


def _check_sigma_c(noise_multiplier: float, max_grad_norm: float) -> None:
    if not noise_multiplier >= 0.0:
        raise ValueError(f"noise_multiplier must be >= 0 (0 = non-private SignSGD), got {noise_multiplier}")
    if not max_grad_norm > 0.0:
        raise ValueError(f"max_grad_norm (C) must be > 0, got {max_grad_norm}")


def noisy_sum(
    clipped_sum: Tensor,
    noise_multiplier: float,
    max_grad_norm: float,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """S_m + σ C z_m, the worker's pre-sign statistic (docs/algorithms.md §6, line ``out_m``).

    Args:
        clipped_sum: S_m, the sum of the worker's per-example clipped gradients (any shape).
        noise_multiplier: σ ≥ 0 (0 gives the non-private statistic back unchanged).
        max_grad_norm: C > 0, the per-example clipping norm, i.e. the sensitivity of S_m.
        generator: source of z_m; ``None`` draws a fresh OS-seeded generator (production).
            A fixed generator is for tests and reproducible research runs.

    Returns:
        A new floating tensor shaped like ``clipped_sum``; the input is not modified.
    """
    _check_sigma_c(noise_multiplier, max_grad_norm)
    if not clipped_sum.is_floating_point():
        raise ValueError(f"clipped_sum must be a floating tensor, got {clipped_sum.dtype}")
    if noise_multiplier == 0.0:
        return clipped_sum.clone()
    noisy = clipped_sum.clone()
    GaussianNoise(generator=generator).add_noise_([noisy], noise_multiplier * max_grad_norm)  # the one noise source
    return noisy


def worker_sign(
    clipped_sum: Tensor,
    noise_multiplier: float,
    max_grad_norm: float,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """One worker's message: sign(S_m + σ C z_m) as int8 in {-1, 0, +1} (docs/algorithms.md §6).

    Exact zeros of the noisy statistic map to 0 (with σ > 0 that has probability zero;
    with σ = 0 it is the sign of an all-zero sum, e.g. an empty Poisson batch).
    ``clipped_sum`` may carry a leading worker axis: z is i.i.d. over every entry, so
    ``worker_sign(S[M, d], ...)`` equals M independent calls.

    Example:
        >>> worker_sign(torch.tensor([2.0, -3.0, 0.0]), 0.0, 1.0).tolist()
        [1, -1, 0]
    """
    return torch.sign(noisy_sum(clipped_sum, noise_multiplier, max_grad_norm, generator)).to(SIGN_DTYPE)


def _check_signs(signs: Tensor) -> None:
    if signs.dtype != SIGN_DTYPE:
        raise ValueError(f"signs must be {SIGN_DTYPE} (use worker_sign), got {signs.dtype}")
    if signs.numel() and bool(((signs < -1) | (signs > 1)).any()):
        raise ValueError("signs must take values in {-1, 0, +1}")


def majority_vote(signs: Tensor) -> Tensor:
    """Server side: sign(Σ_m out_m) over the leading worker axis; ties give 0.

    Args:
        signs: int8 tensor of shape ``[M, ...]`` with entries in {-1, 0, +1}.

    Returns:
        int8 tensor of shape ``signs.shape[1:]``. The sum is taken in int32, so any
        number of workers is safe (an int8 sum would overflow beyond 127 workers).
    """
    _check_signs(signs)
    if signs.dim() == 0 or signs.shape[0] == 0:
        raise ValueError("signs must have a leading worker axis with at least one worker")
    return torch.sign(signs.sum(dim=0, dtype=torch.int32)).to(SIGN_DTYPE)


def vote_wire_dtype(world_size: int) -> torch.dtype:
    """The dtype the signs are summed in by :func:`all_reduce_vote`.

    ``int8`` while ``world_size ≤ 127`` (the sum of W values in {-1, 0, 1} lies in
    [-W, W], so it cannot overflow); ``int32`` beyond. ``int16`` would suffice up to
    32767 workers but neither gloo (``Invalid scalar type``, checked with torch 2.13)
    nor NCCL (no 16-bit integer type) can all-reduce it, so the fallback is int32.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return SIGN_DTYPE if world_size <= INT8_MAX_WORLD_SIZE else torch.int32


def all_reduce_vote(
    local_sign: Tensor,
    group: Optional["dist.ProcessGroup"] = None,
    *,
    all_reduce: Optional[Callable[[Tensor], None]] = None,
    world_size: Optional[int] = None,
) -> Tensor:
    """The vote across ranks (each rank one worker): sign(Σ_ranks local_sign), as int8.

    The signs are summed with one ``SUM`` all-reduce in :func:`vote_wire_dtype`
    (int8 up to 127 ranks, int32 beyond), then the sign of the sum is taken locally,
    so every rank ends with the same vote. ``local_sign`` is not modified.

    Args:
        local_sign: this rank's :func:`worker_sign` output (int8, any shape).
        group: ``torch.distributed`` process group (default: the world).
        all_reduce: optional in-place SUM collective to use instead of
            ``torch.distributed.all_reduce`` (e.g. a strategy's own); then
            ``world_size`` must be given too.
        world_size: number of voters; defaults to the group's size.

    Raises:
        ValueError: bad signs, or ``all_reduce`` without ``world_size``.
        RuntimeError: no ``all_reduce`` given and torch.distributed is not initialised.
    """
    _check_signs(local_sign)
    if all_reduce is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("all_reduce_vote needs torch.distributed initialised (or pass all_reduce=...)")
        world_size = dist.get_world_size(group) if world_size is None else world_size

        def all_reduce(t: Tensor) -> None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    elif world_size is None:
        raise ValueError("pass world_size=... together with a custom all_reduce")
    buffer = local_sign.to(vote_wire_dtype(world_size), copy=True)
    all_reduce(buffer)
    return torch.sign(buffer).to(SIGN_DTYPE)


def all_reduce_votes(
    local_signs: Sequence[Tensor],
    group: Optional["dist.ProcessGroup"] = None,
    **kwargs: object,
) -> list[Tensor]:
    """:func:`all_reduce_vote` for several tensors (one per parameter) with ONE collective.

    The signs are flattened into one int8 buffer, voted, and split back to the input
    shapes. Keyword arguments are passed to :func:`all_reduce_vote`.
    """
    if not local_signs:
        return []
    flat = torch.cat([s.reshape(-1) for s in local_signs])
    vote = all_reduce_vote(flat, group, **kwargs)  # type: ignore[arg-type]
    return [part.view_as(s) for part, s in zip(vote.split([s.numel() for s in local_signs]), local_signs)]
