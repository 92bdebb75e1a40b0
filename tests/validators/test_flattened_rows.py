"""validators/example_dim.flattened_rows: which [n·m, …] tensors are verified as n examples' rows, example-major.
Each case builds the tensor the way a model does and says whether example i owns rows i·m … (i+1)·m − 1."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.validators.example_dim import flattened_rows

N = 2


def _layer_output(rows: int, width: int) -> torch.Tensor:
    """A stand-in for a hooked layer's output (the capture's alias: an _unsafe_view node)."""
    h = torch.tanh(torch.randn(rows, 5, width, requires_grad=True))
    return torch.ops.aten._unsafe_view(h, h.shape)


def _x() -> torch.Tensor:
    return torch.randn(N, 3, 5, 4, requires_grad=True)


@pytest.mark.parametrize("make,verified", [
    (lambda: _x().flatten(0, 1), True),  # a view of a contiguous [n, …]
    (lambda: _x().transpose(1, 2).reshape(N * 5, 3, 4), True),  # a reshape that copies (window partition)
    (lambda: _x()[:, :, 1:].reshape(-1, 2, 2, 4).permute(0, 3, 1, 2).contiguous(), True),  # MViTv2's pooling
    (lambda: _x().reshape(N * 3, 5, 4).transpose(-1, -2).contiguous(), True),
    (lambda: _x().reshape(N * 3, 5, 4).select(1, 0).float(), True),
    (lambda: _x().reshape(N * 3, 5, 4).transpose(0, 1).transpose(0, 1), True),  # moved away and back
    (lambda: _x().transpose(0, 1).reshape(3 * N, 5, 4), False),  # time-major: the batch moved before flattening
    (lambda: _x().reshape(N * 3, 5, 4)[1:5], False),  # rows sliced
    (lambda: _x().detach().transpose(1, 2).reshape(N * 5, 3, 4), False),  # a copy of data: no record
], ids=["view", "copy", "mvit-pool", "transpose-last", "select", "transposed-back", "time-major", "rows-sliced",
        "data-copy"])
def test_rows_from_a_reshape_of_the_examples(make, verified):
    assert flattened_rows(make(), N) is verified


def test_rows_from_a_leading_dimension_need_a_layer_of_the_examples_behind_them():
    """SAM: qkv(x).view(B, T, 3, heads, d).permute(2, 0, 3, 1, 4).reshape(3, B·heads, T, d).unbind(0): the
    examples sit in dimension 1 of the reshape, so the walk must reach the qkv layer's output (an anchor) with
    them in dimension 0; windows: the layer ran on B·k verified rows, the anchor's count."""
    def queries(out, rows):
        return out.reshape(rows, 5, 3, 2, 4).permute(2, 0, 3, 1, 4).reshape(3, rows * 2, 5, 4).unbind(0)[0]

    out = _layer_output(N, 24)
    q = queries(out, N)
    assert flattened_rows(q, N, {out.grad_fn: N})
    assert not flattened_rows(q, N)  # no layer behind: dimension 1 of size n is not trusted
    assert not flattened_rows(q, N, {out.grad_fn: 2 * N})  # the layer's rows are not these
    windows = _layer_output(3 * N, 24)
    assert flattened_rows(queries(windows, 3 * N), N, {windows.grad_fn: 3 * N})
    assert not flattened_rows(queries(windows, 3 * N), N, {windows.grad_fn: N})
    swapped = out.reshape(N, 5, 3, 2, 4).permute(2, 1, 3, 0, 4).reshape(3, 5 * 2, N, 4).unbind(0)[0]
    assert not flattened_rows(swapped, N, {out.grad_fn: N})  # tokens × heads as rows: not the examples
