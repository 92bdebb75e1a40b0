"""BroadcastSites (grad_sample/capture/broadcast_sites.py): example i's gradient of a tensor without an example dimension,
read where the model broadcasts it over the batch."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

from lightning_dp.grad_sample.capture.broadcast_sites import BroadcastSites

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


def _at_layer_gathered(fn, p: torch.Tensor, x: torch.Tensor, dim: int):
    """Sites for a layer with the examples in dimension ``dim`` of its argument: ``fn(p, x)`` makes the argument
    (a followed tensor), ``layer(arg, x)`` is what the layer computes per example."""
    sites, got = BroadcastSites(x.shape[0]), []
    v = p.view_as(p)
    sites.follow(v, lambda rows, total: got.append((rows, total)))
    try:
        arg = fn(v)
        served = sites.at_layer(arg, dim)
        assert served is not arg  # a site: the layer gets an alias
        (served.movedim(dim, 0) * x).tanh().sum().backward()
    finally:
        sites.close()
    return got[0]


def test_a_layer_argument_with_the_examples_in_dimension_one_is_a_site(monkeypatch):
    """An RNN's learned h0 [L, 1, H] expanded to [L, n, H]: example i's gradient is the layer's use of slice i, mapped
    back through the expansion (and the contiguous copy); in chunks of examples when the masked gradients are large."""
    import lightning_dp.grad_sample.capture.broadcast_sites as bs

    p = torch.randn(2, 1, D, dtype=torch.float64, requires_grad=True)
    x = torch.randn(N, 2, D, dtype=torch.float64)

    def make(q):
        return (q.expand(-1, N, -1).contiguous() * 1.5).sin()

    want = torch.stack([torch.autograd.grad((make(p)[:, i] * x[i]).tanh().sum(), p)[0] for i in range(N)])
    for budget in (1 << 24, 2 * D * N):  # one map-back, or one per example
        monkeypatch.setattr(bs, "_SLICED_ELEMENTS", budget)
        rows, total = _at_layer_gathered(make, p, x, 1)
        torch.testing.assert_close(rows, want)
        torch.testing.assert_close(rows.sum(0), total)


def test_a_layer_argument_without_the_examples_is_not_a_site():
    """Not followed, no n in the layer's example dimension, or n in another dimension only: passed unchanged."""
    sites = BroadcastSites(N)
    p = torch.randn(N, 1, D, requires_grad=True)
    v = p.view_as(p)
    sites.follow(v, lambda rows, total: None)
    try:
        assert sites.at_layer(v, 1) is v  # n in dimension 0, 1 in the layer's example dimension
        plain = torch.randn(2, N, D, requires_grad=True)
        assert sites.at_layer(plain, 1) is plain  # not followed
    finally:
        sites.close()


def test_a_path_through_another_site_is_not_counted_twice():
    """Time-major: x = h + pe (pe [T, 1, d] followed; x [T, n, d] too); an attention-like layer takes x (a site),
    the residual x + layer(x) enters a second layer (a site whose map-back must not run through the first)."""
    T_ = 3
    pe = torch.randn(T_, 1, D, dtype=torch.float64, requires_grad=True)
    h = torch.randn(T_, N, D, dtype=torch.float64)

    def model(q, h, sites=None):
        x = h + q
        a = sites.at_layer(x, 1) if sites else x
        inner = a.tanh() * 2.0  # the first layer (per example: slice i of dim 1)
        r = x + inner
        b = sites.at_layer(r, 1) if sites else r
        return b.sin()  # the second layer

    want = torch.stack([torch.autograd.grad(model(pe, h)[:, i].sum(), pe)[0] for i in range(N)])
    sites, got = BroadcastSites(N), []
    v = pe.view_as(pe)
    sites.follow(v, lambda rows, total: got.append((rows, total)))
    try:
        model(v, h, sites).sum().backward()
    finally:
        sites.close()
    rows, total = got[0]
    torch.testing.assert_close(rows, want)
    torch.testing.assert_close(rows.sum(0), total)


def _block_model(use: str):
    """A shared table [H, k, d] repeated over the batch, ``repeat(n, 1, 1)`` → [n·H, k, d], and multiplied in a bmm with
    queries [n·H, T, d] flattened from [n, H, T, d] (DeBERTa-v2's relative attention), then: ``use``."""
    H, K, T_ = 2, 3, 2

    def fn(p, x):
        n = x.shape[0]
        q = (x.view(n, H, T_, D) * 1.0).contiguous().view(-1, T_, D)  # a verified flattening view
        r = p.repeat(n, 1, 1)
        other = q if use != "unflattened" else q.clone()  # a copy: not verifiably example-major
        if use == "flipped":
            r = r.flip(0)
        out = torch.bmm(other, r.transpose(-1, -2)).tanh()  # [n·H, T, K]
        per_example = out.view(n, -1).pow(2).sum(1)
        return per_example + (r.pow(2).sum() if use == "summed" else 0)

    return fn, torch.randn(H, K, D, dtype=torch.float64, requires_grad=True), torch.randn(N, H * T_ * D, dtype=torch.float64)


def test_a_block_repeated_over_the_batch_and_met_row_for_row_is_a_site():
    fn, p, x = _block_model("bmm")
    rows, total = _gathered(fn, p, x)
    torch.testing.assert_close(rows, _reference(fn, p, x))
    torch.testing.assert_close(rows.sum(0), total)


def test_a_block_of_copies_used_otherwise_is_not_handed_over():
    """Summed into the loss besides, its rows permuted, or met with a batch whose row layout is not verified: the
    rows are not the examples' (nothing delivered: the step is refused)."""
    for use in ("summed", "flipped", "unflattened"):
        fn, p, x = _block_model(use)
        sites, got = BroadcastSites(N), []
        v = p.view_as(p)
        sites.follow(v, lambda rows, total: got.append(rows))
        try:
            fn(v, x).sum().backward()
        finally:
            sites.close()
        assert got == [None], use


@pytest.mark.parametrize("name,shapes", [
    ("scaled_dot_product_attention", [(1, 2, 5, 4), (6, 2, 5, 4), (6, 2, 5, 3), (1, 2, 5, 5)]),  # keys grow the batch
    ("scaled_dot_product_attention", [(6, 2, 5, 4), (6, 2, 7, 4), (6, 2, 7, 3), (1, 2, 5, 7)]),
    ("scaled_dot_product_attention", [(6, 2, 5, 4), (6, 2, 7, 4), (6, 2, 7, 3), (5, 7)]),
    ("matmul", [(6, 5, 3), (3, 4)]),
    ("matmul", [(1, 2, 5, 3), (6, 1, 3, 4)]),
    ("__matmul__", [(6, 5, 3), (1, 3, 2)]),
    ("__rmatmul__", [(3, 2), (6, 5, 3)]),
])
def test_shape_only_predicts_the_result_shape(name, shapes):
    """The shape a costly broadcasting call's result will have, worked out before the call (broadcast_sites.
    _shape_only): it decides whether the call is a site, so it must equal the real result's shape."""
    from lightning_dp.grad_sample.capture.broadcast_sites import _shape_only

    args = tuple(torch.randn(s) for s in shapes)
    real = {"scaled_dot_product_attention": lambda *a: F.scaled_dot_product_attention(a[0], a[1], a[2], attn_mask=a[3]),
            "matmul": torch.matmul, "__matmul__": lambda a, b: a @ b, "__rmatmul__": lambda a, b: b @ a}[name](*args)
    call = (args[:3], {"attn_mask": args[3]}) if name == "scaled_dot_product_attention" else (args, {})
    predicted = _shape_only(name, *call)
    assert predicted is not None and predicted.shape == real.shape and predicted.device.type == "meta"


def test_shape_only_leaves_uncovered_calls_to_the_real_computation():
    from lightning_dp.grad_sample.capture.broadcast_sites import _shape_only

    q, kv = torch.randn(2, 4, 5, 3), torch.randn(2, 2, 5, 3)  # grouped-query attention: fewer key heads
    assert _shape_only("scaled_dot_product_attention", (q, kv, kv), {}) is None
    assert _shape_only("matmul", (torch.randn(3), torch.randn(3, 4)), {}) is None  # a 1-D operand
    q = torch.randn(1, 2, 5, 3)  # a mask that would grow the batch: the real call raises, as it would unfollowed
    assert _shape_only("scaled_dot_product_attention", (q, q, q), {"attn_mask": torch.randn(6, 2, 5, 5)}) is None
