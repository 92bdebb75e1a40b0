"""The cross-rank sum of a release under data parallelism: one collective on a flat buffer, which also carries
whether the noise failed on the rank that adds it.

Under DDP one rank adds the noise to its clipped sums and every rank then sums them (:class:`~lightning_dp.privacy.
privatizer.Privatizer`). When that rank's noise is refused (:class:`~lightning_dp.validators.noise_added.
NoiseMissingError`: a patched ``Tensor.normal_``) or its draw raises, it must still join the sum its peers wait in, or
they hang there until the process group's timeout (30 minutes by default). :func:`reduce_after_noise` runs the
noise, then the sum with one number more — 1 where the noise raised a :class:`NoiseMissingError`, 2 where it raised
anything else, 0 otherwise —, and every rank raises when the sum says any rank failed: the failing rank its own error,
the others :class:`NoiseMissingError` (or a ``RuntimeError``) naming the rank's failure. The failing rank's sums are
zeroed before they are sent: nothing it did not noise reaches the others. Cost: one number more in the collective and
one host read of it a step.

Not covered: the other mechanisms' collectives — DP-SignSGD's vote (each worker noises its own sum before the vote)
and FSDP2's sharded noise (each rank noises the rows it owns after the reduce-scatter): a rank whose noise is refused
there raises alone and its peers wait in their next collective until the process group's timeout.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from lightning_dp.validators.noise_added import NoiseMissingError

__all__ = ["flat_all_reduce", "reduce_after_noise"]


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
                       tensors: list[Tensor]) -> None:
    """Run ``noise`` (this rank's noise added to ``tensors``, or its stream advanced), then ``reduce`` (an in-place
    cross-rank sum of a list of tensors) of ``tensors`` and a failure flag; raise on every rank when any rank's
    ``noise`` raised (module docstring)."""
    error = None
    try:
        noise()
    except Exception as err:  # noqa: BLE001 (sent to the other ranks, then raised here)
        error = err
    like = tensors[0] if tensors else torch.zeros(())
    flag = torch.full((1,), 0 if error is None else 1 if isinstance(error, NoiseMissingError) else 2,
                      dtype=like.dtype, device=like.device)
    if error is not None:
        for t in tensors:
            t.zero_()  # (the sums are discarded on every rank: nothing un-noised is sent)
    reduce([*tensors, flag])
    if error is not None:
        raise error
    failed = int(flag.item())
    if failed == 1:
        raise NoiseMissingError(
            "The noise the mechanism was asked to add is missing from the release on the rank that adds it (that "
            "rank's error names the tensors and the cause: a patched torch.Tensor.normal_, torch.empty or "
            "torch.randn, a torch.library kernel for aten::normal_, a mock of the random generator). Nothing was "
            "released on any rank (the optimizers did not step). Remove the patch for the fit.")
    if failed:
        raise RuntimeError("Drawing the release's noise failed on the rank that adds it (that rank's error says why): "
                           "nothing was released on any rank.")
