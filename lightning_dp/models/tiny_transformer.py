"""A small causal transformer language model, built so that every per-example engine applies.

Only ``nn.Embedding``, ``nn.Linear`` and ``nn.LayerNorm`` own parameters (no
``nn.MultiheadAttention``, whose fused projection is not batch-first for the engines),
every layer is batch-first, position ids are expanded to ``[batch, T]`` before their
embedding, and the output head is *not* tied to the token embedding (tied weights rule
out ghost norms). ``DPStrategy(per_sample="auto")`` therefore picks the ghost engine.
Used by the transformer experiment of issue 9 (design-principles §5.2).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention from one ``Linear(d, 3d)`` and one ``Linear(d, d)``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads}).")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: [b, T, d] -> [b, T, d], each position attending to itself and the past."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, T, d/h]
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)); x + MLP(LN(x)) with GELU."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """[b, T, d] -> [b, T, d]."""
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformerLM(pl.LightningModule):
    """Causal transformer LM (next-token cross-entropy), small enough for a CPU.

    Defaults: 2 layers, d = 128, 4 heads, MLP width 4d; with a byte vocabulary (256) and
    context 64 that is about 0.44 M parameters.

    Args:
        vocab_size: number of token ids.
        max_len: the longest context (size of the position table).
        d_model, n_layers, n_heads, d_ff: width, depth, heads, MLP width (default 4·d_model).
        lr: learning rate.
        optimizer: ``"adam"`` (torch.optim.Adam: ``AdamVariant`` swaps in a DP variant)
            or ``"sgd"`` (with ``momentum``).
        momentum: SGD momentum.
        betas, eps: Adam's.
        weight_decay: coupled weight decay (as torch).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        max_len: int = 64,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        d_ff: int | None = None,
        lr: float = 1e-3,
        optimizer: str = "adam",
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}.")
        if min(vocab_size, max_len, d_model, n_layers, n_heads) < 1:
            raise ValueError("vocab_size, max_len, d_model, n_layers and n_heads must all be >= 1.")
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_ff or 4 * d_model) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.apply(_init)

    def forward(self, ids: Tensor) -> Tensor:
        """Logits [b, T, vocab] for token ids [b, T] (T ≤ max_len)."""
        b, t = ids.shape
        if t > self.hparams.max_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_len={self.hparams.max_len}.")
        positions = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t)  # batch-first for the engines
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Mean next-token cross-entropy (nats per token) over the batch.

        It equals the mean over examples of each window's mean token loss, so the
        per-example gradient the DP engines clip is that of one window.
        """
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Next-token loss; logged as ``train/loss``."""
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Next-token loss on the validation windows (``val/loss``, epoch mean)."""
        self.log("val/loss", self.loss(batch), prog_bar=True)

    def configure_model(self) -> None:
        """Under ``DPShardedStrategy`` (Lightning's ``ModelParallelStrategy``: a device mesh is set), shard each
        block and then the root with FSDP2's ``fully_shard``; otherwise nothing (replicated, as under
        ``DPStrategy``)."""
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """torch.optim.Adam or SGD with momentum, per ``optimizer``."""
        hp = self.hparams
        if hp.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        return torch.optim.Adam(self.parameters(), lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
                                weight_decay=hp.weight_decay)


@torch.no_grad()
def evaluate_loss(model: TinyTransformerLM, dataset: torch.utils.data.TensorDataset, batch_size: int = 256) -> float:
    """Mean next-token loss of ``model`` over a whole dataset of windows (eval mode restored after)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    x_all, y_all = dataset.tensors
    for start in range(0, x_all.shape[0], batch_size):
        x, y = x_all[start : start + batch_size], y_all[start : start + batch_size]
        total += float(model.loss((x.to(model.device), y.to(model.device)))) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / max(count, 1)


def _init(module: nn.Module) -> None:
    """GPT-2-style initialisation: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def parameter_count(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = ["Block", "CausalSelfAttention", "TinyTransformerLM", "evaluate_loss", "parameter_count"]
