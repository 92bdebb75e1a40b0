"""An adversarial zoo: LightningModules written the ways users write them, each of which breaks one
assumption of per-example clipping, and the harness that judges them.

The verdict for every model is one of two: EXACT (one private step with zero noise, q = 1 and
SGD(lr = 1) moves the parameters by exactly −Σ_i clip_C(g_i)/B, g_i from a per-example loop) or
REFUSED (a PrivacyConfigurationError before the first release; parameters untouched). Anything
else is the silent failure the library exists to prevent. Grow this file with every bug class.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

import pytorch_lightning as pl
import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from lightning_dp import DPStrategy
from lightning_dp.losses import per_example_token_mean
from lightning_dp.privacy.noise import NoiseMechanism
from lightning_dp.validators.probe import gradients_of

V, T, D, N = 11, 5, 6, 6  # vocabulary, tokens, width, examples


class ZeroNoise(NoiseMechanism):
    """σ > 0 for the strategy's checks, but the draw is zero: the update is the clipped sum itself."""

    def sample(self, like: Sequence[Tensor]) -> list[Tensor]:
        return [torch.zeros_like(t) for t in like]


class Base(pl.LightningModule):
    """SGD(lr=1) on ``self.loss(batch)``; subclasses define the model and the loss."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


# ---------------------------------------------------------------- token models
def token_data(seed: int = 0, pad: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (N, T), generator=g)
    y = torch.randint(0, V, (N, T), generator=g)
    if pad:  # examples of lengths 1..T: the batch's non-pad count differs from any one example's
        for i in range(N):
            y[i, 1 + i % T:] = -100
    return TensorDataset(x, y)


class FlattenedTokens(Base):
    """Layers see [B·T, d]: ``self.emb(x.reshape(-1))`` and ``self.head(h.view(-1, d))``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = torch.tanh(self.emb(x.reshape(-1)))
        return F.cross_entropy(self.head(h.view(-1, D)), y.reshape(-1))


class FlattenedHeadOnly(Base):
    """Batch-first embedding, but the output layer sees [B·T, d] (the usual LM head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = torch.tanh(self.emb(x))
        return F.cross_entropy(self.head(h.reshape(-1, D)), y.reshape(-1))


class TimeMajorInside(Base):
    """The model transposes to [T, B, d] before its layers (an RNN-style habit)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = self.emb(x.t())  # [T, B, D]
        h = torch.tanh(self.mix(h))
        return F.cross_entropy(self.head(h).permute(1, 2, 0), y)


def time_major_collate(examples):
    x, y = default_collate(examples)
    return x.t().contiguous(), y.t().contiguous()


class TimeMajorBatch(Base):
    """The collate gives [T, B]; the model is written for it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch  # [T, B]
        return F.cross_entropy(self.head(torch.tanh(self.emb(x))).permute(1, 2, 0), y.t())


class TimeMajorBatchTransposed(Base):
    """The collate gives [T, B]; the model transposes to batch-first before any layer (valid)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = (t.t() for t in batch)  # [B, T]
        return per_example_token_mean(self.head(torch.tanh(self.emb(x))), y)


class BatchTokenMean(Base):
    """The usual padded LM loss: a token mean normalised by the batch's non-pad count."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def logits(self, x):
        return self.head(torch.tanh(self.emb(x)))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.logits(x).reshape(-1, V), y.reshape(-1), ignore_index=-100)


class PerExampleTokenMean(BatchTokenMean):
    """The fix: each example averaged over its own tokens (lightning_dp.per_example_token_mean)."""

    def loss(self, batch):
        x, y = batch
        return per_example_token_mean(self.logits(x), y)


class PerExampleVector(BatchTokenMean):
    """The fix, returned as the [B] vector of per-example losses."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return per_example_token_mean(self.logits(x), y)


class FunctionalTying(Base):
    """Weight tying by a functional call outside the embedding's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)

    def loss(self, batch):
        x, y = batch
        h = torch.tanh(self.emb(x))
        return F.cross_entropy(F.linear(h, self.emb.weight).permute(0, 2, 1), y)


class SlicedPositionTable(Base):
    """A position table's weight read outside the embedding (``self.pos.weight[:T]``, never ``self.pos(…)``),
    added to the batch; DeBERTa-v2 reads ``rel_embeddings.weight`` and projects it the same way. ``also_called``:
    the same table looked up besides (two kinds of use in one step: refused)."""

    def __init__(self, also_called: bool = False) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, D), nn.Embedding(T + 2, D), nn.Linear(D, V)
        self.also_called = also_called

    def loss(self, batch):
        x, y = batch
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        if self.also_called:
            h = h + self.pos(torch.zeros_like(x))
        return F.cross_entropy(self.head(torch.tanh(h)).permute(0, 2, 1), y)


class CellLoop(Base):
    """``nn.RNNCell``/``GRUCell``/``LSTMCell`` stepped in a Python loop over time, the first call without a state
    (the cell makes its zeros from the input's size)."""

    def __init__(self, kind: str = "LSTMCell") -> None:
        super().__init__()
        self.emb, self.cell, self.head = nn.Embedding(V, D), getattr(nn, kind)(D, 8), nn.Linear(8, V)

    def loss(self, batch):
        x, y = batch
        state, outs = None, []
        for t in range(x.shape[1]):
            state = self.cell(self.emb(x[:, t]), state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return per_example_token_mean(self.head(torch.stack(outs, 1)), y)


class EmbeddingMetadataRead(Base):
    """An embedding used through its forward, its weight also read for its device and shape only (peft's prompt
    tuning: ``.to(embedding.weight.device)``): no gradient flows through those reads."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = self.tok(x.to(self.tok.weight.device)) * (self.tok.weight.shape[1] ** -0.5)
        return F.cross_entropy(self.head(torch.tanh(h)).permute(0, 2, 1), y)


class ModuleTying(Base):
    """Weight tying the supported way: an nn.Linear whose weight is the embedding's Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.head(torch.tanh(self.emb(x))).permute(0, 2, 1), y)


class FlattenedMLP(Base):
    """OPT style: ``h.reshape(-1, d)`` before fc1, fc2 on fc1's activation (a new tensor: matched by row
    count to fc1's verified flattening), reshaped back for the head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc1, self.fc2, self.head = nn.Embedding(V, D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D), \
            nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = self.emb(x)
        flat = h.reshape(-1, D)
        h = h + self.fc2(torch.relu(self.fc1(flat))).view(h.shape)
        return F.cross_entropy(self.head(h).permute(0, 2, 1), y)


class FlattenedCopy(Base):
    """Flattens a slice of the batch (``x[:, 1:].reshape(-1)`` copies): the rows are no verified view."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = torch.tanh(self.emb(x[:, 1:].reshape(-1)))
        return F.cross_entropy(self.head(h), y[:, 1:].reshape(-1))


class FlattenedThenTimeMajor(Base):
    """Attack on the row-count match: a verified flatten (B·T rows, example-major) for the embedding, then
    the head on a *time-major* flatten with the same row count. Grouping the head's rows by count would
    clip mixtures of examples; the probe must refuse it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = torch.tanh(self.emb(x.reshape(-1))).view(*x.shape, D)
        logits = self.head(h.transpose(0, 1).reshape(-1, D))  # rows (t, b): time-major
        return F.cross_entropy(logits, y.t().reshape(-1))


class MultipleChoice(Base):
    """Hugging Face multiple-choice heads: [B, K, T] choices flattened to [B·K, T] before the encoder,
    and a [1, T] position lookup broadcast over the B·K rows."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.score = nn.Embedding(V, D), nn.Embedding(T, D), nn.Linear(D, 1)

    def loss(self, batch):
        x, y = batch
        choices = torch.stack([x, x.flip(1), (x + 1) % V], 1)  # [B, 3, T]
        flat = choices.view(-1, T)
        h = torch.tanh(self.tok(flat) + self.pos(torch.arange(T, device=x.device)[None]))
        scores = self.score(h.mean(1)).view(-1, 3)
        return F.cross_entropy(scores, y[:, 0] % 3)


class BroadcastPositions(Base):
    """Hugging Face style: a [1, T] position lookup broadcast over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, D), nn.Embedding(T, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device)[None])
        return F.cross_entropy(self.head(torch.tanh(h)).permute(0, 2, 1), y)


class UnbatchedPositions(Base):
    """``pos(torch.arange(T))``: a lookup with no batch dimension at all, added to [B, T, d] (broadcast site)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, D), nn.Embedding(T, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return F.cross_entropy(self.head(torch.tanh(h)).permute(0, 2, 1), y)


class RelativeBias(Base):
    """T5 style: a [T, T] bucket lookup permuted to [1, H, T, T], reused by two attention layers (two sites),
    once added out of place and once in place (``scores += bias``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.bias, self.head = nn.Embedding(V, D), nn.Embedding(2 * T, 2), nn.Linear(D, V)
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)

    def attend(self, h, bias, in_place):
        q, k = self.q(h).view(*h.shape[:2], 2, D // 2).transpose(1, 2), self.k(h).view(*h.shape[:2], 2, D // 2)
        scores = q @ k.permute(0, 2, 3, 1)  # [B, 2, T, T]
        if in_place:
            scores += bias
        else:
            scores = scores + bias
        return h + (scores.softmax(-1) @ h.unsqueeze(1)).mean(1)

    def loss(self, batch):
        x, y = batch
        t = torch.arange(x.shape[1], device=x.device)
        bias = self.bias(t[None, :] - t[:, None] + T).permute(2, 0, 1).unsqueeze(0)
        h = self.attend(self.attend(self.tok(x), bias, False), bias, True)
        return F.cross_entropy(self.head(h).permute(0, 2, 1), y)


class UnbatchedRegulariser(Base):
    """The lookup's output also enters the loss without being broadcast over the examples (a penalty): the
    examples' gradients at the broadcast sites do not add up to the output's gradient; refused."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, D), nn.Embedding(T, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        p = self.pos(torch.arange(x.shape[1], device=x.device))
        h = self.tok(x) + p
        return F.cross_entropy(self.head(torch.tanh(h)).permute(0, 2, 1), y) + 0.1 * p.pow(2).sum()


class TorchAttention(Base):
    """nn.MultiheadAttention as users call it: time-major by default, a causal [T, T] mask, keywords."""

    def __init__(self, batch_first: bool = False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=batch_first)

    def loss(self, batch):
        x, y = batch
        h = self.emb(x)
        h = h if self.batch_first else h.transpose(0, 1)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        out, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        out = out if self.batch_first else out.transpose(0, 1)
        return per_example_token_mean(self.head(torch.tanh(out)), y)


class TorchEncoderLayer(Base):
    """nn.TransformerEncoderLayer (batch_first=False default: time-major inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.enc = nn.TransformerEncoderLayer(D, 2, dim_feedforward=8, dropout=0.0)  # dropout: test_units.py

    def loss(self, batch):
        x, y = batch
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=x.device, dtype=self.emb.weight.dtype)
        h = self.enc(self.emb(x).transpose(0, 1), src_mask=mask)
        return per_example_token_mean(self.head(h.transpose(0, 1)), y)


class TorchRecurrent(Base):
    """nn.LSTM / nn.GRU / nn.RNN, classifying from the last hidden state (h_n is [L, B, H] always)."""

    def __init__(self, kind: str = "LSTM", batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.rnn = getattr(nn, kind)(D, D, num_layers=2, batch_first=batch_first)

    def loss(self, batch):
        x, y = batch
        h = self.emb(x) if self.batch_first else self.emb(x).transpose(0, 1)
        out, hidden = self.rnn(h)
        last = (hidden[0] if isinstance(hidden, tuple) else hidden)[-1]  # [B, H]
        return F.cross_entropy(self.head(torch.tanh(last)), y[:, 0])


def feature_sequence_data(seed: int = 0) -> TensorDataset:
    """Sequences of real-valued features ``[N, T, D]`` (sensor readings, audio frames): nothing learned before the
    first layer."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, T, D, generator=g), torch.randint(0, 3, (N,), generator=g))


class RecurrentOnFeatures(Base):
    """nn.LSTM / nn.GRU / nn.RNN as the first layer, on the data itself: no input of the call requires grad (the
    ghost engine once ran such a call on detached weights, so no gradient reached it and its weights were refused
    as 'used where the engine does not capture'). ``state``: a learned initial state, the only input needing grad."""

    def __init__(self, kind: str = "LSTM", batch_first: bool = True, state: bool = False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn, self.head = getattr(nn, kind)(D, D, num_layers=2, batch_first=batch_first), nn.Linear(D, 3)
        self.h0 = nn.Parameter(0.1 * torch.randn(2, 1, D)) if state else None

    def loss(self, batch):
        x, y = batch
        hx = None if self.h0 is None else self.h0.expand(-1, x.shape[0], -1).contiguous()
        if hx is not None and isinstance(self.rnn, nn.LSTM):
            hx = (hx, torch.zeros_like(hx))
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1), hx)
        last = out[:, -1] if self.batch_first else out[-1]
        return F.cross_entropy(self.head(last), y)


class _TutorialAttentionBlock(nn.Module):
    """Lightning's ViT tutorial block, time-major: ``nn.MultiheadAttention`` at torch's default ``batch_first=False``
    and the plain ``LayerNorm``/``Linear`` layers around it on ``[T, B, d]``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.layer_norm_1, self.layer_norm_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2)
        self.linear = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(0.0), nn.Linear(hidden, dim),
                                    nn.Dropout(0.0))

    def forward(self, x):
        inp_x = self.layer_norm_1(x)
        x = x + self.attn(inp_x, inp_x, inp_x)[0]
        return x + self.linear(self.layer_norm_2(x))


class TutorialViT(Base):
    """A tutorial Vision Transformer on feature patches ``[B, T, d]``: a patch embedding, a class token
    ``repeat(B, 1, 1)``-ed, a learned position table, then ``x.transpose(0, 1)`` and time-major blocks; the head reads
    ``x[0]``. ``cls``: with the class token the sequence has T + 1 = 6 = N positions, so dimension 0 and dimension 1
    of every block's activations both have the step's n (the layout is told apart from autograd's record alone)."""

    def __init__(self, cls: bool = True) -> None:
        super().__init__()
        self.cls = cls
        self.input_layer = nn.Linear(D, D)
        self.blocks = nn.Sequential(_TutorialAttentionBlock(D, 8), _TutorialAttentionBlock(D, 8))
        self.mlp_head = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 3))
        self.cls_token = nn.Parameter(0.5 * torch.randn(1, 1, D))
        self.pos_embedding = nn.Parameter(0.5 * torch.randn(1, T + 1, D))
        self.dropout = nn.Dropout(0.0)

    def loss(self, batch):
        x, y = batch
        h = self.input_layer(x)
        if self.cls:
            h = torch.cat([self.cls_token.repeat(h.shape[0], 1, 1), h], dim=1)
        h = self.dropout(h + self.pos_embedding[:, : h.shape[1]])
        h = self.blocks(h.transpose(0, 1))
        return F.cross_entropy(self.mlp_head(h[0] if self.cls else h.mean(0)), y)


class TimeMajorUndecided(Base):
    """One LayerNorm called time-major twice per step: on ``h.transpose(0, 1)`` (proven) and on a roll of it along time
    (``torch.roll``: an operation whose effect on the dimensions the layout walk does not follow): the second call's
    layout is not proven, and it stays refused."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm, self.head = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        h = self.proj(x).transpose(0, 1)  # [T, B, d]
        h = self.norm(h) + self.norm(torch.roll(h, 1, 0))
        return F.cross_entropy(self.head(h.mean(0)), y)


class RecurrentOutputInPlace(Base):
    """The RNN's output changed in place (``out.mul_(s)``, ``F.relu(out, inplace=True)``): torch's CPU backward allows
    it, and the values the engine keeps of the output (the unrolled rule reads the last layer's) must not change with
    it. They once shared the storage of the alias the capture hands the model: refused by the probe."""

    def __init__(self, kind: str = "LSTM", how: str = "mul_") -> None:
        super().__init__()
        self.how = how
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.rnn = getattr(nn, kind)(D, D, num_layers=2, batch_first=True)

    def loss(self, batch):
        x, y = batch
        out, _ = self.rnn(self.emb(x))
        out = out.mul_(2.0) if self.how == "mul_" else F.relu(out, inplace=True)
        return per_example_token_mean(self.head(out), y)


class Parametrized(Base):
    """A weight computed from its originals by ``torch.nn.utils.parametrizations`` (the trainable tensors are
    ``parametrizations.weight.original0``/``original1``): ``kind`` ``weight_norm`` on a Linear, on a grouped Conv1d
    along its kernel dimension (Hugging Face wav2vec2/HuBERT's positional convolution), ``orthogonal`` on a Linear.
    Once refused for every engine. (An RNN with a parametrized weight is served too, by one backward per example, but
    cannot be deep-copied — its weight list holds the computed tensor — as the harness's reference does.)"""

    def __init__(self, kind: str = "linear") -> None:
        super().__init__()
        from torch.nn.utils import parametrizations as P

        self.kind = kind
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        if kind == "linear":
            self.mid: nn.Module = P.weight_norm(nn.Linear(D, D))
        elif kind == "conv":
            self.mid = P.weight_norm(nn.Conv1d(D, D, 3, padding=1, groups=2), name="weight", dim=2)
        else:
            self.mid = P.orthogonal(nn.Linear(D, D))

    def loss(self, batch):
        x, y = batch
        h = self.emb(x)
        h = self.mid(h.transpose(1, 2)).transpose(1, 2) if self.kind == "conv" else self.mid(h)
        return per_example_token_mean(self.head(torch.tanh(h)), y)


class _ScaledTable(nn.Module):
    """A layer that reads a table handed to it as an attribute (not an argument) and returns a view of its scaled copy:
    its output is followed through the table, and the capture hands the model an alias of that view."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(D))
        self.table: Optional[Tensor] = None

    def forward(self) -> Tensor:
        assert self.table is not None  # set by the model before each call (the engines' replays see it too)
        return (self.table * self.scale)[:, :D]


class TableThroughAnAttribute(Base):
    """``pos(arange(T))`` handed to a second layer as an attribute, whose output (a view, aliased by the capture) is
    added to every example: the alias must stay followed to the position table (the capture records calls with the
    broadcast sites' mode set aside, and carries the outputs' sources over to the aliases)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos, self.scaled, self.head = nn.Embedding(V, D), nn.Embedding(T, D), _ScaledTable(), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        self.scaled.table = self.pos(torch.arange(x.shape[1], device=x.device))
        h = self.emb(x) + self.scaled()
        return per_example_token_mean(self.head(torch.tanh(h)), y)


class _Table(nn.Module):
    """A learned table handed out by a call without arguments: the output is the parameter itself (a leaf)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.3 * torch.randn(rows, D))

    def forward(self) -> Tensor:
        return self.weight


class TableWithoutArguments(Base):
    """A position table from ``self.table()`` (no arguments; the layer returns its own parameter), sliced to the
    sequence and added to every example. The hook once sat on the parameter itself and stayed there for every later
    step (crashing the next step's map-back); with ``rows`` equal to the batch size, the replay once took the table's
    rows for the examples'."""

    def __init__(self, rows: int = N) -> None:
        super().__init__()
        self.emb, self.table, self.head = nn.Embedding(V, D), _Table(rows), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = self.emb(x) + self.table()[:x.shape[1]]
        return per_example_token_mean(self.head(torch.tanh(h)), y)


class LearnedInitialState(Base):
    """nn.LSTM / nn.GRU with a learned initial state ``nn.Parameter([L, 1, H])`` broadcast over the batch in
    dimension 1 (an RNN's h0 is ``[L, B, H]`` whatever ``batch_first`` says): ``expand`` (+ ``contiguous``, as cuDNN
    wants) or ``repeat(1, B, 1)``, and with ``shared`` the same expanded state also starts a second call."""

    def __init__(self, kind: str = "LSTM", how: str = "expand", shared: bool = False) -> None:
        super().__init__()
        self.kind, self.how, self.shared = kind, how, shared
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.rnn = getattr(nn, kind)(D, D, num_layers=2, batch_first=True)
        self.h0 = nn.Parameter(torch.randn(2, 1, D) * 0.5)
        if kind == "LSTM":
            self.c0 = nn.Parameter(torch.randn(2, 1, D) * 0.5)

    def _state(self, p: Tensor, B: int) -> Tensor:
        return p.expand(-1, B, -1).contiguous() if self.how == "expand" else p.repeat(1, B, 1)

    def loss(self, batch):
        x, y = batch
        B = x.shape[0]
        hx = self._state(self.h0, B)
        hx = (hx, self._state(self.c0, B)) if self.kind == "LSTM" else hx
        out, _ = self.rnn(self.emb(x), hx)
        if self.shared:
            out = out + self.rnn(self.emb(x.flip(1)), hx)[0]
        return per_example_token_mean(self.head(torch.tanh(out)), y)


class LearnedQueries(Base):
    """DETR style: learned queries ``[Q, 1, d]`` repeated over the batch in dimension 1 (``repeat(1, B, 1)``), cross-
    attending a time-major memory through ``nn.MultiheadAttention``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.queries = nn.Parameter(torch.randn(T, 1, D) * 0.5)
        self.attn = nn.MultiheadAttention(D, 2)

    def loss(self, batch):
        x, y = batch
        memory = self.emb(x).transpose(0, 1)
        out, _ = self.attn(self.queries.repeat(1, x.shape[0], 1), memory, memory, need_weights=False)
        return per_example_token_mean(self.head(torch.tanh(out.transpose(0, 1))), y)


class LearnedTimeMajorPositions(Base):
    """A learned position table ``[T, 1, d]`` added to a time-major ``[T, B, d]`` batch before a time-major
    ``nn.TransformerEncoder``: the sum reaches the attention (a site) and, by the residual ``x + attn(x)``, the norm
    after it (another site, whose rows must not be mapped back through the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.pos = nn.Parameter(torch.randn(T, 1, D) * 0.5)
        layer = nn.TransformerEncoderLayer(D, 2, dim_feedforward=8, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def loss(self, batch):
        x, y = batch
        h = self.enc(self.emb(x).transpose(0, 1) + self.pos)
        return per_example_token_mean(self.head(h.transpose(0, 1)), y)


class PackedRecurrent(Base):
    """nn.LSTM / nn.GRU / nn.RNN on a PackedSequence (pack_padded_sequence of examples of different lengths, taken
    from the data, unsorted): exact. The loss reads h_n and, with ``on_output``, the padded output too
    (pad_packed_sequence, a token mean over each example's own steps)."""

    def __init__(self, kind: str = "LSTM", on_output: bool = False, **rnn_kwargs: Any) -> None:
        super().__init__()
        self.on_output = on_output
        self.rnn = getattr(nn, kind)(D, D, batch_first=True, **rnn_kwargs)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        if on_output:
            self.token_head = nn.Linear(D * (2 if self.rnn.bidirectional else 1), V)

    def loss(self, batch):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        x, y = batch
        lengths = (y != -100).sum(1).cpu()  # token_data(pad=True): example i has 1 + i % T steps
        out, hidden = self.rnn(pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=False))
        h = hidden[0] if isinstance(hidden, tuple) else hidden
        loss = F.cross_entropy(self.head(torch.tanh(h[-1])), y[:, 0], reduction="none")
        if self.on_output:
            padded, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
            loss = loss + per_example_token_mean(self.token_head(padded), y)
        return loss.mean()


class LengthsLSTM(nn.LSTM):
    """An ``nn.LSTM`` subclass as forecasting and speech code writes it: ``forward(x, lengths=None)`` packs inside
    (``pack_padded_sequence``) and pads the output back; ``lengths`` is ``[B]``, one per example."""

    def forward(self, x, lengths=None):  # type: ignore[override]
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        if lengths is None:
            return super().forward(x)
        total = x.shape[1 if self.batch_first else 0]
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=self.batch_first, enforce_sorted=False)
        out, hidden = super().forward(packed)
        out, _ = pad_packed_sequence(out, batch_first=self.batch_first, total_length=total)
        return out, hidden


class RecurrentWithLengths(Base):
    """:class:`LengthsLSTM` called with the lengths as a keyword tensor (or positionally), classifying from h_n and
    reading the padded output."""

    def __init__(self, batch_first: bool = True, keyword: bool = True) -> None:
        super().__init__()
        self.batch_first, self.keyword = batch_first, keyword
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.rnn = LengthsLSTM(D, D, batch_first=batch_first)

    def loss(self, batch):
        x, y = batch
        lengths = (y != -100).sum(1)  # token_data(pad=True): example i has 1 + i % T steps
        h = self.emb(x) if self.batch_first else self.emb(x).transpose(0, 1)
        out, (h_n, _) = self.rnn(h, lengths=lengths) if self.keyword else self.rnn(h, lengths)
        out = out if self.batch_first else out.transpose(0, 1)
        loss = F.cross_entropy(self.head(torch.tanh(h_n[-1])), y[:, 0], reduction="none")
        return (loss + per_example_token_mean(self.head(out), y)).mean()


class SortedPacking(Base):
    """The batch sorted by length before ``pack_padded_sequence(enforce_sorted=True)`` (the pre-1.1 torch idiom, still in
    published code); ``unsort``: the logits put back in the batch's order (``logits[order.argsort()]``), else paired
    in sorted order with the unsorted targets (a bug: example i's logits meet example j's label)."""

    def __init__(self, unsort: bool = True) -> None:
        super().__init__()
        self.unsort = unsort
        self.emb, self.rnn, self.head = nn.Embedding(V, D), nn.LSTM(D, D, batch_first=True), nn.Linear(D, V)

    def loss(self, batch):
        from torch.nn.utils.rnn import pack_padded_sequence

        x, y = batch
        lengths, order = (y != -100).sum(1).sort(descending=True)
        packed = pack_padded_sequence(self.emb(x[order]), lengths.cpu(), batch_first=True, enforce_sorted=True)
        _, (h, _) = self.rnn(packed)
        logits = self.head(torch.tanh(h[-1]))
        return F.cross_entropy(logits[order.argsort()] if self.unsort else logits, y[:, 0])


class PackedOpacusLSTM(Base):
    """``opacus.layers.DPLSTM`` on a PackedSequence: refused naming ``torch.nn.LSTM``, which is served there."""

    def __init__(self) -> None:
        super().__init__()
        from opacus.layers import DPLSTM

        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.rnn = DPLSTM(D, D, batch_first=True)

    def loss(self, batch):
        from torch.nn.utils.rnn import pack_padded_sequence

        x, y = batch
        lengths = (y != -100).sum(1).cpu()
        _, (h, _) = self.rnn(pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=False))
        return F.cross_entropy(self.head(h[-1]), y[:, 0])


class PhysicsInformed(Base):
    """A physics-informed loss: u = net(t) and the residual of du/dt = cos(t), du/dt by
    ``torch.autograd.grad(u, t, create_graph=True)`` (a double backward), plus a data term."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))

    def loss(self, batch):
        x, y = batch
        t = x[:, :1].clone().requires_grad_(True)
        u = self.net(t)
        du = torch.autograd.grad(u.sum(), t, create_graph=True)[0]
        return ((du - torch.cos(t)) ** 2).mean() + ((u - y[:, None].to(u.dtype)) ** 2).mean()


class WritesState(Base):
    """A forward that writes data-dependent state into the model, outside the gradient (released unnoised):
    ``max_norm`` (nn.Embedding renormalising the looked-up rows in place), ``activation_ema`` (a custom
    buffer tracking the batch's mean activation), ``self_renorm`` (a custom layer rescaling its own weight
    from the batch under no_grad), ``running_stats`` (nn.InstanceNorm1d(track_running_stats=True))."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, D, max_norm=0.5 if kind == "max_norm" else None)
        self.head = nn.Linear(D, V)
        self.norm = nn.InstanceNorm1d(D, track_running_stats=kind == "running_stats")
        self.register_buffer("ema", torch.zeros(D))

    def loss(self, batch):
        x, y = batch
        h = self.emb(x)  # [B, T, D]
        if self.kind == "activation_ema":
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * h.mean((0, 1)))
        if self.kind == "self_renorm":
            with torch.no_grad():
                self.head.weight.div_(1.0 + h.norm() * 1e-3)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return F.cross_entropy(self.head(h.mean(1)), y[:, 0])


class TinyViT(nn.Module):
    """timm's habit: cls_token [1, 1, d] and pos_embed [1, T+1, d] owned by the root, broadcast over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, D) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, T + 1, D) * 0.1)
        self.patch, self.norm, self.head = nn.Linear(1, D), nn.LayerNorm(D), nn.Linear(D, 3)

    def forward(self, x):  # x: [B, T] "pixels"
        h = self.patch(x.unsqueeze(-1).float().to(self.patch.weight.dtype) / V)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1) + self.pos_embed
        return self.head(self.norm(torch.tanh(h))[:, 0])


class TinyMAE(nn.Module):
    """ViTMAE / PVT habits on root-owned tokens: ``mask_token.repeat(B, k, 1)`` (copies, not a broadcast), the
    position table read twice (``pos[:, :1]`` and ``pos[:, 1:]``), resampled through ``reshape(1, h, w, -1)`` +
    ``F.interpolate`` and concatenated back before it meets the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.mask_token = nn.Parameter(torch.randn(1, 1, D) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, 1 + 4, D) * 0.1)  # cls slot + a 2×2 grid
        self.patch, self.head = nn.Linear(1, D), nn.Linear(D, 3)

    def forward(self, x):  # x: [B, T] "pixels": 2 kept, T − 2 masked
        h = self.patch(x[:, :2].unsqueeze(-1).to(self.patch.weight.dtype) / V)
        h = torch.cat([h, self.mask_token.repeat(h.shape[0], T - 2, 1)], dim=1)  # [B, T, d]
        grid = self.pos[:, 1:].reshape(1, 2, 2, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(1, T - 1), mode="bilinear").reshape(1, D, T - 1).permute(0, 2, 1)
        pos = torch.cat([self.pos[:, :1], grid], dim=1)  # [1, T, d]
        return self.head(torch.tanh(h + pos).mean(1))


class MAEClassifier(Base):
    def __init__(self) -> None:
        super().__init__()
        self.mae = TinyMAE()

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.mae(x), y[:, 0] % 3)


class ViTClassifier(Base):
    def __init__(self) -> None:
        super().__init__()
        self.vit = TinyViT()

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.vit(x), y[:, 0] % 3)


class OpacusLSTM(Base):
    """opacus.layers.DPLSTM (what the docs once said to swap nn.LSTM for): aliases its cells' weights."""

    def __init__(self) -> None:
        super().__init__()
        from opacus.layers import DPLSTM

        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.rnn = DPLSTM(D, D, num_layers=1, batch_first=True)

    def loss(self, batch):
        x, y = batch
        out, _ = self.rnn(self.emb(x))
        return per_example_token_mean(self.head(torch.tanh(out)), y)


# ---------------------------------------------------------------- vector models
def vector_data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, 3, (N,), generator=g))


class Leaf(nn.Module):
    """A custom leaf with its own parameters and a keyword-friendly signature."""

    def __init__(self) -> None:
        super().__init__()
        # its own generator: the global one seeded 0 would draw vector_data()'s very values (N = D)
        self.w = nn.Parameter(torch.randn(D, D, generator=torch.Generator().manual_seed(7)) / D ** 0.5)
        self.b = nn.Parameter(torch.zeros(D))

    def forward(self, x: Tensor, scale: Optional[Tensor] = None) -> Tensor:
        out = x @ self.w + self.b
        return out if scale is None else out * scale


class NormOnTheData(Base):
    """``nn.RMSNorm`` over the last dimension of the raw features (an input that does not require grad), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = nn.RMSNorm(D), nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.head(self.norm(x)), y)


class KeywordLeaf(Base):
    """Leaf layers called with keyword tensors: ``self.leaf(x=h)``, ``self.lin(input=h)``."""

    def __init__(self) -> None:
        super().__init__()
        self.leaf, self.lin = Leaf(), nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        h = torch.tanh(self.leaf(x=x, scale=x.abs() + 0.5))  # a per-example keyword tensor, too
        return F.cross_entropy(self.lin(input=h), y)


class UnbatchedKeyword(Base):
    """An unbatched keyword tensor (a [D] gate shared by every example) that must not be sliced."""

    def __init__(self) -> None:
        super().__init__()
        self.leaf, self.lin = Leaf(), nn.Linear(D, 3)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, D))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.lin(torch.tanh(self.leaf(x, scale=self.gate))), y)


class CentredAcrossBatch(Base):
    """``h - h.mean(0)``: an operation mixing examples (not BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        h = self.a(x)
        return F.cross_entropy(self.b(torch.tanh(h - h.mean(0))), y)


class SummedLoss(Base):
    """``reduction='sum'``: every per-example gradient scales with the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.a(x), y, reduction="sum")


class RootParameter(Base):
    """A parameter read directly in a parent module's forward (timm's cls_token habit)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(D))
        self.a = nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.a(x + self.bias), y)


class LayerScale(Base):
    """ConvNeXt / CaiT style: a [d] scale owned by a block with children, multiplying the branch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 3)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.b(x + self.gamma * torch.tanh(self.a(x))), y)


class BiasTable(Base):
    """Swin style: a relative position bias *table* owned by the attention block, indexed with a [T·T] buffer,
    viewed as [T, T, H], permuted and added to the scores of every example."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.v, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
        self.table = nn.Parameter(torch.randn(2 * T - 1, 2) * 0.1)
        t = torch.arange(T)
        self.register_buffer("index", (t[None, :] - t[:, None] + T - 1).reshape(-1))

    def loss(self, batch):
        x, y = batch
        h = self.tok(x)
        bias = self.table[self.index].view(T, T, 2).permute(2, 0, 1).unsqueeze(0)  # [1, 2, T, T]
        scores = (h @ h.transpose(1, 2)).unsqueeze(1) + bias  # [B, 2, T, T]
        h = h + (scores.softmax(-1) @ self.v(h).unsqueeze(1)).mean(1)
        return F.cross_entropy(self.head(h).permute(0, 2, 1), y)


class CoordinateBias(Base):
    """Swin V2's continuous position bias: an MLP (Linear, ReLU — in place or not —, Linear) over a fixed [1, T, T, 2]
    coordinate table, both Linears called without the examples (the second on the first's output), the result
    added to every example's scores."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.tok, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.mlp = nn.Sequential(nn.Linear(2, 8), nn.ReLU(inplace=inplace), nn.Linear(8, 1, bias=False))
        self.register_buffer("coords", torch.linspace(-1, 1, T * T * 2).reshape(1, T, T, 2))

    def loss(self, batch):
        x, y = batch
        h = self.tok(x)
        bias = 16 * torch.sigmoid(self.mlp(self.coords).view(T, T))
        h = h + ((h @ h.transpose(1, 2)) + bias.unsqueeze(0)).softmax(-1) @ h
        return F.cross_entropy(self.head(h).permute(0, 2, 1), y)


class _TrainOnlyMix(nn.Module):
    """Parameter-free: in training mode only, blends each example with the batch reversed (timm VOLO's mix_token,
    CutMix inside the model)."""

    def forward(self, h: Tensor) -> Tensor:
        return h + 0.5 * h.flip(0) if self.training else h


class TrainOnlyMixing(Base):
    """Examples mixed only in training mode: the probe must run the model in the step's modes to see it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, D), nn.Tanh(), _TrainOnlyMix(), nn.Linear(D, 3))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.net(x), y)


class _CachedBias(nn.Module):
    """LeViT/EfficientFormer/TinyViT: an attention bias gathered from a parameter table, cached in eval mode (the cache
    keeps its graph: a second backward through it fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(D) * 0.3)
        self.proj = nn.Linear(D, D)
        self.cache: dict[str, Tensor] = {}

    def bias(self) -> Tensor:
        if self.training:
            return self.table * 2.0
        if "b" not in self.cache:
            self.cache["b"] = self.table * 2.0
        return self.cache["b"]

    def forward(self, h: Tensor) -> Tensor:
        return self.proj(h) + self.bias()


class EvalCache(Base):
    """A block that caches in eval mode (and drops the cache on train()), trained in training mode: exact; the probe
    must not switch it to eval."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = _CachedBias(), nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.head(torch.tanh(self.block(x))), y)


class TokensAfterBatchNorm(Base):
    """XCiT's stem: a convolution, a batch norm kept in eval (affine trained), then ``flatten(2).transpose(1, 2)`` to
    tokens: at one example the norm's output gradient arrives channels-last with a short batch stride, which torch
    2.13's CPU batch-norm backward gets wrong (capture._contiguous_output_grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, D, 2, stride=2), nn.BatchNorm2d(D), nn.Linear(D, 3)

    def on_train_epoch_start(self) -> None:
        self.norm.eval()

    def loss(self, batch):
        x, y = batch
        tokens = self.norm(self.conv(x)).flatten(2).transpose(1, 2)  # [B, 4, D]
        return F.cross_entropy(self.head(torch.tanh(tokens)).mean(1), y)


class _BiasLeaf(nn.Module):
    """timm MaxViT's RelPosBias: a leaf owning a relative-position table, read by its own ``get_bias`` method, which
    the parent calls instead of the leaf's forward (its fused attention takes the bias as ``attn_mask``)."""

    def __init__(self, heads: int, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.table = nn.Parameter(torch.randn(2 * tokens - 1, heads) * 0.5)
        idx = torch.arange(tokens)
        self.register_buffer("index", (idx[:, None] - idx[None, :] + tokens - 1).flatten(), persistent=False)

    def get_bias(self) -> Tensor:
        return self.table[self.index].view(self.tokens, self.tokens, -1).permute(2, 0, 1).unsqueeze(0)

    def forward(self, scores: Tensor) -> Tensor:
        return scores + self.get_bias()


class BiasByMethod(Base):
    """Attention whose relative bias comes from a leaf's method, not its forward (``fused``: the bias goes to
    ``scaled_dot_product_attention`` as ``attn_mask``; else the leaf's forward adds it to the scores). ``both``: the
    method and the forward in one step (mixed use: refused)."""

    def __init__(self, fused: bool = True, both: bool = False) -> None:
        super().__init__()
        self.fused, self.both = fused, both
        self.emb, self.qkv, self.head = nn.Embedding(V, 4), nn.Linear(4, 12), nn.Linear(4, V)
        self.rel = _BiasLeaf(2, T)

    def loss(self, batch):
        x, y = batch
        q, k, v = self.qkv(self.emb(x)).view(x.shape[0], T, 3, 2, 2).permute(2, 0, 3, 1, 4)
        if self.fused:
            h = F.scaled_dot_product_attention(q, k, v, attn_mask=self.rel.get_bias())
        else:
            h = torch.softmax(self.rel(q @ k.transpose(-1, -2)), -1) @ v
        if self.both:
            h = h + self.rel(torch.zeros_like(h[..., :1]).expand(-1, -1, -1, T))[..., :2] * 0.1
        return F.cross_entropy(self.head(h.transpose(1, 2).reshape(x.shape[0], T, 4)).flatten(0, 1), x.flatten())


class WindowCopy(Base):
    """timm's window partition (SwinV2, MobileViT's patch unfold): tokens ``[B, 4, d]`` regrouped into windows by a
    reshape that has to copy, ``h.view(B, 2, 2, d).transpose(1, 2).reshape(B·2, 2, d)``, a layer on the windows, then
    back. Verified by autograd's record of the copy (validators/example_dim.reshaped_copy_of_examples). With
    ``time_major`` the batch dimension is moved before flattening, ``h.transpose(0, 1).reshape(4·B, d)``: example-minor
    rows, proven from the record (validators/example_layout.example_minor_rows); ``opaque``: the tokens pass through
    ``torch.roll`` first, whose effect on the dimensions the walk does not follow: refused."""

    def __init__(self, time_major: bool = False, opaque: bool = False) -> None:
        super().__init__()
        self.time_major, self.opaque = time_major, opaque
        self.emb, self.inner, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = self.emb(x)
        b, h = x.shape[0], (torch.roll(h, 1, 1) if self.opaque else h)[:, :4]
        if self.time_major:
            out = torch.tanh(self.inner(h.transpose(0, 1).reshape(4 * b, D))).view(4, b, D).transpose(0, 1)
        else:
            windows = h.view(b, 2, 2, D).transpose(1, 2).reshape(b * 2, 2, D)
            out = torch.tanh(self.inner(windows)).view(b, 2, 2, D).transpose(1, 2).reshape(b, 4, D)
        return F.cross_entropy(self.head(out).transpose(1, 2), y[:, :4])


class StackedSpeakers(Base):
    """A dual-path separator (JusperLee's Dual-Path-RNN, asteroid's DPRNN) in small: an encoder ``Conv1d`` on the
    waveform, chunks ``[B·S, K, C]`` through an intra-chunk LSTM and a ``GroupNorm`` on the flattened rows
    ``[B·S, C, K]``, a ``Conv1d`` making two speakers' channels, then
    ``torch.stack(chunk(h, 2, 1), 0).view(2·B, C, L)`` (speaker-major rows: example b owns rows b and B + b) into the
    output ``Conv1d``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.rnn = nn.Conv1d(1, 4, 2), nn.LSTM(4, 4, batch_first=True)
        self.norm, self.split, self.end = nn.GroupNorm(1, 4), nn.Conv1d(4, 8, 1), nn.Conv1d(4, 1, 3, padding=1)

    def forward(self, wave):  # [B, L]
        h = torch.relu(self.enc(wave.unsqueeze(1)))  # [B, C, 8]
        b, c, length = h.shape
        chunks = h.view(b, c, 2, length // 2).permute(0, 2, 3, 1).reshape(b * 2, length // 2, c)  # [B·S, K, C]
        out, _ = self.rnn(chunks)
        out = self.norm(out.transpose(1, 2).contiguous())  # [B·S, C, K]
        h = h + out.view(b, 2, c, length // 2).permute(0, 2, 1, 3).reshape(b, c, length)
        h = torch.stack(torch.chunk(self.split(h), 2, dim=1), 0)  # [2, B, C, L]
        return torch.sigmoid(self.end(h.view(2 * b, c, length)).view(2, b, length))

    def loss(self, batch):
        x, y = batch
        return ((self(x).mean(2).transpose(0, 1) - y) ** 2).mean()


def waveform_data(seed: int = 0) -> TensorDataset:
    """Waveforms ``[N, 9]`` and two speakers' targets ``[N, 2]``."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, 9, generator=g), torch.rand(N, 2, generator=g))


class ConvOnATable(Base):
    """A ``Conv1d`` called on a fixed table without the examples (a filterbank template ``[3, 2, L]``), its output
    added to every example's features: a lookup served at the broadcast site, replayed per example on the table as it
    was called (a ``Conv1d`` takes no extra leading dimension)."""

    def __init__(self) -> None:
        super().__init__()
        self.bank, self.head = nn.Conv1d(2, 2, 3, padding=1), nn.Linear(2 * T, 3)
        self.register_buffer("template", torch.linspace(-1, 1, 6 * T).view(3, 2, T))

    def loss(self, batch):
        x, y = batch  # x [B, T, D]
        filtered = self.bank(self.template)  # [3, 2, T]: no example dimension
        h = x[:, :, :3].transpose(1, 2).unsqueeze(2) * filtered  # [B, 3, 2, T]: the table broadcast over the batch
        return F.cross_entropy(self.head(torch.tanh(h.sum(1)).flatten(1)), y)


class PooledHeads(Base):
    """timm MViTv2's attention pooling: heads split, the cls token sliced off, the grid reshaped to images per head,
    ``q[:, :, 1:].reshape(-1, 2, 2, d).permute(0, 3, 1, 2).contiguous()`` (a reshape whose input has the examples in
    dimension 0, then ops that keep dimension 0: verified from autograd's record), a depthwise conv on ``[B·heads, d,
    2, 2]``, and back."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.q, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
        self.pool = nn.Conv2d(D // 2, D // 2, 3, padding=1, groups=D // 2)

    def loss(self, batch):
        x, y = batch
        b = x.shape[0]
        q = self.q(self.emb(x)).view(b, T, 2, D // 2).transpose(1, 2)  # [B, heads, 1 + 2·2, d]
        cls, grid = q[:, :, :1], q[:, :, 1:]
        images = grid.reshape(-1, 2, 2, D // 2).permute(0, 3, 1, 2).contiguous()  # [B·heads, d, 2, 2]
        pooled = self.pool(images).reshape(b, 2, D // 2, 4).transpose(2, 3)
        out = torch.cat([cls, pooled], 2).transpose(1, 2).reshape(b, T, D)
        return per_example_token_mean(self.head(torch.tanh(out)), y)


class DecomposedRelPos(Base):
    """timm MViTv2 / SAM's decomposed relative position bias: a table owned by the attention (a container), indexed by
    the query-key distance to ``[h, k, c]`` and contracted with the queries in ``torch.einsum("byhwc,hkc->byhwk", q,
    Rh)``; ``flattened``: the queries as ``[B·heads, h, w, c]`` from ``qkv.reshape(2, B·heads, N, c).unbind(0)`` (SAM)
    instead of ``[B, heads, h, w, c]`` (MViTv2).
    ``pooled``: the contraction also sums over the batch, ``einsum("byhwc,hkc->hk", …)`` (not a site: refused)."""

    def __init__(self, flattened: bool = False, pooled: bool = False) -> None:
        super().__init__()
        self.flattened, self.pooled = flattened, pooled
        self.emb, self.qk, self.head = nn.Embedding(V, D), nn.Linear(D, 2 * D), nn.Linear(D, V)
        self.rel_pos_h = nn.Parameter(torch.randn(3, D // 2) * 0.5)  # 2·h − 1 distances, h = 2
        idx = torch.arange(2)
        self.register_buffer("dist", idx[:, None] - idx[None, :] + 1, persistent=False)

    def loss(self, batch):
        x, y = batch
        b, h = x.shape[0], self.emb(x)[:, :4]
        q, k = self.qk(h).view(b, 4, 2, 2, D // 2).permute(2, 0, 3, 1, 4)  # [B, heads, 2·2, c]
        table = self.rel_pos_h[self.dist]  # [h, k, c]
        if self.flattened:  # SAM: qkv.reshape(2, B·heads, N, c).unbind(0): rows verified back to the qk layer
            flat_q, _ = self.qk(h).view(b, 4, 2, 2, D // 2).permute(2, 0, 3, 1, 4).reshape(2, b * 2, 4, D // 2).unbind(0)
            rel = torch.einsum("bhwc,hkc->bhwk", flat_q.reshape(b * 2, 2, 2, D // 2), table).view(b, 2, 2, 2, 2)
        elif self.pooled:
            rel = torch.einsum("byhwc,hkc->hk", q.reshape(b, 2, 2, 2, D // 2), table)[:, None, :]
        else:
            rel = torch.einsum("byhwc,hkc->byhwk", q.reshape(b, 2, 2, 2, D // 2), table)
        scores = (q @ k.transpose(-1, -2)).view(b, 2, 2, 2, 2, 2) + rel[..., None]
        out = scores.view(b, 2, 4, 4).softmax(-1) @ k  # [B, heads, 4, c]
        return per_example_token_mean(self.head(out.transpose(1, 2).reshape(b, 4, D)), y[:, :4])


class RecurrentOverRows(Base):
    """timm Sequencer2d: LSTMs along the rows and the columns of a ``[B, H, W, C]`` grid, on ``[B·H, W, C]`` (a view)
    and ``[B·W, H, C]`` (a reshape that copies); the rule runs on the n·m rows and sums each example's (rnn_unrolled).
    ``h0``: the row LSTM starts from a state computed per row; ``dropout``: two layers with dropout between them in
    training (not served on flattened rows: refused)."""

    def __init__(self, kind: str = "LSTM", h0: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.h0 = h0
        layers = 2 if dropout else 1
        self.inp, self.head = nn.Linear(3, 4), nn.Linear(4, 3)
        self.rows = getattr(nn, kind)(4, 2, layers, batch_first=True, bidirectional=True, dropout=dropout)
        self.cols = getattr(nn, kind)(4, 2, layers, batch_first=True, bidirectional=True, dropout=dropout)

    def loss(self, batch):
        x, y = batch
        b, _, height, width = x.shape
        g = self.inp(x.permute(0, 2, 3, 1))  # [B, H, W, 4]
        state = None
        if self.h0:
            h = torch.tanh(g.mean(2)).reshape(b * height, 4)[None, :, :2].expand(2, -1, -1).contiguous()
            state = (h, torch.zeros_like(h)) if isinstance(self.rows, nn.LSTM) else h
        rows, _ = self.rows(g.reshape(b * height, width, 4), state)
        cols, _ = self.cols(g.permute(0, 2, 1, 3).reshape(b * width, height, 4))
        grid = rows.reshape(b, height, width, -1) + cols.reshape(b, width, height, -1).transpose(1, 2)
        return F.cross_entropy(self.head(grid).mean((1, 2)), y)


class PositionScalars(Base):
    """A learned scalar per position, ``gate(torch.arange(T))`` of shape ``[T, 1]``, scaling every example's tokens
    (SwinV2-CR's meta MLP with one head: ``[N², 1]``). Its size-1 dimension must not make the probe's examples alone
    (n = 1) take the call for a batched one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.gate, self.head = nn.Embedding(V, D), nn.Embedding(T, 1), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = self.emb(x) * torch.sigmoid(self.gate(torch.arange(x.shape[1], device=x.device)))
        return per_example_token_mean(self.head(h), y)


class ScaleNorm(nn.Module):
    """An RMSNorm written the way model libraries write theirs (not ``nn.RMSNorm``): ``kind`` picks how the weight meets
    the normalised tokens. ``plain``/``right``/``view``: ``weight ⊙ y``, ``shifted``: Gemma's ``(1 + weight) ⊙ y``
    (served by the elementwise-scale rule); ``twice``: the weight also inside y; ``negated``: ``(1 − weight) ⊙ y``
    (neither may take the rule: their gradient is not Σ_t δ ⊙ y); ``doubled``: ``2·weight ⊙ y`` (served, the 2 among
    y's factors); ``column``: the weight broadcast along the second-to-last dimension of a ``[B, D, D]`` operand
    (served, summed over the last dimension)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.weight = kind, nn.Parameter(1 + 0.3 * torch.randn(D))

    def forward(self, x: Tensor) -> Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.kind == "right":
            return y * self.weight
        if self.kind == "view":
            return self.weight.view(1, 1, -1) * y
        if self.kind == "twice":
            return self.weight * (y * self.weight.mean())
        if self.kind == "shifted":
            return (1 + self.weight) * y
        if self.kind == "negated":
            return (1 - self.weight) * y
        if self.kind == "doubled":
            return (self.weight * 2) * y
        if self.kind == "column":
            return self.weight.view(-1, 1) * (y.transpose(1, 2) @ y)
        return self.weight * y


class ScaledTokens(Base):
    """Token model with two calls of a custom RMSNorm (:class:`ScaleNorm`) around a Linear: the elementwise-scale rule
    (validators/elementwise_scale.py) must serve exactly the forms where the weight's gradient is Σ_t δ ⊙ y."""

    def __init__(self, kind: str = "plain") -> None:
        super().__init__()
        self.emb, self.norm, self.mid, self.head = nn.Embedding(V, D), ScaleNorm(kind), nn.Linear(D, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = self.norm(torch.tanh(self.mid(self.norm(self.emb(x)))))
        if h.shape[-2] != x.shape[1]:  # the [B, D, D] form: back to one vector per token
            h = h[:, :x.shape[1]] if D >= x.shape[1] else h.mean(1, keepdim=True).expand(-1, x.shape[1], -1)
        return per_example_token_mean(self.head(h), y)


class LowRankEmbedding(nn.Module):
    """PEFT's LoRA on an embedding, written out: a base table plus ``F.embedding(x, A.T) @ B.T``, the low-rank factors
    owned by the container (read in its forward, never through a layer of their own)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.base = kind, nn.Embedding(V, D)
        self.A, self.B = nn.Parameter(0.5 * torch.randn(3, V)), nn.Parameter(0.5 * torch.randn(D, 3))

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "positions":  # ids without the examples: followed on to where they are broadcast
            return self.base(x) + F.embedding(torch.arange(x.shape[1], device=x.device), self.A.T) @ self.B.T
        if self.kind == "tied":  # the base table itself read functionally (its layer never called)
            return F.embedding(x, self.base.weight) + F.embedding(x, self.A.T) @ self.B.T
        extra = {"padding": dict(padding_idx=0), "frequency": dict(scale_grad_by_freq=True)}.get(self.kind, {})
        return self.base(x) + F.embedding(x, self.A.T, **extra) @ self.B.T


class FunctionalEmbedding(Base):
    """A table looked up by ``F.embedding`` with the examples' ids (:class:`LowRankEmbedding`): a broadcast site with
    an embedding's rule (exact); ``frequency`` scales each row's gradient by the batch's counts and is refused."""

    def __init__(self, kind: str = "lora") -> None:
        super().__init__()
        self.emb, self.head = LowRankEmbedding(kind), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        x = torch.where(x % 4 == 0, torch.zeros_like(x), x)  # some ids are the padding row
        return per_example_token_mean(self.head(torch.tanh(self.emb(x))), y)


class PerFrameConv(Base):
    """A convolution per frame (video) or per patch (TNT's inner pixels): ``[B, F, C, H, W]`` flattened to
    ``[B·F, C, H, W]`` by a view. The first conv takes the ghost norm (T·(in+out) < in·out), the second
    materialises per-example gradients: example i's F frames are its positions side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.mix, self.head = nn.Conv2d(3, 32, 2, stride=2), nn.Conv2d(32, 4, 1), nn.Linear(4, 3)

    def loss(self, batch):
        x, y = batch
        h = self.mix(torch.tanh(self.conv(x.flatten(0, 1))))  # [B·F, 4, 2, 2]
        h = h.mean((2, 3)).view(x.shape[0], x.shape[1], -1).mean(1)
        return F.cross_entropy(self.head(h), y)


def frame_data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, 2, 3, 4, 4, generator=g), torch.randint(0, 3, (N,), generator=g))


def image_data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, 3, 4, 4, generator=g), torch.randint(0, 3, (N,), generator=g))


class ContainerWeight(Base):
    """A weight owned by a block with children used as the weight of ``F.linear`` (a functional linear layer: exact),
    or, with ``matmul``, multiplied with the batch from the left, ``(w @ h.t()).t()`` (no rule for it: refused;
    ``h @ w.t()`` is served like ``F.linear``: tests/grad_sample/test_parameter_containers.py)."""

    def __init__(self, matmul: bool = False) -> None:
        super().__init__()
        self.matmul = matmul
        self.a = nn.Linear(D, D)
        self.weight = nn.Parameter(torch.randn(3, D) * 0.3)

    def loss(self, batch):
        x, y = batch
        h = torch.tanh(self.a(x))
        return F.cross_entropy((self.weight @ h.t()).t() if self.matmul else F.linear(h, self.weight), y)


class FunctionalQKV(Base):
    """timm's BEiT/EVA attention: the ``qkv`` Linear is never called; its weight and a bias concatenated from two
    parameters of the block and a zero buffer go to ``F.linear`` by keyword. ``called``: the layer also runs (mixed)."""

    def __init__(self, called: bool = False) -> None:
        super().__init__()
        self.called = called
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(D) * 0.3), nn.Parameter(torch.randn(D) * 0.3)
        self.register_buffer("k_bias", torch.zeros(D), persistent=False)

    def loss(self, batch):
        x, y = batch
        h = self.emb(x)
        qkv = F.linear(input=h, weight=self.qkv.weight, bias=torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        if self.called:
            qkv = qkv + self.qkv(h)
        q, k, v = qkv.view(*h.shape[:2], 3, D).unbind(2)
        h = h + (q @ k.transpose(1, 2) / D ** 0.5).softmax(-1) @ v
        return per_example_token_mean(self.head(h), y)


class WindowedFunctionalQKV(Base):
    """timm's SwinV2 attention: tokens split into windows ``[B·2, 2, d]`` by a view, ``F.linear`` with the never-called
    ``qkv`` layer's weight on the windows, heads merged back by a reshape that copies, ``(attn @ v).transpose(1, 2)
    .reshape(B·2, 2, d)``, then the ``proj`` layer: its input's rows are the windows' (a row count verified at the
    functional call, not at a layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def loss(self, batch):
        x, y = batch
        b, h = x.shape[0], self.emb(x)[:, :4].contiguous()
        windows = h.view(b * 2, 2, D)
        q, k, v = F.linear(windows, self.qkv.weight, self.qkv.bias).view(b * 2, 2, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        heads = (q @ k.transpose(-1, -2) / D ** 0.5).softmax(-1) @ v  # [B·2, heads, 2, d/heads]
        out = self.proj(heads.transpose(1, 2).reshape(b * 2, 2, D)).view(b, 4, D)
        return per_example_token_mean(self.head(torch.tanh(out)), y[:, :4])


class InPlaceOnLinearOutput(Base):
    """``q = self.q(h); q /= 2`` on a [B, T, d] Linear output (Longformer/LED's query scaling, Swinv2), and an
    in-place change through a slice of it. Were its hook lost, ghost would take ``q.weight`` for unused (its
    input-gradient-only forward leaves ``p.grad`` empty): zero gradients, silently."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.q, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        q = self.q(self.emb(x))
        q /= 2.0
        q[..., :2] *= 3.0  # through a view of it: the output's hook must still see the gradient
        q.tanh_()
        return F.cross_entropy(self.head(q).flatten(0, 1), y.flatten())


class ReentrantCheckpoint(Base):
    """``torch.utils.checkpoint(..., use_reentrant=True)``: the block's forward runs without gradients and is
    recomputed inside backward, where the hooks see it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=True)
        return F.cross_entropy(self.b(h), y)


class ReentrantCheckpointOnHidden(Base):
    """``checkpoint(block, h, use_reentrant=True)`` on hidden states that require grad (Hugging Face's gradient
    checkpointing with ``use_reentrant=True``): such a graph refuses ``torch.autograd.grad``, which the first step's
    probe used for its reference (a crash before); a self-attention encoder layer and a custom RMSNorm inside."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.layer = nn.TransformerEncoderLayer(D, 2, 2 * D, 0.0, batch_first=True)
        self.norm = ScaleNorm("plain")

    def loss(self, batch):
        x, y = batch
        h = torch.utils.checkpoint.checkpoint(lambda t: self.norm(self.layer(t)), self.emb(x), use_reentrant=True)
        return per_example_token_mean(self.head(h), y)


class _Latents(nn.Module):
    """Learned latents expanded over the batch from an int (transformers' PerceiverEmbeddings)."""

    def __init__(self, k: int, d: int) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(k, d))

    def forward(self, batch_size: int) -> Tensor:
        return self.latents.expand(batch_size, -1, -1)


class BatchSizedLatents(Base):
    """A leaf called with the batch size only (no tensor argument) whose output has a row per example."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lat, self.head = nn.Embedding(V, D), _Latents(2, D), nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        h = self.emb(x)
        q = self.lat(x.shape[0])
        att = torch.softmax(q @ h.transpose(1, 2), -1) @ h
        return F.cross_entropy(self.head(att.mean(1)), y[:, 0] % 3)


class _ShapePositions(nn.Embedding):
    """Positions from the input's shape, not from a tensor (transformers' LEDLearnedPositionalEmbedding)."""

    def forward(self, shape: torch.Size) -> Tensor:  # type: ignore[override]
        return super().forward(torch.arange(shape[1]))


class PositionsFromAShape(Base):
    """A lookup called with a torch.Size only: ``[T, d]``, broadcast over the batch by ``h + pos``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, D), _ShapePositions(T, D), nn.Linear(D, V)

    def loss(self, batch):
        x, y = batch
        h = torch.tanh(self.tok(x) + self.pos(x.shape))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class _RoutedExperts(nn.Module):
    """Experts applied to the rows routed to each (torch.nonzero): a mixture-of-experts block's routing. Hugging
    Face's experts own stacked weights and an ``act_fn`` child (``act=True``); ``dropout`` draws inside."""

    def __init__(self, act: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, D, D))
        self.act = nn.SiLU() if act else None
        self.dropout = dropout

    def forward(self, h: Tensor, route: Tensor) -> Tensor:
        out = torch.zeros_like(h)
        for e in range(2):
            rows = torch.nonzero(route == e).squeeze(-1)
            y = h[rows] @ self.w[e]
            y = self.act(y) if self.act is not None else y
            out = out.index_add(0, rows, F.dropout(y, self.dropout, self.training))
        return out


class MixtureOfExperts(Base):
    """Data-dependent shapes inside a layer (vmap cannot run it): replayed once per example, exact. With
    ``tokens``, the experts see the batch's tokens flattened to ``[B·T, d]`` (a view) and route each token."""

    def __init__(self, act: bool = False, tokens: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.a, self.experts, self.b = nn.Linear(D, D), _RoutedExperts(act, dropout), nn.Linear(D, 3)
        self.tokens = tokens

    def loss(self, batch):
        x, y = batch
        if self.tokens:  # two tokens per example: the row and its flip
            h = torch.tanh(self.a(torch.stack([x, x.flip(-1)], 1)))  # [B, 2, d]
            flat = h.view(-1, D)
            routed = self.experts(flat, (flat[:, 0] > 0).long()).view(h.shape)
            return F.cross_entropy(self.b(routed.mean(1)), y)
        h = torch.tanh(self.a(x))
        return F.cross_entropy(self.b(self.experts(h, (h[:, 0] > 0).long())), y)


class _Router(nn.Module):
    """A mixture-of-experts router: returns its logits *and* the top-k weights computed from them, so a hook on
    the logits also sees the gradient of the inner use (softmax → top-k), besides the model's own uses."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, D))
        self.scattered = False

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = F.linear(h, self.weight)
        top, index = torch.topk(logits.softmax(-1), 2, dim=-1)
        top /= top.sum(-1, keepdim=True)
        if self.scattered:  # scores of every expert, written in place into a tensor made without the examples
            top = torch.zeros(h.shape[0], 4, dtype=h.dtype, device=h.device).scatter_(1, index, top)
        return logits, top, index


class RoutedTokens(Base):
    """Tokens flattened to [B·T, d], weighted by the router's top weight; ``use_logits`` also adds an auxiliary
    term on the logits (the model's own use of the first output); ``scattered``: the router writes its top-k weights
    into a zeros tensor of all experts in place (``scatter_``: vmap cannot batch that write; the loop replays it)."""

    def __init__(self, use_logits: bool = False, scattered: bool = False) -> None:
        super().__init__()
        self.a, self.router, self.b = nn.Linear(D, D), _Router(), nn.Linear(D, 3)
        self.use_logits, self.router.scattered = use_logits, scattered

    def loss(self, batch):
        x, y = batch
        h = torch.tanh(self.a(torch.stack([x, x.flip(-1)], 1)))
        flat = h.view(-1, D)
        logits, top, _ = self.router(flat)
        out = (flat * top[:, :1]).view(h.shape).mean(1)
        if self.use_logits:
            out = out + logits.view(h.shape[0], 2, -1).pow(2).mean((1, 2)).unsqueeze(1)
        return F.cross_entropy(self.b(out), y)


class UnusedParameters(Base):
    """A pooler and a second head that the loss never reads (Hugging Face poolers, mask tokens, spare heads):
    their per-example gradients are exactly zero."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 3)
        self.pooler, self.spare_head = nn.Linear(D, D), nn.Linear(D, 5)
        self.mask_token = nn.Parameter(torch.randn(1, D))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.b(torch.tanh(self.a(x))), y)


class FunctionalUseOfAnIdleLayer(UnusedParameters):
    """The spare head's weight read outside while its module never runs: by ``F.linear`` (a functional linear layer,
    served) or, with ``matmul``, by ``(w @ h.t()).t()`` (a real gradient no rule serves)."""

    def __init__(self, matmul: bool = False) -> None:
        super().__init__()
        self.matmul = matmul

    def loss(self, batch):
        x, y = batch
        h = torch.tanh(self.a(x))
        extra = (self.pooler.weight @ h.t()).t() if self.matmul else F.linear(h, self.pooler.weight)
        return F.cross_entropy(self.b(h), y) + 0.1 * extra.pow(2).mean()


class Plain(Base):
    """A well-behaved MLP (the control)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.b(torch.tanh(self.a(x))), y)


class GradInValidation(Plain):
    """A validation_step that differentiates under enable_grad (input-gradient saliency)."""

    calls = 0

    def val_dataloader(self):
        return DataLoader(_as_double(vector_data(1)), batch_size=N)

    def validation_step(self, batch, batch_idx):
        type(self).calls += 1
        x, y = batch
        with torch.enable_grad():
            x = x[:2].clone().requires_grad_(True)  # a different batch size than training
            out = self.b(torch.tanh(self.a(x))).sum()
            torch.autograd.grad(out, x)


# ---------------------------------------------------------------- harness
def reference_update(model: Base, dataset: Dataset, collate: Callable, C: float, B: float) -> list[Tensor]:
    """−Σ_i clip_C(g_i)/B by a per-example loop (each example collated alone), lr = 1."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(dataset)):
        out = model.training_step(collate([dataset[i]]), 0)
        loss = out.mean() if out.dim() else out
        grads = gradients_of(loss, params)  # .backward() where a reentrant checkpoint refuses .grad()
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, C / (float(norm) + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads)]
    return [-t / B for t in total]


def private_step(model: Base, dataset: Dataset, collate: Optional[Callable] = None, per_sample: str = "auto",
                 C: float = 0.3, physical: Optional[int] = None, public_state: Sequence[str] = (),
                 **trainer_kwargs: Any) -> tuple[DPStrategy, list[Tensor]]:
    """One step of DPStrategy with zero noise and q = 1; returns the strategy and the parameter update."""
    from conftest import quiet_trainer

    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=C, per_sample=per_sample, noise=ZeroNoise(),
                          max_physical_batch_size=physical, public_state=public_state)
    trainer = quiet_trainer(strategy=strategy, max_steps=1, **trainer_kwargs)
    loader = DataLoader(dataset, batch_size=len(dataset), collate_fn=collate)
    trainer.fit(model, loader)
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    return strategy, [a - b for a, b in zip(after, before)]


def assert_exact(factory: Callable[[], Base], dataset: Dataset, collate: Optional[Callable] = None,
                 per_sample: str = "auto", C: float = 0.3, physical: Optional[int] = None, rtol: float = 1e-6,
                 atol: float = 1e-9, public_state: Sequence[str] = (), **trainer_kwargs: Any) -> DPStrategy:
    """The private step equals the per-example-loop reference (float64; ``rtol``/``atol`` looser only for a model
    that computes part of its forward in float32 itself)."""
    torch.manual_seed(0)
    model = factory().double()
    reference = reference_update(copy.deepcopy(model), _as_double(dataset), collate or default_collate, C,
                                 float(len(dataset)))
    strategy, update = private_step(model, _as_double(dataset), collate, per_sample, C, physical, public_state,
                                    **trainer_kwargs)
    for got, want in zip(update, reference):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    return strategy


def assert_refused(factory: Callable[[], Base], dataset: Dataset, match: str, collate: Optional[Callable] = None,
                   per_sample: str = "auto", **trainer_kwargs: Any) -> None:
    """A PrivacyConfigurationError matching ``match`` before the first release; parameters untouched."""
    import pytest

    from lightning_dp import PrivacyConfigurationError

    torch.manual_seed(0)
    model = factory().double()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match=match):
        private_step(model, _as_double(dataset), collate, per_sample, **trainer_kwargs)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), "a release happened"


def _as_double(dataset: TensorDataset) -> TensorDataset:
    return TensorDataset(*(t.double() if t.is_floating_point() else t for t in dataset.tensors))
