"""The cross-rank sum of a release under data parallelism: one collective on a flat buffer, which also carries
whether the noise failed on the rank that adds it.

Under DDP one rank adds the noise to its clipped sums and every rank then sums them (:class:`~lightning_dp.privacy.
privatizer.Privatizer`). When that rank's noise is refused (:class:`~lightning_dp.validators.noise_added.
NoiseMissingError`: a patched ``Tensor.normal_``) or its draw raises, it must still join the sum its peers wait in, or
they hang there until the process group's timeout (30 minutes by default). :func:`reduce_after_noise` runs the
noise, then the sum with one number more — 1 where the noise raised a :class:`NoiseMissingError` (or the noise path
was found replaced: :class:`~lightning_dp.sealed_noise.NoisePathReplacedError`), 2 where it raised
anything else, 0 otherwise —, and every rank raises when the sum says any rank failed: the failing rank its own error,
the others :class:`NoiseMissingError` (or a ``RuntimeError``) naming the rank's failure. The failing rank's sums are
zeroed before they are sent: nothing it did not noise reaches the others. Cost: one number more in the collective and
one host read of it a step.

The mechanisms whose ranks each noise their own part — DP-SignSGD's vote (each worker noises its own sum before the
vote) and FSDP2's sharded noise (each rank noises the rows it owns after the reduce-scatter) — send no sum of the
release after the noise: :func:`raise_together` sums the flag alone (one collective of one number a step more).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_dp.validators.noise_added import NoiseMissingError
from lightning_dp.sealed_noise import NoisePathReplacedError, seal

__all__ = ["flat_all_reduce", "raise_together", "reduce_after_noise"]


@torch.no_grad()
def flat_all_reduce(tensors: list[Tensor], all_reduce: Callable[[Tensor], None]) -> None:
    """Sum ``tensors`` across ranks with one collective on a flat buffer (in place)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


@torch.no_grad()
def reduce_after_noise(noise: Callable[[], None], reduce: Callable[[list[Tensor]], None],
                       tensors: list[Tensor], like: Optional[Tensor] = None) -> None:
    """Run ``noise`` (this rank's noise added to ``tensors``, or its stream advanced), then ``reduce`` (an in-place
    cross-rank sum of a list of tensors) of ``tensors`` and a failure flag (on ``like``'s device, else the first
    tensor's); raise on every rank when any rank's ``noise`` raised (module docstring)."""
    error = None
    try:
        noise()
    except Exception as err:  # noqa: BLE001 (sent to the other ranks, then raised here)
        error = err
    like = like if like is not None else tensors[0] if tensors else torch.zeros(())
    refused = isinstance(error, (NoiseMissingError, NoisePathReplacedError))
    flag = torch.full((1,), 0 if error is None else 1 if refused else 2, dtype=like.dtype, device=like.device)
    if error is not None:
        for t in tensors:
            t.zero_()  # (the sums are discarded on every rank: nothing un-noised is sent)
    reduce([*tensors, flag])
    if error is not None:
        raise error
    failed = int(flag.item())
    if failed == 1:
        raise NoiseMissingError(
            "The noise the mechanism was asked to add is missing from the release, or the noise path was replaced, on "
            "a rank that adds it (that rank's error names what and the cause: a torch.library kernel for "
            "aten::normal_, a replaced name of lightning_dp's noise modules, a mock of the random generator). Nothing "
            "was released on any rank (the optimizers did not step). Remove the patch for the fit.")
    if failed:
        raise RuntimeError("Drawing the release's noise failed on a rank that adds it (that rank's error says why): "
                           "nothing was released on any rank.")


def raise_together(noise: Callable[[], None], all_reduce: Callable[[Tensor], None],
                   like: Optional[Tensor] = None) -> None:
    """Run ``noise`` (the noise this rank adds to its own part of the release), then sum its failure flag alone
    across ranks (one number: ``all_reduce`` sums one tensor in place, on ``like``'s device): every rank raises when
    any rank's noise raised. For the mechanisms whose ranks each noise their own part — FSDP2's rows
    (:mod:`~lightning_dp.sharding.privatizer`), DP-SignSGD's workers (:mod:`~lightning_dp.sign_sgd.privatizer`) —
    whose next collective carries no sum of the release's: a refusing rank would leave its peers waiting there."""
    reduce_after_noise(noise, lambda tensors: all_reduce(tensors[-1]), [], like)


seal(__name__)
