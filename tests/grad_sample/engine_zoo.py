"""Small named models, one layer configuration each, for the engine equality suite
(test_engines_agree.py): every registered engine against the per-example loop, float64.

A :class:`Case` is a factory for a float64 ``nn.Module`` (seeded: every call builds the same
weights), a batch of ``N`` = 5 examples with targets, and a loss that is the MEAN over the batch of
a per-example loss (so the loss of ``x[i:i+1]`` is example i's loss). Cases cover: Linear (2-D, 3-D
and 4-D inputs); Conv1d/2d/3d with groups, stride, dilation, every padding mode and
``padding='same'``; ConvTranspose1d/2d; Embedding plain / ``padding_idx`` / ``max_norm`` / ``sparse`` /
``scale_grad_by_freq``; LayerNorm, GroupNorm, RMSNorm, InstanceNorm with and without affine (and
BatchNorm, which mixes examples); PReLU; custom leaves (one and two tensor inputs, keyword calls);
Bilinear; reused modules; tied weights; frozen parameters; and the adversarial models of
tests/zoo (broadcast ``[1, T]`` position lookup, nn.MultiheadAttention time-major and batch-first,
nn.TransformerEncoderLayer, LSTM/GRU/RNN, a parameter owned by a module with children).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

N = 5  # examples per batch
V, T, D = 11, 6, 4  # vocabulary, tokens per example, width

Loss = Callable[[nn.Module, Tensor, Tensor], Tensor]


def mse(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean over every element: every example has as many elements, so it is the mean of the
    per-example means."""
    return F.mse_loss(model(x), y)


def token_ce(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy over [n, T, V] logits: the mean over the n·T tokens (equal T per example)."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def cls_ce(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


@dataclass(frozen=True)
class Case:
    """One model of the suite.

    Attributes:
        name: the test id.
        module: builds the module (float32 weights are cast to float64 by :meth:`build`).
        inputs: the batch's input given a generator (float tensors are made float64).
        loss: mean-over-the-batch loss ``loss(model, x, y)``.
        targets: the targets given a generator and the model's output on the batch; default: a
            standard normal tensor shaped like the output (for :func:`mse`).
        frozen: names of parameters set to ``requires_grad=False`` after building.
        note: what the case is about (shown in failure messages).
    """

    name: str
    module: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], Tensor]
    loss: Loss = mse
    targets: Optional[Callable[[torch.Generator, Tensor], Tensor]] = None
    frozen: tuple[str, ...] = ()
    note: str = ""
    seed: int = field(default=0)

    def build(self) -> nn.Module:
        """The module, float64, training mode, with :attr:`frozen` parameters frozen (same weights every call)."""
        torch.manual_seed(self.seed)
        model = self.module().double().train()
        named = dict(model.named_parameters())
        for name in self.frozen:
            named[name].requires_grad_(False)
        return model

    def batch(self) -> tuple[Tensor, Tensor]:
        """``(x, y)`` for N examples, the same every call."""
        g = torch.Generator().manual_seed(1000 + self.seed)
        x = self.inputs(g)
        if x.is_floating_point():
            x = x.double()
        with torch.no_grad():
            out = self.build()(x)
        y = self.targets(g, out) if self.targets is not None else torch.randn(out.shape, generator=g,
                                                                               dtype=torch.float64)
        return x, y


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters given to ``clip_and_sum``: the trainable ones, each once."""
    return [p for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------------------ inputs
def randn(*shape: int) -> Callable[[torch.Generator], Tensor]:
    return lambda g: torch.randn(N, *shape, generator=g)


def tokens(vocab: int = V, length: int = T, pad: Optional[int] = None) -> Callable[[torch.Generator], Tensor]:
    """[N, length] token ids; with ``pad``, several positions (and a whole example but one token) are ``pad``."""

    def make(g: torch.Generator) -> Tensor:
        idx = torch.randint(0, vocab, (N, length), generator=g)
        if pad is not None:
            idx[:, -2:] = pad
            idx[0, 1:] = pad
        return idx

    return make


def repeated_tokens(g: torch.Generator) -> Tensor:
    """Token ids with repeats within and across examples (frequency scaling differs per example)."""
    idx = torch.randint(0, 4, (N, T), generator=g)
    idx[0] = 2
    return idx


def token_targets(vocab: int = V) -> Callable[[torch.Generator, Tensor], Tensor]:
    return lambda g, out: torch.randint(0, vocab, out.shape[:-1], generator=g)


def class_targets(k: int) -> Callable[[torch.Generator, Tensor], Tensor]:
    return lambda g, out: torch.randint(0, k, (out.shape[0],), generator=g)


# ------------------------------------------------------------------------------------------ modules
def seq(*layers: nn.Module) -> nn.Module:
    """The layer(s) followed by tanh, so the loss's gradient depends on the layer's output nonlinearly."""
    return nn.Sequential(*layers, nn.Tanh())


class Leaf(nn.Module):
    """A custom leaf with its own parameters, used in its own forward (an optional second tensor)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.b = nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x: Tensor, scale: Optional[Tensor] = None) -> Tensor:
        out = torch.tanh(x @ self.w + self.b) * self.w.diagonal()
        return out if scale is None else out * scale


class LeafTwoInputs(nn.Module):
    """A custom leaf called with two per-example positional tensors: ``leaf(x, gate)``."""

    def __init__(self) -> None:
        super().__init__()
        self.leaf = Leaf()

    def forward(self, x: Tensor) -> Tensor:
        return self.leaf(x, torch.sigmoid(x.flip(-1)))


class KeywordLeaf(nn.Module):
    """Leaves called with keyword tensors: ``leaf(x=h, scale=…)``, ``lin(input=h)`` (tests/zoo)."""

    def __init__(self) -> None:
        super().__init__()
        self.leaf, self.lin = Leaf(), nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(input=torch.tanh(self.leaf(x=x, scale=x.abs() + 0.5)))


class UnbatchedKeyword(nn.Module):
    """An unbatched keyword tensor (a [D] gate shared by every example) that must not be sliced."""

    def __init__(self) -> None:
        super().__init__()
        self.leaf, self.lin = Leaf(), nn.Linear(D, 3)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, D))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.leaf(x, scale=self.gate)))


class BilinearModel(nn.Module):
    """nn.Bilinear: a torch leaf with two per-example inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.bil = nn.Bilinear(D, 3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.bil(x, torch.cos(x[:, :3])))


class StdConv2d(nn.Conv2d):
    """A Conv2d subclass whose forward standardises the weight first (timm's StdConv2d)."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class MaskedLinear(nn.Linear):
    """A Linear subclass whose forward multiplies the weight by a fixed mask (pruning)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.register_buffer("mask", (torch.arange(d_in * d_out).reshape(d_out, d_in) % 3 != 0).double())

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)


class LayerNorm2d(nn.LayerNorm):
    """Channels-first LayerNorm (timm/ConvNeXt): normalises over C of [n, C, H, W] by permuting."""

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Reused(nn.Module):
    """One module called twice in a forward (``mid`` between the calls)."""

    def __init__(self, layer: nn.Module, mid: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.layer = layer
        self.mid = mid if mid is not None else nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.layer(self.mid(self.layer(x))))


class ReusedEmbedding(nn.Module):
    """One embedding looking up two index tensors of different lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x) + self.emb(x[:, :3].flip(1)).mean(1, keepdim=True)
        return self.head(torch.tanh(h))


class TiedEmbeddingHead(nn.Module):
    """Embedding + output Linear sharing one Parameter (``head.weight = emb.weight``)."""

    def __init__(self, padding_idx: Optional[int] = None) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(V, D, padding_idx=padding_idx), nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


class TiedLinears(nn.Module):
    """Two Linear layers sharing one weight (separate biases), on 3-D inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.b(torch.tanh(self.a(x))))


class Frozen(nn.Module):
    """A mix of frozen and trainable parameters (which ones: the case's ``frozen``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.ln = nn.LayerNorm(D)
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        h = h + torch.tanh(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return self.head(torch.tanh(self.lin(self.ln(h))))


class BroadcastPositions(nn.Module):
    """Hugging Face style: a [1, T] position lookup broadcast over the batch (tests/zoo)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, D), nn.Embedding(T, D), nn.Linear(D, V)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1])[None])
        return self.head(torch.tanh(h))


class SharedTableBroadcast(nn.Module):
    """One embedding looked up per example ([n, T] tokens) and once for the batch ([1, T] positions,
    broadcast): Opacus puts the [1, T] call's grad sample in row 0 of a [n, …] tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(x) + self.emb(torch.arange(x.shape[1])[None])))


class Attention(nn.Module):
    """nn.MultiheadAttention as users call it: time-major by default, a causal [T, T] mask, keywords."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=batch_first)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        h = h if self.batch_first else h.transpose(0, 1)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        out, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(torch.tanh(out))


class EncoderLayer(nn.Module):
    """nn.TransformerEncoderLayer (batch_first=False: time-major inside), causal mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.enc = nn.TransformerEncoderLayer(D, 2, dim_feedforward=8, dropout=0.0)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=torch.float64)
        h = self.enc(self.emb(x).transpose(0, 1), src_mask=mask)
        return self.head(h.transpose(0, 1))


class Recurrent(nn.Module):
    """nn.LSTM / GRU / RNN, classifying from the last layer's final hidden state ([L, B, H] always)."""

    def __init__(self, kind: str, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, 3)
        self.rnn = getattr(nn, kind)(D, D, num_layers=2, batch_first=batch_first)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x) if self.batch_first else self.emb(x).transpose(0, 1)
        _, hidden = self.rnn(h)
        last = (hidden[0] if isinstance(hidden, tuple) else hidden)[-1]
        return self.head(torch.tanh(last))


class RootParameter(nn.Module):
    """A parameter read directly in a module that also has children (timm's cls_token habit)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.randn(D) * 0.1)
        self.lin = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x * (1 + self.shift)))


class MLP(nn.Module):
    """The control: Linear-Tanh-Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, 5), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def conv_case(name: str, conv: Callable[[], nn.Module], in_shape: tuple[int, ...], note: str = "") -> Case:
    return Case(name, lambda: seq(conv()), randn(*in_shape), note=note)


def norm_case(name: str, norm: Callable[[], nn.Module], in_shape: tuple[int, ...], channels_last: bool,
              note: str = "") -> Case:
    """A Linear (so a case without affine parameters still has something to train) then the norm."""
    c = in_shape[-1] if channels_last else in_shape[0]

    class WithNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.norm = nn.Linear(c, c), norm()
            if getattr(self.norm, "weight", None) is not None:  # not the identity init: a non-trivial gradient
                nn.init.uniform_(self.norm.weight, 0.5, 1.5)
            if getattr(self.norm, "bias", None) is not None:
                nn.init.uniform_(self.norm.bias, -0.5, 0.5)

        def forward(self, x: Tensor) -> Tensor:
            h = self.lin(x) if channels_last else self.lin(x.movedim(1, -1)).movedim(-1, 1)
            return torch.tanh(self.norm(h))

    return Case(name, WithNorm, randn(*in_shape), note=note)


# ------------------------------------------------------------------------------------------ the list
CASES: list[Case] = [
    # Linear
    Case("linear_2d", lambda: seq(nn.Linear(D, 3)), randn(D)),
    Case("linear_3d", lambda: seq(nn.Linear(D, 3)), randn(T, D), note="[n, T, d] input"),
    Case("linear_4d_nobias", lambda: seq(nn.Linear(D, 3, bias=False)), randn(2, 3, D)),
    Case("linear_subclass_masked", lambda: seq(MaskedLinear(D, 3)), randn(D),
         note="a Linear subclass whose forward masks the weight"),
    Case("mlp", MLP, randn(D), loss=cls_ce, targets=class_targets(3), note="the control"),
    # Conv1d
    conv_case("conv1d", lambda: nn.Conv1d(3, 4, 3), (3, 9)),
    conv_case("conv1d_stride_dilation_pad", lambda: nn.Conv1d(3, 4, 3, stride=2, dilation=2, padding=2), (3, 11)),
    conv_case("conv1d_groups", lambda: nn.Conv1d(4, 6, 3, groups=2, padding=1, bias=False), (4, 8)),
    conv_case("conv1d_depthwise", lambda: nn.Conv1d(4, 8, 3, groups=4, padding=1), (4, 8)),
    conv_case("conv1d_same", lambda: nn.Conv1d(3, 4, 4, padding="same", dilation=2), (3, 9),
              note="padding='same' with an even kernel: asymmetric padding"),
    conv_case("conv1d_reflect", lambda: nn.Conv1d(3, 4, 3, padding=2, padding_mode="reflect"), (3, 8)),
    conv_case("conv1d_replicate", lambda: nn.Conv1d(3, 4, 3, padding=1, padding_mode="replicate"), (3, 8)),
    conv_case("conv1d_circular", lambda: nn.Conv1d(3, 4, 3, padding=1, padding_mode="circular"), (3, 8)),
    # Conv2d
    conv_case("conv2d", lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 6, 6)),
    conv_case("conv2d_stride_dilation", lambda: nn.Conv2d(3, 4, 3, stride=2, dilation=2, padding=1), (3, 9, 8)),
    conv_case("conv2d_rect_kernel", lambda: nn.Conv2d(2, 3, (2, 3), stride=(2, 1), padding=(1, 0)), (2, 6, 5)),
    conv_case("conv2d_groups", lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1), (4, 5, 5)),
    conv_case("conv2d_depthwise", lambda: nn.Conv2d(3, 6, 3, groups=3, bias=False), (3, 6, 6)),
    conv_case("conv2d_same", lambda: nn.Conv2d(3, 4, (4, 3), padding="same"), (3, 6, 6),
              note="padding='same' with an even kernel: asymmetric padding"),
    conv_case("conv2d_same_dilation", lambda: nn.Conv2d(3, 4, 3, padding="same", dilation=(2, 1)), (3, 6, 5)),
    conv_case("conv2d_valid", lambda: nn.Conv2d(3, 4, 3, padding="valid"), (3, 6, 6)),
    conv_case("conv2d_reflect", lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (3, 6, 6)),
    conv_case("conv2d_replicate", lambda: nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode="replicate"), (3, 6, 6)),
    conv_case("conv2d_circular", lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"), (3, 6, 6)),
    # Conv3d
    conv_case("conv3d", lambda: nn.Conv3d(2, 3, 3, stride=(1, 2, 1), padding=1), (2, 4, 5, 4)),
    conv_case("conv3d_groups_dilation", lambda: nn.Conv3d(4, 2, 2, groups=2, dilation=(1, 2, 1)), (4, 3, 5, 3)),
    conv_case("conv3d_same", lambda: nn.Conv3d(2, 3, (2, 3, 2), padding="same", dilation=(1, 1, 2)), (2, 3, 4, 5)),
    conv_case("conv3d_replicate", lambda: nn.Conv3d(2, 3, 3, padding=1, padding_mode="replicate"), (2, 3, 4, 3)),
    conv_case("conv3d_circular", lambda: nn.Conv3d(2, 3, 3, padding=1, padding_mode="circular"), (2, 3, 4, 3)),
    conv_case("conv2d_subclass_std", lambda: StdConv2d(3, 4, 3, padding=1), (3, 5, 5),
              note="a Conv2d subclass whose forward transforms the weight"),
    # ConvTranspose
    conv_case("convtranspose1d", lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
              (3, 5)),
    conv_case("convtranspose2d_groups", lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, groups=2, dilation=2),
              (4, 3, 3)),
    # Embedding
    Case("embedding", lambda: nn.Sequential(nn.Embedding(V, D), nn.Tanh(), nn.Linear(D, V)), tokens(),
         loss=token_ce, targets=token_targets()),
    Case("embedding_1d_index", lambda: seq(nn.Embedding(V, D)), lambda g: torch.randint(0, V, (N,), generator=g),
         note="one index per example: [n] -> [n, d]"),
    Case("embedding_padding_idx", lambda: seq(nn.Embedding(V, D, padding_idx=1)), tokens(pad=1),
         note="the padding row gets no gradient"),
    Case("embedding_max_norm", lambda: seq(nn.Embedding(V, D, max_norm=1.0)), tokens(),
         note="the forward renormalises looked-up rows in place"),
    Case("embedding_sparse", lambda: seq(nn.Embedding(V, D, sparse=True)), tokens(),
         note="autograd's weight gradient is a sparse tensor"),
    Case("embedding_scale_grad_by_freq", lambda: seq(nn.Embedding(4, D, scale_grad_by_freq=True)), repeated_tokens,
         note="gradient divided by the token's frequency in the mini-batch (per example: in the example)"),
    # Normalisation (after a Linear)
    norm_case("layernorm", lambda: nn.LayerNorm(D), (T, D), True),
    norm_case("layernorm_noaffine", lambda: nn.LayerNorm(D, elementwise_affine=False), (T, D), True),
    norm_case("layernorm_nobias_2d_shape", lambda: nn.LayerNorm((T, D), bias=False), (T, D), True),
    norm_case("groupnorm", lambda: nn.GroupNorm(2, 4), (4, 5), False),
    norm_case("groupnorm_noaffine", lambda: nn.GroupNorm(2, 4, affine=False), (4, 3, 3), False),
    norm_case("rmsnorm", lambda: nn.RMSNorm(D), (T, D), True),
    norm_case("rmsnorm_noaffine", lambda: nn.RMSNorm(D, elementwise_affine=False), (T, D), True),
    norm_case("instancenorm1d_affine", lambda: nn.InstanceNorm1d(4, affine=True), (4, 6), False),
    norm_case("instancenorm1d", lambda: nn.InstanceNorm1d(4), (4, 6), False),
    norm_case("instancenorm2d_affine", lambda: nn.InstanceNorm2d(4, affine=True), (4, 3, 3), False),
    norm_case("instancenorm2d", lambda: nn.InstanceNorm2d(4), (4, 3, 3), False),
    norm_case("instancenorm3d_affine", lambda: nn.InstanceNorm3d(4, affine=True), (4, 2, 3, 2), False),
    norm_case("instancenorm2d_affine_running_stats",
              lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True), (4, 3, 3), False,
              note="training mode: per-example statistics (the running ones are only updated)"),
    norm_case("layernorm2d_subclass", lambda: LayerNorm2d(4), (4, 3, 4), False,
              note="a LayerNorm subclass normalising channels-first (C = W: no shape error)"),
    norm_case("batchnorm2d", lambda: nn.BatchNorm2d(4), (4, 3, 3), False,
              note="normalises with batch statistics: mixes examples"),
    # PReLU, custom leaves, Bilinear
    Case("prelu", lambda: nn.Sequential(nn.Linear(D, D), nn.PReLU()), randn(D)),
    Case("prelu_channels", lambda: nn.Sequential(nn.Conv1d(2, 3, 2), nn.PReLU(3)), randn(2, 5)),
    Case("custom_leaf", Leaf, randn(T, D), note="its own nn.Parameters in its own forward"),
    Case("custom_leaf_two_inputs", LeafTwoInputs, randn(D), note="leaf(x, gate): two per-example positional tensors"),
    Case("custom_leaf_keywords", KeywordLeaf, randn(D), note="leaf(x=h, scale=…), lin(input=h)"),
    Case("custom_leaf_unbatched_keyword", UnbatchedKeyword, randn(D), note="a [D] keyword tensor shared by all"),
    Case("bilinear", BilinearModel, randn(D), note="a torch layer with two per-example inputs"),
    # Reused modules
    Case("reused_linear", lambda: Reused(nn.Linear(D, D)), randn(T, D)),
    Case("reused_conv2d", lambda: Reused(nn.Conv2d(2, 2, 3, padding=1)), randn(2, 5, 5)),
    Case("reused_conv2d_shapes", lambda: Reused(nn.Conv2d(2, 2, 3), nn.Upsample(scale_factor=2)), randn(2, 5, 5),
         note="the second call sees a larger input"),
    Case("reused_layernorm", lambda: Reused(nn.LayerNorm(D), nn.Linear(D, D)), randn(T, D)),
    Case("reused_embedding", ReusedEmbedding, tokens(), loss=token_ce, targets=token_targets()),
    Case("reused_prelu", lambda: Reused(nn.PReLU(), nn.Linear(D, D)), randn(D)),
    # Tied weights
    Case("tied_embedding_head", TiedEmbeddingHead, tokens(), loss=token_ce, targets=token_targets()),
    Case("tied_embedding_padding_idx", lambda: TiedEmbeddingHead(padding_idx=1), tokens(pad=1), loss=token_ce,
         targets=token_targets(), note="the padding row gets the head's gradient only"),
    Case("tied_linears", TiedLinears, randn(T, D)),
    # Frozen parameters
    Case("frozen_mixed", Frozen, tokens(), loss=token_ce, targets=token_targets(),
         frozen=("emb.weight", "conv.bias", "ln.bias", "lin.weight"),
         note="frozen: the embedding, a conv bias, a LayerNorm bias, a Linear weight"),
    Case("frozen_conv2d_weight", lambda: seq(nn.Conv2d(2, 3, 3, padding=1)), randn(2, 4, 4), frozen=("0.weight",),
         note="only the bias of a Conv2d trains"),
    Case("frozen_all_but_head", Frozen, tokens(), loss=token_ce, targets=token_targets(),
         frozen=("emb.weight", "conv.weight", "conv.bias", "ln.weight", "ln.bias", "lin.weight", "lin.bias")),
    # Adversarial models (tests/zoo)
    Case("broadcast_positions", BroadcastPositions, tokens(), loss=token_ce, targets=token_targets(),
         note="a [1, T] position lookup broadcast over the batch"),
    Case("broadcast_shared_table", SharedTableBroadcast, tokens(), loss=token_ce, targets=token_targets(),
         note="one table looked up with [n, T] and with a broadcast [1, T]"),
    Case("mha_time_major", lambda: Attention(batch_first=False), tokens(), loss=token_ce, targets=token_targets()),
    Case("mha_batch_first", lambda: Attention(batch_first=True), tokens(), loss=token_ce, targets=token_targets()),
    Case("transformer_encoder_layer", EncoderLayer, tokens(), loss=token_ce, targets=token_targets()),
    Case("lstm_batch_first", lambda: Recurrent("LSTM", True), tokens(), loss=cls_ce, targets=class_targets(3)),
    Case("gru_time_major", lambda: Recurrent("GRU", False), tokens(), loss=cls_ce, targets=class_targets(3)),
    Case("rnn_batch_first", lambda: Recurrent("RNN", True), tokens(), loss=cls_ce, targets=class_targets(3)),
    Case("root_parameter", RootParameter, randn(D), note="a parameter owned by a module with children"),
]

BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"
