"""validators/example_layout.py: which dimension of a tensor holds the examples, proven from autograd's record
(time-major activations, example-minor rows), and the capture's use of it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp import PrivacyConfigurationError
from lightning_dp.grad_sample.capture.activations import ActivationCapture
from lightning_dp.validators.example_layout import (
    ROWS,
    example_minor_rows,
    examples_in,
    view_dim_of_examples,
)

N, T, D = 3, 4, 5


def _layer(rows: int) -> torch.Tensor:
    """A stand-in for a hooked layer's output on ``rows`` examples, batch-first ``[rows, T, D]``."""
    return torch.tanh(torch.randn(rows, T, D, requires_grad=True)) * 1.0


def test_a_transpose_of_a_layer_output_is_time_major():
    out = _layer(N)
    layout = {out.grad_fn: 0}.get
    h = out.transpose(0, 1)  # [T, B, D]
    assert examples_in(h, 1, N, layout) is True
    assert examples_in(torch.nn.functional.gelu(h + 1.0) * 2.0, 1, N, layout) is True  # pointwise: kept
    assert examples_in(torch.cat([h, h[:1]], 0), 1, N, layout) is True  # cat along time
    assert examples_in(out.reshape(T, N, D) * 1.0, 1, N, layout) is None  # a reshape mixing B and T: undecided
    assert examples_in(h * 1.0, 1, N, {}.get) is None  # no layer behind it, not a view: nothing decided
    assert examples_in(h, 1, N, {}.get) is None  # a view of an activation: its dimension 0 is not trusted
    x = torch.randn(N, T, D, requires_grad=True)
    assert examples_in(x.transpose(0, 1), 1, N, {}.get) is True  # a transposed view of the data itself


def test_the_nearest_layer_output_decides():
    out = _layer(N)
    attention_like = out.transpose(0, 1) * 1.0  # a time-major layer's output: examples in dimension 1
    layout = {out.grad_fn: 0, attention_like.grad_fn: 1}.get
    assert examples_in(attention_like + 0.5, 1, N, layout) is True
    square = _layer(N)[:, :N]  # [B, B, D]: dimension 1 has n entries but holds positions
    assert examples_in(square * 1.0, 1, N, {square.grad_fn: 0}.get) is False
    flat = _layer(N * 2)
    assert examples_in(flat.transpose(0, 1), 1, N * 2, {flat.grad_fn: ROWS}.get) is False


def test_a_permuted_view_of_data_says_where_its_examples_went():
    x = torch.randn(N, T, D)
    assert view_dim_of_examples(x.transpose(0, 1), N) == 1
    assert view_dim_of_examples(x.permute(1, 2, 0), N) == 2
    assert view_dim_of_examples(x.transpose(0, 1).contiguous(), N) is None  # a copy: no provenance
    assert view_dim_of_examples(x.reshape(T, N, D), N) is None  # not a permutation of the dimensions
    square = torch.randn(N, N, D)
    assert view_dim_of_examples(square.transpose(0, 1), N) == 1  # T = B told apart by the strides


def test_example_minor_rows_come_from_a_reshape_whose_dimension_one_is_proven():
    out = _layer(N)
    layout = {out.grad_fn: 0}.get
    rows = out.transpose(0, 1).reshape(T * N, D)  # row t·N + b is example b's
    assert example_minor_rows(rows, N, layout) == T
    assert example_minor_rows(out.reshape(N * T, D), N, layout) is None  # example-major
    stacked = torch.stack([out, out * 2], 0)  # [2, B, T, D]: a dual-path separator's speakers
    assert example_minor_rows(stacked.view(2 * N, T, D), N, layout) == 2
    assert example_minor_rows(torch.stack([out, out], 1).view(2 * N, T, D), N, layout) is None  # [B, 2, …]: not n


def test_a_layer_proven_time_major_with_an_undecided_square_call_is_refused():
    """T = B: dimensions 0 and 1 both have n entries. A layer once proven time-major whose next such call autograd's
    record does not decide is refused; a layer never seen time-major stays batch-first as before."""
    norm, capture = nn.LayerNorm(D), ActivationCapture()
    capture.attach([("norm", norm)])
    capture.begin_step(N)
    norm(torch.randn(N, T, D, requires_grad=True).transpose(0, 1))  # a view of a batch-first tensor: proven
    with pytest.raises(PrivacyConfigurationError, match="'norm' ran time-major.*both dimension 0 and dimension 1"):
        norm(torch.randn(N, N, D, requires_grad=True))
    other, fresh = nn.LayerNorm(D), ActivationCapture()
    fresh.attach([("other", other)])
    fresh.begin_step(N)
    other(torch.randn(N, N, D, requires_grad=True)).sum().backward()
    assert not fresh.mismatched() and fresh.any_recorded()
    capture.detach()
    fresh.detach()
