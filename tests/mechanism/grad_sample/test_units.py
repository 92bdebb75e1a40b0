"""Layers that are not batch-first leaves: nn.MultiheadAttention (a unit with a child), RNNs, and
layers drawing random numbers (attention dropout), against per-example gradients of the same graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.mechanism import make_engine


class AttentionWithDropout(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.attn = nn.MultiheadAttention(6, 2, dropout=0.5, batch_first=batch_first)
        self.enc = nn.TransformerEncoderLayer(6, 2, dim_feedforward=8, dropout=0.3, batch_first=batch_first)

    def forward(self, x):  # x: [B, T, 6]
        h = x if self.batch_first else x.transpose(0, 1)
        h, _ = self.attn(h, h, h, need_weights=False)
        h = self.enc(h)
        return h if self.batch_first else h.transpose(0, 1)


@pytest.mark.parametrize("engine_name", ["ghost", "vmap"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_dropout_inside_attention_is_replayed_exactly(engine_name, batch_first):
    torch.manual_seed(0)
    model = AttentionWithDropout(batch_first).double().train()
    n = 4
    x, y = torch.randn(n, 5, 6, dtype=torch.float64), torch.randn(n, 5, 6, dtype=torch.float64)
    params = [p for p in model.parameters()]
    engine = make_engine(engine_name)
    if engine_name == "ghost":
        engine.skip_param_grads = False  # keep autograd's weight gradients: the reference below needs them
    engine.attach(model)
    engine.begin_step(n)
    out = model(x)
    per_example = ((out - y) ** 2).mean((1, 2))
    per_example.mean().backward(retain_graph=True)
    got = engine.clip_and_sum(params, float("inf"))
    engine.detach()
    # reference: example i's gradient through the SAME graph (the same dropout masks)
    ref = [torch.autograd.grad(per_example[i], params, retain_graph=True, allow_unused=True) for i in range(n)]
    ref_norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in r if g is not None)) for r in ref])
    torch.testing.assert_close(got.norms, ref_norms, rtol=1e-6, atol=1e-9)
    for k, p in enumerate(params):
        torch.testing.assert_close(got.sums[p], sum(r[k] for r in ref), rtol=1e-6, atol=1e-9)


def test_the_dropout_masks_matter():
    """Without replaying the random state the recomputed masks differ (so the test above can fail)."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(6, 2, dropout=0.5, batch_first=True).double().train()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    a, _ = attn(x, x, x)
    b, _ = attn(x, x, x)
    assert not torch.allclose(a, b)
