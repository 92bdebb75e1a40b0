"""The noised mean for parameters sharded by FSDP2: reduce-scatter the clipped sums, noise each shard once.

docs/algorithms.md, "The mechanism": ĝ_t = (S_t + σ C z_t) / B, S_t = Σ_i clip_C(g_{t,i}) over the
examples of every rank, z_t ~ N(0, I_d), B the expected global batch. With replicated parameters
(:class:`~lightning_dp.privacy.privatizer.Privatizer`) rank 0 adds σCz to its full sum before one
all-reduce. With sharded parameters (:class:`~lightning_dp.sharding.fsdp_layout.FSDPLayout`) rank r
owns the rows R_r of every parameter, and:

    S_t[R_r]  = Σ_ranks S_t^(rank)[R_r]                   one reduce-scatter (SUM) of the clipped sums
    ĝ_t[R_r]  = (S_t[R_r] + σ C z_t^(r)) / B               on rank r, from rank r's own stream
    p.grad    = DTensor(ĝ_t[R_r])                          the shard rank r's optimizer updates

The R_r partition the coordinates, so every coordinate is noised exactly once; the z^(r) together
are one draw of N(0, I_d) because the streams are independent (:func:`rank_stream`: never one seed
on two ranks). The sensitivity is that of S_t, however it is split: one example moves it by at most
C in L2. The only collective carries clipped sums; nothing non-private is communicated.

Memory: each parameter's clipped sum is full-size; the ghost engine streams them
(:class:`~lightning_dp.grad_sample.streamed_sums.StreamedSums`: one layer's contraction at a
time) into reduce-scatter buckets of at most :data:`BUCKET_ELEMENTS` elements, each sum freed once copied,
so no model-sized gradient is ever held (the largest single parameter is the floor). What persists
(``p.grad``) is this rank's shard.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.sharding.fsdp_layout import FSDPLayout
from lightning_dp.engine_api import ClippedBatch
from lightning_dp.privacy.noise import NoiseMechanism
from lightning_dp.privacy.private_step import PRIVATIZERS, Distribution
from lightning_dp.privacy.release import MechanismRequest, Release
from lightning_dp.release_reduce import raise_together
from lightning_dp.sealed_noise import seal

BUCKET_ELEMENTS = 1 << 22
"""Elements of one reduce-scatter's input (world_size × the per-rank width; 16 MiB in float32): the transient
memory the release adds beyond this rank's shard. A parameter larger than that is sent alone."""


def rank_stream(noise: NoiseMechanism, rank: int) -> NoiseMechanism:
    """Rank ``rank``'s noise stream, independent of every other rank's (the mechanism's ``for_rank``).

    Refused, naming the fix: banded (correlated) noise, whose history would have to be kept and
    checkpointed per shard, and a mechanism that cannot say how to split itself into independent streams."""
    if getattr(noise, "bands", 1) > 1:
        raise PrivacyConfigurationError(
            "DPShardedStrategy does not support banded (correlated, DP-MF) noise yet: its noise history would be "
            "kept per shard and has to be checkpointed per rank. Use noise='gaussian' (the default).")
    split = getattr(noise, "for_rank", None)
    if split is None:
        raise PrivacyConfigurationError(
            f"DPShardedStrategy: {type(noise).__name__} has no for_rank(rank) method. Under sharding every rank "
            "noises the coordinates it owns and the ranks' streams must be independent (never one seed on two "
            "ranks): give the mechanism a for_rank(rank) returning rank's own stream, or use noise='gaussian'.")
    try:
        return split(rank)
    except ValueError as err:
        raise PrivacyConfigurationError(f"DPShardedStrategy: {err}") from err


class ShardedPrivatizer:
    """Turns per-rank full-size clipped sums into this rank's shard of the private gradient.

    Args:
        noise: this rank's own stream (:func:`rank_stream`).
        layout: where FSDP2 keeps the parameters (mesh, rows per rank).
    """

    def __init__(self, noise: NoiseMechanism, layout: FSDPLayout) -> None:
        self.noise = noise
        self.layout = layout

    def privatize(
        self,
        batch: ClippedBatch,
        params: Sequence[nn.Parameter],
        request: MechanismRequest,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
    ) -> Release:
        """Write this rank's shard of ĝ_t into ``p.grad`` (a ``DTensor``) and describe the release.

        Consumes ``batch``'s sums (each is freed once reduce-scattered; read anything else first)."""
        if request.second_moment and batch.square_sums is None:
            raise RuntimeError("the engine returned no square sums although the variant asked for them")
        layout = self.layout
        layout.check_sealed()
        layout.drop_autograd_grads()  # autograd's (non-private) gradients of the unsharded leaves: never used
        sigma = noise_multiplier * math.sqrt(request.noise_split)
        B = expected_batch_size
        sums = reduce_scatter_rows(lambda i: _full(batch.sums.pop(params[i]), params[i]), params, layout)
        squares: list[Tensor] = []
        if request.second_moment:
            square_sums = batch.square_sums
            assert square_sums is not None
            squares = reduce_scatter_rows(lambda i: _full(square_sums.pop(params[i]), params[i]), params, layout)
        clean = [s.clone() for s in sums] if request.clean_mean else []

        def noised() -> None:
            with self.noise.step():  # this release's draws (made during the step when drawn ahead)
                self.noise.add_noise_(sums, sigma * max_grad_norm / B, 1.0 / B)  # ĝ[R_r] = S[R_r]/B + (σC/B)·z^(r)
                if squares:
                    self.noise.add_noise_(squares, sigma * max_grad_norm**2)

        # a refusal on one rank raises on every rank (release_reduce.py), none left waiting in the next all-gather
        raise_together(noised, lambda flag: dist.all_reduce(flag, group=layout.group), sums[0] if sums else None)
        scale = None
        if request.scale is not None:  # scale-then-privatize (§4): the engine clipped s ⊙ g_i; undo s on the shard
            scale = [self._rows(request.scale[p], p) for p in params]
            sums = [g.div_(s) for g, s in zip(sums, scale)]
        for p, g in zip(params, sums):
            p.grad = layout.as_sharded_grad(g.to(p.dtype), p)
        return Release(
            noise_std=sigma * max_grad_norm / B * math.sqrt(self.noise.variance_factor()),
            expected_batch_size=B,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            scale=None if scale is None else self._sharded(params, scale, 1.0),
            second_moment=self._sharded(params, squares, B),
            second_moment_noise_std=sigma * max_grad_norm**2 / B if squares else 0.0,
            clean_mean=self._sharded(params, clean, B),
        )

    def _rows(self, full: Tensor, p: Tensor) -> Tensor:
        """This rank's rows of the full-size ``full`` (shaped like ``p``)."""
        start, stop, _ = self.layout.rows(p)
        return full[start:stop]

    def _sharded(self, params: Sequence[nn.Parameter], local: list[Tensor],
                 divisor: float) -> Optional[dict[Tensor, Tensor]]:
        if not local:
            return None
        return {p: self.layout.as_sharded_grad((t / divisor).to(p.dtype), p) for p, t in zip(params, local)}


def _full(s: Tensor, p: Tensor) -> Tensor:
    """A full-size clipped sum as a plain tensor. Engines return ``zeros_like(p)`` for an empty batch, which for
    a sharded ``p`` is a ``DTensor``: its full-size equivalent is a plain zero tensor (no collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(s, DTensor):
        local = s.to_local()
        if local.count_nonzero() != 0:
            raise RuntimeError("a clipped sum arrived sharded and non-zero: the engine must return full-size sums")
        return torch.zeros(s.shape, dtype=s.dtype, device=local.device)
    return s


@torch.no_grad()
def reduce_scatter_rows(take: Callable[[int], Tensor], params: Sequence[Tensor], layout: FSDPLayout,
                        bucket_elements: Optional[int] = None) -> list[Tensor]:
    """Sum the full-size tensors ``take(i)`` (one per parameter, shaped like it) over the ranks and return this
    rank's rows of each. Buckets whose send buffer holds at most ``bucket_elements`` (default
    :data:`BUCKET_ELEMENTS`) elements (a larger tensor alone), planned from
    the shapes; each tensor is taken only when its bucket is filled and dropped once copied in, so a lazy
    ``take`` (:class:`~lightning_dp.grad_sample.streamed_sums.StreamedSums`) never has more than one
    layer's sums alive. The send buffer of a bucket holds, in row r, the c rows rank r owns of each of its
    tensors (zero-padded to c), as ``reduce_scatter_tensor`` wants."""
    world = layout.world_size
    per_rank = (BUCKET_ELEMENTS if bucket_elements is None else bucket_elements) // world
    widths = [layout.rows(p)[2] * _row_numel(p) for p in params]
    buckets: list[list[int]] = []
    filled = 0
    for i, w in enumerate(widths):
        if buckets and filled + w <= per_rank and params[buckets[-1][0]].dtype == params[i].dtype:
            buckets[-1].append(i)
            filled += w
        else:
            buckets.append([i])
            filled = w
    out: list[Optional[Tensor]] = [None] * len(params)
    for bucket in buckets:
        width = sum(widths[i] for i in bucket)
        send: Optional[Tensor] = None
        offset = 0
        for i in bucket:
            full = take(i)
            if send is None:
                send = full.new_zeros(world, width)
            rows, rest, c = full.shape[0], _row_numel(full), layout.rows(params[i])[2]
            if c == 0:  # a parameter without rows: nothing to send
                continue
            block = send[:, offset:offset + c * rest].view(world, c, rest)  # rank r's c rows of this tensor
            flat = full.reshape(rows, rest)
            whole = rows // c
            block[:whole].copy_(flat[:whole * c].view(whole, c, rest))
            if whole < world and rows > whole * c:
                block[whole, : rows - whole * c].copy_(flat[whole * c:])
            del full, flat  # the last reference: a streamed layer's sum is freed here
            offset += c * rest
        assert send is not None
        received = send.new_empty(width)
        _reduce_scatter(received, send.view(-1), layout.group)
        del send
        offset = 0
        for i in bucket:
            p = params[i]
            start, stop, c = layout.rows(p)
            rest = _row_numel(p)
            out[i] = received[offset:offset + (stop - start) * rest].view(stop - start, *p.shape[1:])
            offset += c * rest
    return out  # type: ignore[return-value]


def _row_numel(t: Tensor) -> int:
    return math.prod(t.shape[1:])


def _reduce_scatter(output: Tensor, send: Tensor, group: object) -> None:
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(output, send, op=dist.ReduceOp.SUM, group=group)


def for_step(noise: NoiseMechanism, where: Distribution) -> ShardedPrivatizer:
    """The release rule of the noised mean when FSDP2 shards the parameters (``where.layout``): this rank's stream
    (:func:`rank_stream`) on the rows it owns."""
    assert where.layout is not None
    return ShardedPrivatizer(rank_stream(noise, where.rank), where.layout)


PRIVATIZERS["sharded"] = for_step  # registered with the private step's release rules (privacy/private_step.py)

__all__ = ["BUCKET_ELEMENTS", "ShardedPrivatizer", "for_step", "rank_stream", "reduce_scatter_rows"]


seal(__name__, tunable=("BUCKET_ELEMENTS",))
