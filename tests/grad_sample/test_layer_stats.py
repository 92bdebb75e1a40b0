"""lightning_dp.grad_sample.layer_stats: the ghost norm's Gram products, blocked over their symmetric halves, equal
the squared norms of the materialised per-example gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.grad_sample.layer_stats import gram_blocks, gram_sq_norms


@pytest.mark.parametrize("T", [1, 5, 31, 32, 33, 63, 64, 65, 100, 257])
def test_blocked_gram_norms_are_the_materialised_norms(T):
    g = torch.Generator().manual_seed(T)
    a = torch.randn(6, T, 7, generator=g, dtype=torch.float64)
    d = torch.randn(6, T, 5, generator=g, dtype=torch.float64)
    materialised = torch.einsum("nto,nti->noi", d, a).pow(2).sum((1, 2))
    torch.testing.assert_close(gram_sq_norms(a, d), materialised, rtol=1e-12, atol=1e-10)


def test_transposed_views_are_read_as_they_are():
    """The convolution rule hands column-major patches as transposed views."""
    a, d = torch.randn(3, 9, 70, dtype=torch.float64), torch.randn(3, 4, 70, dtype=torch.float64)
    at, dt = a.transpose(1, 2), d.transpose(1, 2)
    torch.testing.assert_close(gram_sq_norms(at, dt), torch.einsum("nto,nti->noi", dt, at).pow(2).sum((1, 2)))


def test_block_counts():
    assert [gram_blocks(T) for T in (1, 31, 32, 63, 64, 4096)] == [1, 1, 2, 2, 4, 4]
