"""BroadcastSites (mechanism/broadcast_sites.py): example i's gradient of a tensor without an example dimension,
read where the model broadcasts it over the batch."""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

from lightning_dp.mechanism.broadcast_sites import BroadcastSites

N, D = 4, 3


def _reference(fn, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Example i's gradient of Σ_j fn(p, x)[j] w.r.t. p, by running each example alone."""
    return torch.stack([torch.autograd.grad(fn(p, x[i:i + 1]).sum(), p)[0] for i in range(x.shape[0])])


def _gathered(fn, p: torch.Tensor, x: torch.Tensor, reads: int = 1):
    """Per-example gradients of p gathered by the sites (``reads`` views of p followed, as root_parameters does)."""
    sites, got = BroadcastSites(x.shape[0]), []
    views = [p.view_as(p) for _ in range(reads)]
    for v in views:
        sites.follow(v, lambda rows, total: got.append((rows, total)))
    try:
        fn(*views, x).sum().backward()
    finally:
        sites.close()
    return sum(rows for rows, _ in got), sum(total for _, total in got)


def test_a_repeat_over_the_batch_is_a_site():
    """mask_token.repeat(B, k, 1): a copy per example, not a broadcast op (ViTMAE)."""
    p, x = torch.randn(1, 1, D, dtype=torch.float64, requires_grad=True), torch.randn(N, 2, D, dtype=torch.float64)

    def fn(p, x):
        return torch.cat([x, p.repeat(x.shape[0], 3, 1)], 1).pow(3).sum((1, 2))

    rows, total = _gathered(fn, p, x)
    torch.testing.assert_close(rows, _reference(fn, p, x))
    torch.testing.assert_close(rows.sum(0), total)


def test_a_tensor_computed_from_two_reads_reaches_both():
    """PVT: torch.cat((pos[:, :1], resample(pos[:, 1:])), 1) from two reads of one table, then added to the batch."""
    p, x = torch.randn(1, 5, D, dtype=torch.float64, requires_grad=True), torch.randn(N, 5, D, dtype=torch.float64)

    def fn(a, b, x):
        grid = b[:, 1:].reshape(1, 2, 2, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(1, 4), mode="bilinear").reshape(1, D, 4).permute(0, 2, 1)
        return torch.tanh(x + torch.cat([a[:, :1], grid], 1)).pow(2).sum((1, 2))

    rows, total = _gathered(lambda a, b, x: fn(a, b, x), p, x, reads=2)
    torch.testing.assert_close(rows, _reference(lambda q, x: fn(q, q, x), p, x))
    torch.testing.assert_close(rows.sum(0), total)


def test_the_mode_pauses_only_once_nothing_followed_is_alive():
    sites = BroadcastSites(N)
    out = torch.randn(1, D, requires_grad=True).view(1, D)
    sites.follow(out, lambda rows, total: None)
    derived = out * 2  # followed too
    try:
        del out
        gc.collect()
        sites.pause_if_idle()
        assert sites in _get_current_function_mode_stack()  # `derived` may still meet the batch
        del derived
        gc.collect()
        sites.pause_if_idle()
        assert sites not in _get_current_function_mode_stack()
        assert not sites.active
    finally:
        sites.close()
    assert sites not in _get_current_function_mode_stack()
