"""Shared models and the brute-force reference for the per-example engine tests.

The reference follows docs/algorithms.md "The mechanism" literally: one backward per example,
scale, clip with ``clip_factors``, sum.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.grad_sample.base import ClippedBatch, GradSampleEngine, clip_factors


class SmallCNN(nn.Module):
    """Conv2d + GroupNorm + Linear, 1×8×8 input, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.fc = nn.Linear(8 * 3 * 3, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.gn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    def __init__(self, d_in: int = 20, hidden: int = 16, out: int = 5) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, out))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Block(nn.Module):
    """Pre-LN causal self-attention block with nn.Linear projections."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.reshape(b, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, T, d)
        x = x + self.proj(y)
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class TinyLM(nn.Module):
    """Two causal blocks; token + position nn.Embedding (positions expanded to [b, T])."""

    def __init__(self, vocab: int = 32, d: int = 16, T: int = 8, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        b, T = idx.shape
        pos = torch.arange(T, device=idx.device).expand(b, T)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def cls_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


def make_case(kind: str, n: int, seed: int = 0, dtype=torch.float64):
    """(model, loss_fn, x, y) for kind in {'cnn', 'mlp', 'lm'}."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if kind == "cnn":
        model, loss = SmallCNN(), cls_loss
        x, y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)
    elif kind == "mlp":
        model, loss = MLP(), cls_loss
        x, y = torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g)
    elif kind == "lm":
        model, loss = TinyLM(), lm_loss
        x, y = torch.randint(0, 32, (n, 8), generator=g), torch.randint(0, 32, (n, 8), generator=g)
    else:
        raise ValueError(kind)
    model = model.to(dtype)
    if x.is_floating_point():
        x = x.to(dtype)
    return model, loss, x, y


def random_scale(params, seed: int = 1) -> dict[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {p: (0.2 + 2 * torch.rand(p.shape, generator=g)).to(p.dtype) for p in params}


def per_example_grads(model: nn.Module, loss_fn: Callable, x: Tensor, y: Tensor, params,
                      scale: Optional[dict] = None) -> list[list[Tensor]]:
    """Brute force: one backward per example (batch of one), then the scale."""
    out = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss_fn(model, x[i:i + 1], y[i:i + 1]), params)
        out.append([g * scale[p] for p, g in zip(params, grads)] if scale is not None else list(grads))
    return out


def reference(grads: list[list[Tensor]], params, C: float) -> ClippedBatch:
    """Clip each example's grads with ``clip_factors`` and sum (and squares, norms)."""
    sums = {p: torch.zeros_like(p) for p in params}
    squares = {p: torch.zeros_like(p) for p in params}
    norms = []
    for gi in grads:
        norm = torch.sqrt(sum(g.pow(2).sum() for g in gi))
        c = clip_factors(norm, C)
        norms.append(norm)
        for p, g in zip(params, gi):
            sums[p] += c * g
            squares[p] += (c * g) ** 2
    return ClippedBatch(sums, squares, torch.stack(norms) if norms else torch.zeros(0), len(grads))


def run_engine(engine: GradSampleEngine, model, loss_fn, x, y, params, C, scale=None, with_squares=True):
    """Mean loss, one ordinary backward, then the engine (as the strategy does)."""
    if x.shape[0] > 0:
        model.zero_grad()
        loss_fn(model, x, y).backward()
    return engine.clip_and_sum(params, C, scale, with_squares)


def assert_close_batch(got: ClippedBatch, ref: ClippedBatch, params, rtol: float = 1e-5) -> None:
    """Every sum / square / norm within rtol of the reference (relative to the tensor's max)."""
    assert got.batch_size == ref.batch_size
    assert got.norms.shape == ref.norms.shape
    _close(got.norms, ref.norms, rtol)
    for p in params:
        _close(got.sums[p], ref.sums[p], rtol)
        if got.square_sums is not None:
            _close(got.square_sums[p], ref.square_sums[p], rtol)


def _close(a: Tensor, b: Tensor, rtol: float) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = b.abs().max().clamp(min=1e-12) if b.numel() else 1.0
    err = (a.to(b.dtype) - b).abs().max() if b.numel() else 0.0
    assert err <= rtol * scale, f"max abs err {float(err):.3e} vs scale {float(scale):.3e}"


def trainable(model: nn.Module, freeze: bool) -> list[nn.Parameter]:
    """Trainable params; with ``freeze`` the first layer's weight and one bias are frozen."""
    if freeze:
        ps = list(model.parameters())
        ps[0].requires_grad_(False)
        ps[-1].requires_grad_(False)
    return [p for p in model.parameters() if p.requires_grad]


def check_engine(engine: GradSampleEngine, kind: str, n: int, scaled: bool, freeze: bool,
                 with_squares: bool = True, dtype=torch.float64, rtol: float = 1e-5) -> ClippedBatch:
    """Engine result equals the brute-force reference on one case; returns the engine's result.

    C is the median reference norm, so about half of the examples are clipped.
    """
    model, loss_fn, x, y = make_case(kind, n, dtype=dtype)
    params = trainable(model, freeze)
    scale = random_scale(params) if scaled else None
    grads = per_example_grads(model, loss_fn, x, y, params, scale)
    norms = reference(grads, params, float("inf")).norms
    C = float(norms.median()) if n > 1 else (float(norms[0]) / 2 if n == 1 else 1.0)
    ref = reference(grads, params, C)
    engine.attach(model)
    try:
        got = run_engine(engine, model, loss_fn, x, y, params, C, scale, with_squares)
        assert (got.square_sums is not None) == with_squares
        assert_close_batch(got, ref, params, rtol)
        return got
    finally:
        engine.detach()


def check_clipping_bound(engine: GradSampleEngine, C: float = 0.5) -> None:
    """Adding one example with a huge gradient moves the clipped sum by at most C."""
    torch.manual_seed(0)
    model, loss_fn = nn.Sequential(nn.Linear(20, 8), nn.Linear(8, 5)).double(), cls_loss
    x, y = torch.randn(5, 20, dtype=torch.float64), torch.randint(0, 5, (5,))
    params = list(model.parameters())
    engine.attach(model)
    try:
        base = run_engine(engine, model, loss_fn, x[:4], y[:4], params, C, with_squares=False)
        x2 = x.clone()
        x2[4] *= 1e4
        with torch.no_grad():
            y[4] = model(x2[4:5]).argmin()  # wrong by a mile: gradient ~ 1e4
        big = run_engine(engine, model, loss_fn, x2, y, params, C, with_squares=False)
    finally:
        engine.detach()
    assert big.norms[4] > 100 * C
    moved = torch.sqrt(sum((big.sums[p] - base.sums[p]).pow(2).sum() for p in params))
    assert moved <= C * (1 + 1e-6)
    assert moved >= 0.99 * C  # the huge example was clipped to C, not dropped
