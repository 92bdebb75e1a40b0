"""Layers that are not batch-first leaves: nn.MultiheadAttention (a unit with a child), RNNs, and
layers drawing random numbers (attention dropout), against per-example gradients of the same graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.grad_sample import make_engine


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
    _assert_per_example_exact(make_engine(engine_name), model, lambda: ((model(x) - y) ** 2).mean((1, 2)), n)


def _assert_per_example_exact(engine, model: nn.Module, per_example_loss, n: int) -> None:
    """The engine's unclipped per-example norms and sums equal each example's own gradient through the SAME
    graph (the same dropout masks): ``torch.autograd.grad`` of ``per_example_loss()[i]``."""
    params = [p for p in model.parameters()]
    if engine.name == "ghost":
        engine.skip_param_grads = False  # keep autograd's weight gradients: the reference below needs them
    engine.attach(model)
    engine.begin_step(n)
    per_example = per_example_loss()
    per_example.mean().backward(retain_graph=True)
    got = engine.clip_and_sum(params, float("inf"))
    engine.detach()
    ref = [torch.autograd.grad(per_example[i], params, retain_graph=True, allow_unused=True) for i in range(n)]
    ref_norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in r if g is not None)) for r in ref])
    torch.testing.assert_close(got.norms, ref_norms, rtol=1e-6, atol=1e-9)
    for k, p in enumerate(params):
        torch.testing.assert_close(got.sums[p], sum(r[k] for r in ref if r[k] is not None), rtol=1e-6, atol=1e-9)


def test_the_dropout_masks_matter():
    """Without replaying the random state the recomputed masks differ (so the test above can fail)."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(6, 2, dropout=0.5, batch_first=True).double().train()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    a, _ = attn(x, x, x)
    b, _ = attn(x, x, x)
    assert not torch.allclose(a, b)


class EncoderDecoder(nn.Module):
    """torch's whole ``nn.Transformer`` (encoder and decoder stacks: self-attention, cross-attention on the
    encoder's memory, a causal target mask, a key padding mask on the memory) with dropout everywhere."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.net = nn.Transformer(6, 2, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=8, dropout=0.3,
                                  batch_first=batch_first)

    def forward(self, src, tgt, pad):  # [B, S, 6], [B, T, 6], [B, S] bool
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=src.dtype)
        if not self.batch_first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        out = self.net(src, tgt, tgt_mask=mask, memory_key_padding_mask=pad, tgt_is_causal=True)
        return out if self.batch_first else out.transpose(0, 1)


class DecoderOnly(nn.Module):
    """``nn.TransformerDecoderLayer`` alone, its memory a learned projection of the input (two modules feed it)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.memory = nn.Linear(6, 6)
        self.dec = nn.TransformerDecoderLayer(6, 3, dim_feedforward=8, dropout=0.4, batch_first=batch_first,
                                              norm_first=True)

    def forward(self, src, tgt, pad):
        memory = self.memory(src)
        if not self.batch_first:
            memory, tgt = memory.transpose(0, 1), tgt.transpose(0, 1)
        out = self.dec(tgt, memory, memory_key_padding_mask=pad)
        return out if self.batch_first else out.transpose(0, 1)


@pytest.mark.parametrize("engine_name", ["ghost", "vmap", "opacus_hooks"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("make", [EncoderDecoder, DecoderOnly], ids=["nn.Transformer", "TransformerDecoderLayer"])
def test_encoder_decoder_attention_is_exact(make, batch_first, engine_name):
    """Decoder layers (self- and cross-attention, the memory from another module) with dropout, both layouts:
    each example's gradient equals its own backward through the same graph (the same dropout masks)."""
    torch.manual_seed(1)
    model = make(batch_first).double().train()
    n = 3
    src, tgt = torch.randn(n, 4, 6, dtype=torch.float64), torch.randn(n, 5, 6, dtype=torch.float64)
    pad = torch.zeros(n, 4, dtype=torch.bool)
    pad[0, -1] = pad[2, -2:] = True  # examples with padded memory positions
    engine = make_engine(engine_name)
    problems = engine.unsupported_layers(model)
    if problems:
        pytest.skip(f"{engine_name} refuses: {problems}")
    _assert_per_example_exact(engine, model, lambda: (model(src, tgt, pad) ** 2).mean((1, 2)), n)
